"""Batched block copies between pools: memory to memory, memory to disk, disk to memory.

Memory to memory on CPU: a batch is split into one task per helper thread; each task
``memmove``s every run of positions that is contiguous on both sides and, when the destination
is host memory, hashes each piece (``L2_PIECE_BYTES``) right after copying it, while it is still
in the core's L2 cache. With CUDA on either side it is one gather per batch (slice ``copy_`` or
``index_select``/``index_copy_``).

Disk: one ``pwritev``/``preadv`` per run of consecutive disk slots (up to IOV_MAX buffers). A
write hashes each source chunk (``CHUNK_BYTES``) and hands it to a helper thread to ``pwritev``
while the next chunk is hashed. A read first asks the kernel for every run of the batch
(``POSIX_FADV_WILLNEED``, so the kernel reads ahead in disk order for shuffled slots), then
the helper threads read the batch in disk order, a piece of consecutive slots at a
time, each into its own ~1 MiB staging buffer, hash it there (still in cache), check it against
its expected checksum and copy it on, so a corrupt block never reaches the destination.

NOTE: CPU copies are a Python loop over runs of ``ctypes.memmove`` (which drops the GIL), not
``index_select``/``index_copy_``: a ``memmove`` per block runs at a contiguous ``copy_``'s
bandwidth, while torch's indexed copies are several times slower and erratic on a loaded
host. The loop costs ~1 us per run, noise next to a block of more than a few KiB.

NOTE: a batch of at most ``INLINE_BYTES`` runs on the calling thread, as one numpy gather and
one scatter (a read from disk: one staged read per piece): handing it to the helper threads and
waiting for their Futures cost more than the copy (a profile of 512-byte blocks showed most of
a request waiting on such Futures), and a ``memmove`` per scattered 512-byte block costs ~2 us.
The helpers start to pay past about 1 MiB of big blocks, hence 1 MiB.

NOTE: copy-then-hash per L2 piece, not hash-after-batch: a piece is hashed while it is still
in cache, where hashing a whole batch after the copy reads it from DRAM a second time.
"""

from __future__ import annotations

import ctypes
import threading
from concurrent.futures import Executor, Future
from typing import NamedTuple, Sequence

import numpy as np
import torch
import xxhash

from prefixd.crashpoints import crash_point
from prefixd.storage import checksum
from prefixd.storage.pools import DiskPool, TensorPool

CHUNK_BYTES = 16 << 20  # one helper task / one staged read
L2_PIECE_BYTES = 256 << 10  # copy-then-hash granularity: the piece is still in L2 when hashed
_memmove = ctypes.memmove  # a ctypes foreign call: drops the GIL
_xxh3 = xxhash.xxh3_64_intdigest
L2_STAGE_BYTES = 1 << 20  # staging per helper thread for reads from disk
HELPER_THREADS = 2  # the store's helper pool; a CPU copy is split into this many tasks
INLINE_BYTES = 1 << 20  # a batch this small is copied on the calling thread (see the NOTE)
PREFETCH = True  # posix_fadvise(WILLNEED) every run of a read batch up front: the disk sees them all
_IOV_MAX = 1024


class CopyResult(NamedTuple):
    """What a batched copy did, per block in the order of the slot lists.

    ``checksums``: checksum of each block's bytes, when the destination is host or disk or the
    source is disk; else ``None``. ``ok``: ``False`` for a block read from disk whose checksum
    did not match (its bytes were not written to the destination); ``None`` when nothing was
    verified.
    """

    checksums: list[int] | None
    ok: list[bool] | None

    @property
    def bad_positions(self) -> list[int]:
        return [i for i, good in enumerate(self.ok or ()) if not good]


def chunk_blocks(block_bytes: int) -> int:
    return max(1, CHUNK_BYTES // block_bytes)


def runs(slots: Sequence[int], start: int = 0, stop: int | None = None) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive slots in ``slots[start:stop]`` as ``(position, first_slot, length)``."""
    stop = len(slots) if stop is None else stop
    out: list[tuple[int, int, int]] = []
    i = start
    while i < stop:
        j = i + 1
        while j < stop and slots[j] == slots[j - 1] + 1 and j - i < _IOV_MAX:
            j += 1
        out.append((i, slots[i], j - i))
        i = j
    return out


def _index(slots: Sequence[int], device) -> torch.Tensor:
    return torch.tensor(slots, dtype=torch.long, device=device)


def _memmove_runs(dst: torch.Tensor, dst_slots: Sequence[int], src: torch.Tensor, src_slots: Sequence[int],
                  lo: int, hi: int, hash_rows=None) -> list[int]:
    """CPU: ``memmove`` each run of positions in ``[lo, hi)`` that is contiguous on both sides.

    With ``hash_rows`` (the destination's uint8 rows), each piece is hashed right after it is
    copied, while it is still in the core's L2 cache. Returns the checksums (or ``[]``).
    """
    nbytes = dst[0].numel() * dst.element_size()
    dst_base, src_base = dst.data_ptr(), src.data_ptr()
    if hash_rows is not None and nbytes > L2_PIECE_BYTES:
        return _memmove_hash_pieces(dst_base, dst_slots, src_base, src_slots, nbytes, lo, hi, hash_rows)
    piece = max(1, L2_PIECE_BYTES // nbytes) if hash_rows is not None else hi - lo
    sums: list[int] = []
    i = lo
    while i < hi:
        j = i + 1
        while (j < hi and j - i < piece and src_slots[j] == src_slots[j - 1] + 1
               and dst_slots[j] == dst_slots[j - 1] + 1):
            j += 1
        _memmove(dst_base + dst_slots[i] * nbytes, src_base + src_slots[i] * nbytes, (j - i) * nbytes)
        if hash_rows is not None:
            sums.extend(_xxh3(hash_rows[dst_slots[k]]) for k in range(i, j))
        i = j
    return sums


def _memmove_hash_pieces(dst_base: int, dst_slots, src_base: int, src_slots, nbytes: int, lo: int, hi: int,
                         hash_rows) -> list[int]:
    """Blocks bigger than a piece: copy and hash each block piece by piece (streaming xxh3-64
    gives the same digest as hashing the block in one go)."""
    sums = []
    for k in range(lo, hi):
        d0, s0 = dst_base + dst_slots[k] * nbytes, src_base + src_slots[k] * nbytes
        row = hash_rows[dst_slots[k]]
        state = xxhash.xxh3_64()
        for off in range(0, nbytes, L2_PIECE_BYTES):
            size = min(L2_PIECE_BYTES, nbytes - off)
            _memmove(d0 + off, s0 + off, size)
            state.update(row[off:off + size])
        sums.append(state.intdigest())
    return sums


def _rows_of(t: torch.Tensor):
    """A block-major CPU tensor as a uint8 numpy array, one block a row (a view)."""
    return t.view(torch.uint8).reshape(t.shape[0], -1).numpy()


def copy_rows(src: torch.Tensor, src_slots: Sequence[int], dst: torch.Tensor, dst_slots: Sequence[int]) -> None:
    """``dst[dst_slots] = src[src_slots]`` for block-major tensors, on the calling thread.

    CPU to CPU is a ``memmove`` per run (see the module NOTE); anything involving CUDA is one
    gather: a slice ``copy_`` when both sides are single runs, else ``index_select`` /
    ``index_copy_``.
    """
    if not (src.is_cuda or dst.is_cuda):
        if len(dst_slots) * dst.stride(0) * dst.element_size() <= INLINE_BYTES:
            _rows_of(dst)[dst_slots] = np.take(_rows_of(src), src_slots, axis=0)  # gather, scatter
        else:
            _memmove_runs(dst, dst_slots, src, src_slots, 0, len(dst_slots))
        return
    n = len(dst_slots)  # pragma: no cover - needs a GPU
    s_run, d_run = runs(src_slots), runs(dst_slots)
    part = src[src_slots[0]:src_slots[0] + n] if len(s_run) == 1 else src.index_select(0, _index(src_slots, src.device))
    if len(d_run) == 1:
        dst[dst_slots[0]:dst_slots[0] + n].copy_(part, non_blocking=True)
    else:
        dst.index_copy_(0, _index(dst_slots, dst.device), part.to(dst.device, non_blocking=True))


def run_start(slots: Sequence[int]) -> int | None:
    """The first slot if ``slots`` (not empty) is one ascending run of consecutive slots, else None."""
    first = slots[0]
    n = len(slots)
    if slots[n - 1] - first != n - 1:  # O(1) for the scattered case
        return None
    return first if slots == list(range(first, first + n)) else None


def _gather_inline(src_rows, src_slots: Sequence[int], dst_rows, dst_slots: Sequence[int], dst_first=None):
    """``dst_rows[dst_slots] = src_rows[src_slots]`` on the calling thread; returns the copied
    rows (in the destination when its slots are one run, else the gathered temporary).

    The caller checked every slot's range (``mode="clip"``: see below). ``dst_first``:
    ``run_start(dst_slots)`` when the caller knows it already (``-1``: not a run).

    NOTE: a destination that is one run of slots (what an allocator mostly hands out for a
    write-down) is gathered straight into it: ``take(out=)`` into the slice, with the indices
    as an array: a list-indexed scatter makes numpy convert a list of Python ints element
    by element, which for small blocks costs more than the copy.
    ``mode="clip"``: under ``mode="raise"`` numpy buffers ``out`` (a hidden temporary).
    """
    n = len(dst_slots)
    first = run_start(dst_slots) if dst_first is None else dst_first
    src_first = run_start(src_slots)
    if src_first is not None:  # a promotion mostly reads one run: no gather, scatter from it
        rows = src_rows[src_first:src_first + n]
        if first is not None and first >= 0:
            out = dst_rows[first:first + n]
            np.copyto(out, rows)  # numpy copies through a buffer when the two overlap
            return out
        dst_rows[np.fromiter(dst_slots, np.intp, n)] = rows
        return rows
    index = np.fromiter(src_slots, np.intp, n)
    if first is not None and first >= 0:
        rows = dst_rows[first:first + n]
        src_rows.take(index, axis=0, out=rows, mode="clip")  # an overlapping out is copied first
        return rows
    rows = src_rows.take(index, axis=0, mode="clip")
    dst_rows[np.fromiter(dst_slots, np.intp, n)] = rows
    return rows


def copy_tensors(src: TensorPool, src_slots: Sequence[int], dst: TensorPool, dst_slots: Sequence[int],
                 helper: Executor, want_checksums: bool, dst_first: int | None = None) -> CopyResult:
    """Copy blocks between two in-memory pools; hash the destination when asked (host dst).

    CPU to CPU: a small batch inline (``_gather_inline``; ``dst_first`` as there), a large one
    in chunks on both helper threads, each copying and hashing its own blocks.
    """
    if src.is_cuda or dst.is_cuda:  # pragma: no cover - needs a GPU
        copy_rows(src.tensor, src_slots, dst.tensor, dst_slots)
        torch.cuda.synchronize()
        sums = checksum.checksum_rows(dst.rows, dst_slots) if want_checksums and dst.rows is not None else None
        return CopyResult(sums, None)
    hash_rows = dst.rows if want_checksums else None
    n = len(dst_slots)
    if n * dst.layout.block_bytes <= INLINE_BYTES and src.rows is not None and dst.rows is not None:
        rows = _gather_inline(src.rows, src_slots, dst.rows, dst_slots, dst_first)
        return CopyResult([_xxh3(row) for row in rows] if want_checksums else None, None)
    step = max(chunk_blocks(dst.layout.block_bytes), -(-n // HELPER_THREADS))
    pending = [helper.submit(_memmove_runs, dst.raw, dst_slots, src.raw, src_slots, lo, min(lo + step, n), hash_rows)
               for lo in range(0, n, step)]
    sums = [c for f in pending for c in f.result()]
    return CopyResult(sums if want_checksums else None, None)


def _write_chunk(disk: DiskPool, rows, src_slots: Sequence[int], dst_slots: Sequence[int], lo: int, hi: int) -> None:
    for pos, first, length in runs(dst_slots, lo, hi):
        bufs = []
        for spos, s0, n in runs(src_slots, pos, pos + length):
            bufs.append(rows[s0:s0 + n].reshape(-1))
        disk.write_run(first, bufs)


def write_to_disk(rows, src_slots: Sequence[int], disk: DiskPool, dst_slots: Sequence[int],
                  helper: Executor | None, want_checksums: bool = True) -> CopyResult:
    """Hash each source block, then ``pwritev`` it to its disk slot (not yet durable: ``sync``).

    Args:
        rows: the source blocks as a 2-D uint8 numpy array in host memory (one block a row).
        helper: threads for the writes of a big batch; ``None`` (or a small batch) writes on
            the calling thread (the write-behind thread passes ``None``).
        want_checksums: ``False`` when the caller hashed the rows already (``checksums`` None).
    Raises:
        StorageError: on a short or failed write.
    """
    step = chunk_blocks(disk.block_bytes)
    n = len(dst_slots)
    sums: list[int] | None = [] if want_checksums else None
    if helper is None or n * disk.block_bytes <= INLINE_BYTES:
        if sums is not None:
            sums = checksum.checksum_rows(rows, src_slots)
        _write_chunk(disk, rows, src_slots, dst_slots, 0, n)
    else:
        pending: list[Future] = []
        for lo in range(0, n, step):
            hi = min(lo + step, n)
            if sums is not None:
                sums.extend(checksum.checksum_rows(rows, src_slots[lo:hi]))  # warms the chunk for pwrite
            pending.append(helper.submit(_write_chunk, disk, rows, src_slots, dst_slots, lo, hi))
        for f in pending:
            f.result()
    crash_point("disk_data_written")
    return CopyResult(sums, None)


class Staging:
    """One small host buffer per helper thread, reused by every read from disk.

    Each holds ``blocks`` blocks (about ``L2_STAGE_BYTES``, at least one block), so a block read
    into it is still in the core's cache when it is hashed and copied on.
    Invariant: a caller holds ``lock`` for the whole of a read that uses them.
    """

    def __init__(self, block_bytes: int, pin: bool) -> None:
        self.blocks = max(1, L2_STAGE_BYTES // block_bytes)
        self.lock = threading.Lock()
        self.buffers = [torch.zeros(self.blocks, block_bytes, dtype=torch.uint8) for _ in range(HELPER_THREADS)]
        if pin and torch.cuda.is_available():  # pragma: no cover - needs a GPU
            self.buffers = [b.pin_memory() for b in self.buffers]
        self.rows = [b.numpy() for b in self.buffers]


def _read_pieces(disk: DiskPool, src_slots, dst, dst_slots, verify, pieces, buf, rows, sums, oks) -> None:
    """Read each piece (positions of consecutive disk slots) through one staging buffer;
    fills ``sums[pos]`` and ``oks[pos]``."""
    for piece in pieces:
        n = len(piece)
        disk.read_run(src_slots[piece[0]], rows[:n])
        keep = []
        for i, pos in enumerate(piece):
            found = sums[pos] = checksum.checksum(rows[i])
            oks[pos] = good = verify is None or found == verify[pos]
            if good:
                keep.append(i)
        if keep and dst is not None:
            _place(buf, rows, keep, dst, [dst_slots[pos] for pos in piece])


def read_from_disk(disk: DiskPool, src_slots: Sequence[int], dst, dst_slots: Sequence[int],
                   verify: Sequence[int] | None, staging: Staging, helper: Executor) -> CopyResult:
    """Read blocks into ``dst`` through staging, checking them.

    Blocks are read in disk order (the order the prefetch asked for them), in pieces of
    consecutive disk slots that fit one staging buffer, dealt round-robin to the helper threads.

    Args:
        dst: a uint8 tensor ``[slots, block_bytes]`` (``TensorPool.raw``), a DiskPool, or
            ``None`` to only hash what is read.

    With ``verify``, a block whose checksum differs is reported ``ok=False`` and not copied.
    Raises:
        StorageError: on an I/O error; ValueError: ``verify`` of the wrong length.
    """
    if verify is not None and len(verify) != len(src_slots):
        raise ValueError(f"got {len(verify)} expected checksums for {len(src_slots)} blocks")
    n = len(src_slots)
    if PREFETCH and n * disk.block_bytes > INLINE_BYTES:  # in disk order, merged: the block layer sees mostly sequential requests
        for _, first, length in runs(sorted(src_slots)):
            disk.prefetch(first, length)
    pieces: list[list[int]] = []
    for pos in sorted(range(n), key=src_slots.__getitem__):
        last = pieces[-1] if pieces else None
        if last and len(last) < staging.blocks and src_slots[pos] == src_slots[last[-1]] + 1:
            last.append(pos)
        else:
            pieces.append([pos])
    sums: list = [0] * n
    oks: list = [False] * n
    if n * disk.block_bytes <= INLINE_BYTES or len(pieces) == 1:  # on the calling thread
        with staging.lock:
            _read_pieces(disk, src_slots, dst, dst_slots, verify, pieces, staging.buffers[0],
                         staging.rows[0], sums, oks)
        return CopyResult(sums, oks if verify is not None else None)
    with staging.lock:
        parts = [helper.submit(_read_pieces, disk, src_slots, dst, dst_slots, verify, pieces[k::HELPER_THREADS],
                               staging.buffers[k], staging.rows[k], sums, oks)
                 for k in range(min(HELPER_THREADS, len(pieces)))]
        for f in parts:
            f.result()
    return CopyResult(sums, oks if verify is not None else None)


def _place(buf: torch.Tensor, rows, keep: list[int], dst, dst_slots: Sequence[int]) -> None:
    """Copy staged rows ``keep`` to their destination slots."""
    targets = [dst_slots[i] for i in keep]
    if isinstance(dst, DiskPool):
        for pos, first, length in runs(targets):
            dst.write_run(first, [rows[i] for i in keep[pos:pos + length]])
        return
    copy_rows(buf, keep, dst, targets)
    if dst.is_cuda:  # pragma: no cover - needs a GPU
        torch.cuda.synchronize()
