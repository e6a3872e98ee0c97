"""prefixd.api.tensors: tensors on the wire, and the CUDA IPC handle's safe loading."""

import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from prefixd.api import prefixd_pb2 as pb
from prefixd.api.layout import KVLayout
from prefixd.api.tensors import (
    DTYPES, cuda_ipc_handle, from_kv_chunk, from_tensor_msg, load_cuda_ipc, tensor_from_bytes,
    to_kv_chunk, to_tensor_msg,
)


@pytest.mark.parametrize("dtype", DTYPES)
def test_tensor_messages_round_trip_every_layout_dtype(dtype):
    KVLayout("m", 1, 1, 1, dtype=dtype)  # the API carries exactly the layout's dtypes
    t = torch.randn((3, 2, 5)).to(getattr(torch, dtype))
    msg = to_tensor_msg(t[:, :, 1:4])  # a non-contiguous view goes out C-contiguous
    assert list(msg.shape) == [3, 2, 3] and msg.dtype == dtype
    back = from_tensor_msg(msg)
    assert back.dtype == t.dtype
    assert back.view(torch.uint8).tolist() == t[:, :, 1:4].contiguous().view(torch.uint8).tolist()


def test_decoding_views_the_bytes_without_a_copy():
    data = to_tensor_msg(torch.arange(6, dtype=torch.float32)).data
    back = tensor_from_bytes(data, [6], "float32")
    assert back.data_ptr() == np.frombuffer(data, dtype=np.uint8).ctypes.data
    assert back.tolist() == list(range(6))


def test_messages_fill_a_reply_field_in_place():
    reply = pb.ReadKVReply()
    kv = torch.arange(24, dtype=torch.float16).view(1, 2, 3, 2, 2)
    assert to_kv_chunk(7, 5, kv, out=reply.chunk) is reply.chunk
    assert (reply.chunk.seq_id, reply.chunk.start, reply.chunk.num_tokens) == (7, 5, 3)
    assert from_kv_chunk(reply.chunk).tolist() == kv.tolist()
    attend = pb.AttendReply()
    to_tensor_msg(kv[0, 0], out=attend.output)
    assert list(attend.output.shape) == [3, 2, 2] and from_tensor_msg(attend.output).tolist() == kv[0, 0].tolist()


def test_empty_tensors_round_trip():
    msg = to_tensor_msg(torch.empty((2, 0, 4), dtype=torch.float16))
    assert msg.data == b""
    assert from_tensor_msg(msg).shape == (2, 0, 4)


@pytest.mark.parametrize("data,shape,dtype,words", [
    (b"\0" * 7, [2], "float32", "data is 7 bytes, but shape \\[2\\] of float32 needs 8"),
    (b"\0" * 4, [1], "int32", "dtype must be one of"),
    (b"", [1] * 9, "float32", "at most 8 dims"),
    (b"", [1 << 31, 1 << 31], "float16", "needs 9223372036854775808"),
])
def test_bad_tensor_bytes_are_refused_before_anything_is_allocated(data, shape, dtype, words):
    with pytest.raises(ValueError, match=words):
        tensor_from_bytes(data, shape, dtype)


def test_a_cuda_ipc_handle_is_refused_on_a_cpu_tensor():
    with pytest.raises(ValueError, match="needs a CUDA tensor"):
        cuda_ipc_handle(torch.zeros(4))


def test_loading_a_handle_runs_nothing_but_torchs_cuda_rebuild(tmp_path):
    """Unpickling a handle from the wire must never run code it names (a fake daemon, or a
    garbled field), only torch's own CUDA tensor rebuild."""
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    with pytest.raises(ValueError, match="names posix.system"):
        load_cuda_ipc(pickle.dumps((Evil(), ())))
    assert not marker.exists()
    with pytest.raises(ValueError, match="not a CUDA IPC handle"):
        load_cuda_ipc(b"\x80\x05garbage")
    shaped = (rebuild_cuda_tensor, (torch.Tensor, torch.Size([4]), (1,), 0,
                                    torch.storage.TypedStorage, torch.bfloat16, 0, b"h", 8, 0,
                                    False, b"r", 0, b"e", False))
    rebuild, args = load_cuda_ipc(pickle.dumps(shaped))
    assert rebuild is rebuild_cuda_tensor and args[5] is torch.bfloat16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_tensor_maps_into_another_process_through_its_handle():  # pragma: no cover - GPU
    t = torch.arange(16, dtype=torch.float16, device="cuda")
    handle = cuda_ipc_handle(t)
    code = ("import sys; from prefixd.api.tensors import tensor_from_cuda_ipc as f; "
            "t = f(sys.stdin.buffer.read()); assert t.sum().item() == 120; t.mul_(2); "
            "import torch; torch.cuda.synchronize()")
    subprocess.run([sys.executable, "-c", code], input=handle, check=True, timeout=120)
    torch.cuda.synchronize()
    assert t.sum().item() == 240
