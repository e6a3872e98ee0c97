"""Tensors on the wire: the ``Tensor`` and ``KVChunk`` messages <-> torch tensors, and the
CUDA IPC handle of a device pool (the daemon encodes, the client decodes; both import this).

A tensor travels as raw C-contiguous bytes with its shape and dtype name beside it
(prefixd.proto ``Tensor``, ``KVChunk``). The dtype names are the KV layout's (``DTYPES``).

NOTE: decoding is zero-copy: ``tensor_from_bytes`` views the message's ``bytes`` with
``torch.frombuffer``, so the tensor is READ-ONLY in fact (torch cannot mark it so): a caller
that writes into it must ``clone()`` it first. Encoding costs one copy (``bytes`` are immutable,
and protobuf takes a ``bytes`` object), plus one from device to host for a CUDA tensor.

NOTE (build messages in place): pass the reply's own field as ``out``
(``to_kv_chunk(..., out=reply.chunk)``), never a finished message to a constructor
(``ReadKVReply(chunk=...)``): protobuf (upb) deep-copies a submessage handed to a constructor,
an order of magnitude slower for a 4 MiB chunk than assigning ``bytes`` to a field of the
reply, or ``CopyFrom`` into it. Reading a ``bytes`` field copies at every access: read it once.
The KV rpcs' messages skip protobuf for the KV bytes altogether: ``prefixd.api.kv_frames``.

NOTE: like ``KVLayout.torch_dtype``, torch is imported inside the functions: ``prefixd.api``
stays importable without torch for light clients (``prefixctl``).
"""

from __future__ import annotations

import math
import pickle
import warnings

from prefixd.api import prefixd_pb2 as pb

DTYPES = ("float32", "float16", "bfloat16", "float8_e4m3fn")  # the layout's dtype names
MAX_DIMS = 8  # a message with more dims is refused before anything is allocated


def dtype_of(name: str):
    """The torch dtype named ``name`` (one of ``DTYPES``).

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    import torch

    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {name!r}")
    return getattr(torch, name)


def dtype_name(dtype) -> str:
    """The wire name of a torch dtype; ValueError for one the API does not carry."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"tensor dtype must be one of {list(DTYPES)}, got {dtype}")
    return name


def tensor_bytes(tensor) -> bytes:
    """The C-contiguous bytes of ``tensor`` (copied to the host first if it is on a GPU)."""
    import torch

    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if not t.numel():
        return b""
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def tensor_from_bytes(data: bytes, shape, dtype: str):
    """A tensor of ``shape`` and ``dtype`` (a name) viewing ``data`` without a copy.

    Raises:
        ValueError: an unknown dtype, too many dims, or ``len(data)`` that is not
            ``prod(shape) * itemsize`` (the message gives both).
    """
    import torch

    torch_dtype = dtype_of(dtype)
    shape = tuple(int(s) for s in shape)
    if len(shape) > MAX_DIMS:
        raise ValueError(f"a tensor has at most {MAX_DIMS} dims, got shape {list(shape)}")
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    want = math.prod(shape) * itemsize
    if len(data) != want:
        raise ValueError(f"data is {len(data)} bytes, but shape {list(shape)} of {dtype} needs "
                         f"{want}: send prod(shape) * {itemsize} bytes, C-contiguous")
    if not want:
        return torch.empty(shape, dtype=torch_dtype)
    with warnings.catch_warnings():
        # bytes are immutable, and torch warns (once) that its view of them is writable; the
        # module docstring says callers never write into it
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(data, dtype=torch.uint8)
    return raw.view(torch_dtype).view(shape)


def to_tensor_msg(tensor, out: pb.Tensor | None = None) -> pb.Tensor:
    """``tensor`` as a ``Tensor`` message, filled into ``out`` when given (a reply's field:
    see the NOTE on building in place). ValueError for a dtype the API does not carry."""
    msg = pb.Tensor() if out is None else out
    msg.shape[:] = list(tensor.shape)
    msg.dtype = dtype_name(tensor.dtype)
    msg.data = tensor_bytes(tensor)
    return msg


def from_tensor_msg(msg: pb.Tensor):
    """The tensor of a ``Tensor`` message, viewing its bytes (read-only; see the NOTE).

    Raises:
        ValueError: as ``tensor_from_bytes``.
    """
    return tensor_from_bytes(msg.data, msg.shape, msg.dtype)


def to_kv_chunk(seq_id: int, start: int, kv, out: pb.KVChunk | None = None) -> pb.KVChunk:
    """The KV of tokens ``start .. start + n`` of a sequence (``kv``: ``[num_layers, 2, n,
    num_kv_heads, head_dim]``) as a ``KVChunk``, filled into ``out`` when given."""
    msg = pb.KVChunk() if out is None else out
    msg.seq_id, msg.start, msg.num_tokens = seq_id, start, kv.shape[2]
    msg.shape[:] = list(kv.shape)
    msg.dtype = dtype_name(kv.dtype)
    msg.data = tensor_bytes(kv)
    return msg


def from_kv_chunk(chunk: pb.KVChunk):
    """The KV tensor of a ``KVChunk``, viewing its bytes (read-only). Checks only that the
    bytes fit the shape and dtype; the receiver checks them against its layout.

    Raises:
        ValueError: as ``tensor_from_bytes``.
    """
    return tensor_from_bytes(chunk.data, chunk.shape, chunk.dtype)


def cuda_ipc_handle(tensor) -> bytes:
    """torch's own CUDA IPC handle of ``tensor`` (the ``cuda_ipc`` field of a ``PoolDescriptor``):
    the pickled ``(rebuild, args)`` of ``torch.multiprocessing.reductions.reduce_tensor``.

    NOTE: torch keeps the storage alive while a process that opened the handle still holds
    it (a reference counter in shared memory); the daemon's pool lives as long as the daemon
    anyway. The handle opens only in another process, never in the one that made it.
    """
    from torch.multiprocessing.reductions import reduce_tensor

    if not tensor.is_cuda:
        raise ValueError(f"a CUDA IPC handle needs a CUDA tensor, got one on {tensor.device}")
    return pickle.dumps(reduce_tensor(tensor))


# The globals a handle made by ``cuda_ipc_handle`` names, and nothing else.
_IPC_GLOBALS = frozenset({
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
    ("torch", "Tensor"), ("torch", "Size"),
    ("torch.storage", "TypedStorage"), ("torch.storage", "UntypedStorage"),
    *(("torch", name) for name in DTYPES),
})


class _IpcUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in _IPC_GLOBALS:
            raise ValueError(f"not a CUDA IPC handle: it names {module}.{name}")
        return super().find_class(module, name)


def load_cuda_ipc(handle: bytes) -> tuple:
    """``(rebuild, args)`` of a ``cuda_ipc_handle``, unpickled without running anything: only
    torch's CUDA tensor rebuild, tensor, size, storage and dtype globals may appear.

    Raises:
        ValueError: anything else (a handle from something that is not the daemon).
    """
    import io

    try:
        loaded = _IpcUnpickler(io.BytesIO(handle)).load()
    except ValueError:
        raise
    except Exception as exc:  # truncated or garbled bytes
        raise ValueError(f"not a CUDA IPC handle: {exc!r}") from exc
    if not (isinstance(loaded, tuple) and len(loaded) == 2 and isinstance(loaded[1], tuple)):
        raise ValueError("not a CUDA IPC handle: expected a (rebuild, args) pair")
    return loaded


def tensor_from_cuda_ipc(handle: bytes):
    """The tensor a ``cuda_ipc_handle`` names, mapped into this process (same memory).

    Raises:
        ValueError: not a CUDA IPC handle (see ``load_cuda_ipc``); RuntimeError (torch): the
            handle does not open here (another host, or a device this process cannot see).
    """
    rebuild, args = load_cuda_ipc(handle)
    return rebuild(*args)
