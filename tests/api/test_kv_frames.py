"""prefixd.api.kv_frames: KV chunks encoded with one copy and decoded with none, always as
protobuf itself would encode and decode them."""

import pytest
import torch
from google.protobuf.message import DecodeError

from prefixd.api import prefixd_pb2 as pb
from prefixd.api.kv_frames import (
    KVFrame, decode_kv_frame, decode_read_reply, decode_write_request, framed_kv, framed_kv_to_fill,
)
from prefixd.api.tensors import DTYPES, tensor_from_bytes, to_kv_chunk

SID = 2**62 + 3


def _kv(n=37, dtype=torch.float16):
    return torch.randn(2, 2, n, 3, 8).to(dtype)


def _request(kv, start=300, seq_id=7) -> pb.WriteKVRequest:
    req = pb.WriteKVRequest(session_id=SID)
    to_kv_chunk(seq_id, start, kv, out=req.chunk)
    return req


def _same(frame: KVFrame, want) -> None:
    """``frame`` decodes to ``want`` (a message protobuf decoded), KV bytes included."""
    field = "chunk"
    data = getattr(want, field).data
    assert bytes(frame.data) == data
    got = type(want)()
    got.CopyFrom(frame.message)
    if want.HasField(field):
        getattr(got, field).data = data
    assert got == want and got.HasField(field) == want.HasField(field)


def test_framed_kv_is_exactly_protobufs_encoding():
    """``framed_kv`` hand-builds WriteKV requests and ReadKV replies (one copy of the KV); a
    receiver parses them with the generated classes, so the bytes must be protobuf's own --
    also for a token slice of a larger tensor (joined from its per-layer pieces)."""
    kv = _kv()
    for piece in (kv, kv[:, :, 5:21], kv[:, :, :0], kv.transpose(3, 4).contiguous().transpose(3, 4)):
        outer = pb.WriteKVRequest(session_id=SID).SerializeToString()
        assert framed_kv(outer, 2, 7, 300, piece) == _request(piece).SerializeToString()
        reply = pb.ReadKVReply()
        to_kv_chunk(7, 0, piece, out=reply.chunk)
        assert framed_kv(b"", 1, 7, 0, piece) == reply.SerializeToString()


def test_a_decoded_frame_views_the_received_bytes():
    """Regression (kv.rpc_gbps): protobuf's ``FromString`` and every read of ``chunk.data``
    each copied the 4 MiB of a KV message; a frame's data is a view of the message's bytes."""
    kv = _kv()
    raw = _request(kv).SerializeToString()
    frame = decode_write_request(raw)
    assert isinstance(frame.data, memoryview) and frame.data.obj is raw
    assert frame.message.chunk.data == b""  # the KV lives in frame.data alone
    back = tensor_from_bytes(frame.data, frame.chunk.shape, frame.chunk.dtype)
    assert torch.equal(back.view(torch.int16), kv.view(torch.int16))
    assert frame.session_id == SID and frame.HasField("chunk")  # reads like the message
    reply = pb.ReadKVReply()
    to_kv_chunk(7, 0, kv, out=reply.chunk)
    raw = reply.SerializeToString()
    assert decode_read_reply(raw).data.obj is raw


@pytest.mark.parametrize("dtype", DTYPES)
def test_frames_decode_every_dtype_bit_for_bit(dtype):
    kv = _kv(dtype=getattr(torch, dtype))
    kv.view(torch.uint8).view(-1)[:16] = 0xFF  # NaN payloads travel as they are
    want = _request(kv)
    frame = decode_write_request(want.SerializeToString())
    _same(frame, want)
    back = tensor_from_bytes(frame.data, frame.chunk.shape, frame.chunk.dtype)
    assert torch.equal(back.view(torch.uint8), kv.view(torch.uint8))


def test_frames_decode_what_protobuf_decodes_in_any_field_order():
    """The fast path walks the wire itself; fields out of number order, unpacked ``shape``,
    unknown fields and a chunk without data all decode as protobuf decodes them."""
    kv = _kv(4)
    req = _request(kv)
    chunk = req.chunk
    data_field = bytes([6 << 3 | 2]) + _len(chunk.data) + chunk.data
    head = pb.KVChunk(seq_id=7, start=300, num_tokens=4, dtype="float16").SerializeToString()
    unpacked_shape = b"".join(bytes([4 << 3 | 0, s]) for s in chunk.shape)
    unknown = bytes([15 << 3 | 0, 42])
    body = data_field + unpacked_shape + unknown + head  # data first, shape unpacked
    raw = bytes([2 << 3 | 2]) + _len(body) + body + bytes([1 << 3 | 0]) + _varint(SID)
    want = pb.WriteKVRequest.FromString(raw)
    _same(decode_write_request(raw), want)
    only_data = bytes([2 << 3 | 2]) + _len(data_field) + data_field
    _same(decode_write_request(only_data), pb.WriteKVRequest.FromString(only_data))
    _same(decode_write_request(b""), pb.WriteKVRequest())
    _same(decode_read_reply(b""), pb.ReadKVReply())


def test_frames_merged_by_protobuf_take_its_fallback():
    """A chunk or a data field given twice is merged by protobuf (the last data wins): the
    fast path leaves those to ``FromString``, so the frame is still protobuf's decoding."""
    a, b = _request(_kv(3), start=1).SerializeToString(), _request(_kv(5), start=2).SerializeToString()
    twice = a + b  # two chunk fields (and two session ids): protobuf merges them
    _same(decode_write_request(twice), pb.WriteKVRequest.FromString(twice))
    group = a + b"\x7b\x7c"  # an unknown (empty) group, field 15
    _same(decode_write_request(group), pb.WriteKVRequest.FromString(group))


@pytest.mark.parametrize("raw", [b"\x12\x05\x08", b"\x12\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",
                                 b"\x08", b"\x12\x02\x32\x05"])
def test_malformed_frames_raise_decode_error_like_protobuf(raw):
    with pytest.raises(DecodeError):
        pb.WriteKVRequest.FromString(raw)
    with pytest.raises(DecodeError):
        decode_kv_frame(raw, pb.WriteKVRequest)


def test_frame_of_a_decoded_message_leaves_it_as_it_was():
    want = _request(_kv(2))
    frame = KVFrame.of(want)
    assert bytes(frame.data) == want.chunk.data and frame.message is want
    assert KVFrame.of(frame) is frame
    assert KVFrame.of(pb.WriteKVRequest(session_id=1)).data == b""


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append(n & 0x7F | (0x80 if n >> 7 else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _len(b: bytes) -> bytes:
    return _varint(len(b))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_message_filled_in_place_is_framed_kvs_encoding(dtype):
    """ReadKV gathers the KV straight into the reply's bytes (``framed_kv_to_fill``): once
    filled, the message is byte for byte what ``framed_kv`` makes of the same KV."""
    dt = getattr(torch, dtype)
    for kv in (_kv(dtype=dt), _kv(0, dtype=dt)):
        message, view = framed_kv_to_fill(b"", 1, 7, 300, tuple(kv.shape), dt)
        assert view.dtype == dt and tuple(view.shape) == tuple(kv.shape)
        view.view(torch.uint8).copy_(kv.view(torch.uint8))
        del view
        assert type(message) is bytes and message == framed_kv(b"", 1, 7, 300, kv)
        _same(decode_read_reply(message), pb.ReadKVReply.FromString(message))
