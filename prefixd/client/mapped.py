"""The daemon's pools mapped into this process: KV and attention with no copy through the socket.

``map_pool(descriptor, layout)`` turns an Attach reply's ``PoolDescriptor`` into a tensor
``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` over the daemon's memory:

- a pool file (host shm, or the CPU device pool): the file is opened read/write, its header
  checked (magic, and the ``file_id`` the descriptor names, so a file replaced under the path is
  refused), its size checked against the tensor's extent, and mapped ``MAP_SHARED``;
- a CUDA pool (``cuda_ipc`` non-empty): torch's own CUDA IPC handle
  (``prefixd.api.tensors.tensor_from_cuda_ipc``, which unpickles only torch's rebuild
  globals), only where CUDA is available.

Any failure is a ``MappingError`` and the session uses the KV rpcs instead.

``MappedPool.write`` / ``read`` / ``attend`` are the session's mapped KV path, through
``prefixd.kernels`` (``token_io`` for token ranges, ``paged_attention`` for attention).

NOTE: a client that maps a pool can store anywhere in it: the daemon trusts it within its
tenant (DESIGN.md "Tenants"). The checks here (never a committed block) protect the caller from
its own bugs, not the daemon from the caller.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct

import torch

from prefixd.api import prefixd_pb2 as pb
from prefixd.api.tensors import dtype_of, tensor_from_cuda_ipc
from prefixd.client.errors import InvalidArgument, MappingError, SharedBlockError
from prefixd.kernels import layer_kv, paged_attention, write_kv as write_new_kv
from prefixd.kernels.token_io import (new_cpu_tensor, numpy_view, read_tokens, read_tokens_np, write_tokens,
                                     write_tokens_np)

log = logging.getLogger(__name__)

# The pool file header (prefixd.storage.poolfile; re-read here because the client never imports
# storage): magic, version, kind, data_offset, block_bytes, num_slots, file_id, layout_len.
POOL_MAGIC = b"PFXDPOOL"
_HEADER = struct.Struct("<8sIIQQQ16sI")
_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in writable, as MAP_POPULATE does


class MappedPool:
    """One tier's pool of the daemon, mapped.

    Invariants: ``tensor`` has the descriptor's shape, strides and dtype and aliases the
    daemon's memory for as long as this object (or a view of ``tensor``) lives; so does
    ``array``, its numpy view (``token_io.numpy_view``), on a CPU pool (None on CUDA).
    ``pending`` is True while stores into a CUDA pool may still be in flight on this
    process's stream.

    NOTE: CUDA copies are asynchronous, and the daemon reads the blocks from another process:
    ``settle()`` waits for this process's stores before anything asks the daemon to read them
    (Commit, a committing Release). A CPU mapping needs nothing: a store is visible at once.
    """

    def __init__(self, tensor: torch.Tensor, tier: str, path: str | None, keepalive=None) -> None:
        self.tensor = tensor
        self.array = numpy_view(tensor) if tensor.device.type == "cpu" else None
        self.block_size = tensor.shape[3]
        self.dtype = tensor.dtype
        self.tier = tier
        self.path = path
        self.pending = False
        self._keepalive = keepalive  # the mmap (CPU) or None: kept so the mapping outlives us

    def settle(self) -> None:
        """Wait until this process's stores into a CUDA pool are done (no-op on a CPU pool)."""
        if self.pending:
            torch.cuda.synchronize(self.tensor.device)
            self.pending = False

    def write(self, seq, start: int, kv: torch.Tensor) -> None:
        """KV of tokens ``start ..`` of ``seq`` into its blocks (range, shape and dtype checked
        by the caller). Raises SharedBlockError for a committed block."""
        n = kv.shape[2]
        if not n:
            return
        first = start // self.block_size
        if first < seq.num_indexed:
            bs = self.block_size
            raise SharedBlockError(
                f"sequence {seq.id}: tokens {start}..{start + n} reach block {first}, which is "
                f"committed (shared with other prompts, read-only); only tokens from "
                f"{seq.num_indexed * bs} on may be written")
        if self.array is not None and kv.device.type == "cpu":
            write_tokens_np(self.array, seq.block_table, start, numpy_view(kv), self.block_size)
            return
        write_tokens(self.tensor, seq.block_table, start, kv.detach(), self.block_size)
        self.pending = self.tensor.is_cuda

    def read(self, seq, start: int, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """KV of tokens ``start .. start + n`` of ``seq``: ``out`` filled (shape and dtype
        checked by the caller), or a new tensor on the pool's device."""
        if self.array is not None and (out is None or out.device.type == "cpu"):
            if out is None:
                _, num_layers, _, _, num_kv_heads, head_dim = self.array.shape
                out, dst = new_cpu_tensor((num_layers, 2, n, num_kv_heads, head_dim), self.dtype)
            else:
                dst = numpy_view(out)
            read_tokens_np(self.array, seq.block_table, start, n, self.block_size, dst)
            return out
        return read_tokens(self.tensor, seq.block_table, start, n, self.block_size, out)

    @torch.no_grad()
    def attend(self, seqs, query: torch.Tensor, *, layer: int, new_k, new_v, query_start_loc,
               scale: float | None) -> torch.Tensor:
        """Paged attention of ``seqs`` over this pool, computed here (see ``Session.attend``)."""
        device = self.tensor.device
        query = query.to(device)
        bs = self.block_size
        seq_lens = [s.num_tokens for s in seqs]
        if query_start_loc is None:
            new_counts = [1] * len(seqs)
        else:
            new_counts = [int(query_start_loc[i + 1]) - int(query_start_loc[i]) for i in range(len(seqs))]
        k_cache, v_cache = layer_kv(self.tensor, layer)
        if new_k is not None:
            slots = []
            for seq, n in zip(seqs, new_counts):
                for t in range(seq.num_tokens - n, seq.num_tokens):
                    if t // bs < seq.num_indexed:
                        raise SharedBlockError(
                            f"sequence {seq.id}: new K/V for token {t} would land in committed block "
                            f"{t // bs}; extend the sequence with the new tokens before attending")
                    slots.append(seq.block_table[t // bs] * bs + t % bs)
            mapping = torch.tensor(slots, dtype=torch.long, device=device)
            write_new_kv(new_k.to(device), new_v.to(device), k_cache, v_cache, mapping)
            self.pending = self.tensor.is_cuda
        width = max((len(s.block_table) for s in seqs), default=0) or 1
        tables = torch.zeros((len(seqs), width), dtype=torch.int32)
        for i, seq in enumerate(seqs):
            if seq.block_table:
                tables[i, :len(seq.block_table)] = torch.tensor(seq.block_table, dtype=torch.int32)
        lens = torch.tensor(seq_lens, dtype=torch.int32)
        loc = None if query_start_loc is None else torch.as_tensor(query_start_loc, dtype=torch.int32)
        if device.type != "cpu":
            tables, lens = tables.to(device), lens.to(device)
            loc = None if loc is None else loc.to(device)
        return paged_attention(query, k_cache, v_cache, tables, lens, query_start_loc=loc, scale=scale)


def map_pool(desc: pb.PoolDescriptor, layout) -> MappedPool:
    """Map one pool descriptor of the Attach reply.

    Raises:
        MappingError: the pool cannot be mapped here (the message says why).
    """
    shape = tuple(int(s) for s in desc.shape)
    strides = tuple(int(s) for s in desc.strides)
    if len(shape) != 6 or len(strides) != 6 or shape[1:] != tuple(layout.block_shape):
        raise MappingError(f"pool descriptor shape {shape} does not hold the layout's blocks "
                           f"{tuple(layout.block_shape)}")
    if desc.dtype != layout.dtype:
        raise MappingError(f"pool dtype {desc.dtype!r} is not the layout's {layout.dtype!r}")
    if desc.cuda_ipc:
        return _map_cuda(desc, shape, strides)
    if not desc.path:
        raise MappingError(f"the {desc.tier or 'device'} pool descriptor names no file and no CUDA handle")
    return _map_file(desc, shape, strides, dtype_of(desc.dtype))


def _map_file(desc: pb.PoolDescriptor, shape, strides, dtype: torch.dtype) -> MappedPool:
    path = desc.path
    itemsize = torch.empty(0, dtype=dtype).element_size()
    extent = (1 + sum((n - 1) * s for n, s in zip(shape, strides))) * itemsize if all(shape) else 0
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise MappingError(f"cannot open pool file {path} read/write ({exc.strerror}): the client "
                           f"must run on the daemon's host as a user of its tenant's group") from None
    try:
        size = os.fstat(fd).st_size
        header = os.pread(fd, _HEADER.size, 0)
        if len(header) < _HEADER.size or header[:8] != POOL_MAGIC:
            raise MappingError(f"{path} is not a prefixd pool file (bad magic)")
        file_id = _HEADER.unpack(header)[6]
        if desc.file_id and file_id != desc.file_id:
            raise MappingError(f"{path} holds pool file {file_id.hex()}, not the daemon's "
                               f"{desc.file_id.hex()} (replaced under the path?)")
        if desc.offset + extent > size:
            raise MappingError(f"{path} is {size} bytes, too short for a pool of shape {shape} at "
                               f"offset {desc.offset}")
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        _populate_held(mm, fd, size)
    except OSError as exc:
        raise MappingError(f"cannot map pool file {path}: {exc}") from None
    finally:
        os.close(fd)
    if not extent:
        return MappedPool(torch.empty(shape, dtype=dtype), desc.tier, path, mm)
    flat = torch.frombuffer(mm, dtype=torch.uint8, count=extent, offset=desc.offset).view(dtype)
    tensor = flat.as_strided(shape, strides)
    log.debug("pool mapped tier=%s path=%s shape=%s", desc.tier, path, shape)
    return MappedPool(tensor, desc.tier, path, mm)


def _populate_held(mm: mmap.mmap, fd: int, size: int) -> None:
    """Fault in the ranges of the file that hold pages (``SEEK_DATA`` .. ``SEEK_HOLE``), as the
    daemon populates its own mapping (prefixd.storage.pools NOTE): a store into the pool must
    not pay a page fault per 4 KB the first time this process touches it. The file is sparse
    (its extents grow and shrink with the daemon's cache), so the whole range is never
    populated: ``MAP_POPULATE`` would allocate every hole. An extent the daemon grows later
    faults in on this process's first touch of it.

    NOTE: an extent the daemon punches between the seek and the populate is allocated again
    (zeros) until the daemon grows and punches it anew: at most a few MiB for a moment, and
    only while mapping. A kernel before 5.14 refuses the populate: pages fault in on touch."""
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError:  # ENXIO: no data past pos
            return
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        start -= start % mmap.PAGESIZE
        try:
            mm.madvise(_MADV_POPULATE_WRITE, start, end - start)
        except OSError:
            return
        pos = end


def _map_cuda(desc: pb.PoolDescriptor, shape, strides) -> MappedPool:
    if not torch.cuda.is_available():
        raise MappingError("the daemon's device pool is on CUDA but this process has no CUDA device")
    try:
        with torch.cuda.device(desc.cuda_device):
            tensor = tensor_from_cuda_ipc(desc.cuda_ipc)
    except Exception as exc:  # noqa: BLE001 - any failure means "use the rpcs"
        raise MappingError(f"cannot open the CUDA pool's IPC handle: {exc!r}") from None
    if tuple(tensor.shape) != shape or tuple(tensor.stride()) != strides:
        tensor = tensor.as_strided(shape, strides)
    return MappedPool(tensor, desc.tier, None)


def check_attend_args(seqs, query: torch.Tensor, new_k, new_v, query_start_loc) -> None:
    """Shape checks both KV paths share (the kernels check the rest).

    Raises:
        InvalidArgument: the message names the argument and the expected shape.
    """
    if not isinstance(query, torch.Tensor) or query.dim() != 3:
        raise InvalidArgument(f"q must be a tensor [tokens, num_q_heads, head_dim], got "
                              f"{tuple(query.shape) if isinstance(query, torch.Tensor) else type(query).__name__}")
    if query_start_loc is None and query.shape[0] != len(seqs):
        raise InvalidArgument(f"decode takes one query per sequence: q has {query.shape[0]} rows "
                              f"for {len(seqs)} sequences (pass query_start_loc to extend)")
    if query_start_loc is not None:
        loc = [int(x) for x in query_start_loc]
        if len(loc) != len(seqs) + 1 or loc[0] != 0 or loc[-1] != query.shape[0] or any(
                b < a for a, b in zip(loc, loc[1:])):
            raise InvalidArgument(f"query_start_loc must be {len(seqs) + 1} rising offsets from 0 to "
                                  f"{query.shape[0]}, got {loc}")
        for seq, a, b in zip(seqs, loc, loc[1:]):
            if b - a > seq.num_tokens:
                raise InvalidArgument(f"sequence {seq.id} has {seq.num_tokens} tokens but {b - a} queries")
    if (new_k is None) != (new_v is None):
        raise InvalidArgument("pass new_k and new_v together, or neither")
    if new_k is not None and (new_k.shape != new_v.shape or new_k.dim() != 3 or new_k.shape[0] != query.shape[0]):
        raise InvalidArgument(f"new_k and new_v must both be [{query.shape[0]}, num_kv_heads, head_dim], got "
                              f"{tuple(new_k.shape)} and {tuple(new_v.shape)}")
