"""Tokens on the wire and typed errors: the client's pure pieces."""

import struct

import grpc
import numpy as np
import pytest
import torch

import prefixd.client as pc
from prefixd.client import wire
from prefixd.client.errors import from_status
from prefixd.client.wire import pack_tokens, unpack_ints

PACKED = np.arange(5, dtype="<i4").tobytes()


@pytest.mark.parametrize("tokens", [
    [0, 1, 2, 3, 4],
    np.arange(5, dtype=np.int64),
    np.arange(5, dtype=np.int32),
    torch.arange(5),
    torch.arange(5, dtype=torch.int32),
    PACKED,
    bytearray(PACKED),
])
def test_pack_tokens_gives_little_endian_int32_for_every_accepted_kind(tokens):
    assert pack_tokens(tokens) == PACKED
    assert unpack_ints(pack_tokens(tokens)) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("tokens", [
    [1.5, 2.0],
    torch.tensor([1.0, 2.0]),
    [-1, 3],
    [2**31],
    [[1, 2], [3, 4]],
    b"\x00\x01\x02",
])
def test_pack_tokens_refuses_what_is_not_token_ids(tokens):
    with pytest.raises(pc.InvalidArgument):
        pack_tokens(tokens)


def test_pack_tokens_of_an_empty_prompt_is_empty():
    assert pack_tokens([]) == b"" and pack_tokens(torch.empty(0, dtype=torch.long)) == b""


@pytest.mark.parametrize("code, kind", [
    (grpc.StatusCode.INVALID_ARGUMENT, pc.InvalidArgument),
    (grpc.StatusCode.NOT_FOUND, pc.NotFound),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, pc.ResourceExhausted),
    (grpc.StatusCode.FAILED_PRECONDITION, pc.FailedPrecondition),
    (grpc.StatusCode.UNAVAILABLE, pc.Unavailable),
    (grpc.StatusCode.DATA_LOSS, pc.DataLoss),
    (grpc.StatusCode.DEADLINE_EXCEEDED, pc.DeadlineExceeded),
    (grpc.StatusCode.INTERNAL, pc.PrefixdError),
])
def test_each_status_maps_to_its_typed_error_with_the_daemons_message(code, kind):
    err = from_status(code, "pool full: release a sequence")
    assert type(err) is kind and err.code is code
    assert err.message == "pool full: release a sequence"
    assert str(err) == f"{code.name}: pool full: release a sequence"


def test_typed_errors_are_also_the_builtin_kinds_callers_catch():
    assert isinstance(from_status(grpc.StatusCode.INVALID_ARGUMENT, "x"), ValueError)
    assert isinstance(from_status(grpc.StatusCode.NOT_FOUND, "x"), LookupError)
    assert isinstance(pc.SharedBlockError("x"), pc.FailedPrecondition)


@pytest.mark.parametrize("native", [True, False])
def test_unpack_ints_reads_little_endian_int32_on_either_path(monkeypatch, native):
    """The memoryview cast (a little-endian host) and numpy's decoding agree, signs and
    extremes included."""
    monkeypatch.setattr(wire, "_NATIVE_LE_I32", native and wire._NATIVE_LE_I32)
    values = [0, 1, -1, 2**31 - 1, -(2**31), 123456]
    assert unpack_ints(struct.pack(f"<{len(values)}i", *values)) == values
    assert unpack_ints(b"") == []
