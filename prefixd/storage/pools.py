"""Pools: the memory of one tier for one KV layout.

``TensorPool`` is a tensor ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``:
on CUDA for the device tier when a GPU is present, otherwise a MAP_SHARED mapping of a pool file
in a shared-memory directory (``/dev/shm``), so clients can map it and its bytes outlive a daemon
crash (not a reboot). ``DiskPool`` is a pool file in the state directory, moved with
``pread``/``pwrite`` and made durable with one ``fdatasync`` per batch.

NOTE: disk pools are not mapped. ``pwrite`` + ``fsync`` and writes through a mapping +
``msync`` cost the same, and cold ``preadv`` is within noise of a cold mapped read; but a mapped disk file that is truncated behind our back turns the next load into SIGBUS,
which kills the daemon, while ``preadv`` just returns short and the block fails its checksum.

NOTE: a pool file is mapped with ``MAP_POPULATE`` (``POPULATE``): its pages are in this
process's page tables from the start, as a GPU host's pinned pool is (``cudaHostRegister``
faults every page in). A page fault costs what a 4 KB copy costs dozens of times over, and
without it the first touch of every page of the pool, after every start, pays one on the
serving path (docs/design.md, "Storage tiers").
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading

import torch

from prefixd.api.layout import KVLayout
from prefixd.storage import poolfile
from prefixd.storage.errors import PoolFileMissingError, StorageError
from prefixd.storage.poolfile import PoolHeader

log = logging.getLogger(__name__)

POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux; elsewhere pages fault in on first touch
MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault the pages in writable, as MAP_POPULATE does


def _libc_madvise():
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


_madvise = _libc_madvise() if POPULATE else None


def _map_populated(fd: int, nbytes: int) -> mmap.mmap:
    """``fd`` mapped shared, read-write, every page faulted in (``MAP_POPULATE``'s effect).

    NOTE: populated by ``madvise(MADV_POPULATE_WRITE)`` through ctypes, which releases the
    GIL for the call: CPython's ``mmap.mmap`` holds it through a ``MAP_POPULATE`` mapping,
    and a pool made beside the daemon's event loop (``prefixd.daemon.offloop``) held the loop
    for the whole populate (about a second for 768 MB of tmpfs). A kernel without
    it (before 5.14) gets ``MAP_POPULATE``.
    """
    rw = mmap.PROT_READ | mmap.PROT_WRITE
    if _madvise is None:
        return mmap.mmap(fd, nbytes, mmap.MAP_SHARED | POPULATE, rw)
    mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, rw)
    view = (ctypes.c_char * nbytes).from_buffer(mapping)
    try:
        done = _madvise(ctypes.addressof(view), nbytes, MADV_POPULATE_WRITE) == 0
    finally:
        del view
    if done:
        return mapping
    mapping.close()
    return mmap.mmap(fd, nbytes, mmap.MAP_SHARED | POPULATE, rw)


def _open_or_create(path: str, header: PoolHeader, fresh: bool, file_id: bytes | None) -> tuple[int, PoolHeader]:
    """Create (``fresh``, or no file and no expected id) or open and check the pool file.

    Raises:
        PoolFileMissingError: ``file_id`` names a file that should exist and does not.
    """
    if not fresh and file_id is not None and not os.path.exists(path):
        raise PoolFileMissingError(path, file_id)
    if fresh or not os.path.exists(path):
        return poolfile.create_pool_file(path, header), header
    return poolfile.open_pool_file(path, header, expect_file_id=file_id is not None)


def _header(layout: KVLayout, kind: int, num_blocks: int, file_id: bytes | None) -> PoolHeader:
    return PoolHeader(kind, layout.block_bytes, num_blocks, file_id or poolfile.new_file_id(), layout.to_bytes())


class TensorPool:
    """A tier held in memory as one block-major tensor.

    Data structure:
        ``tensor``: typed view ``[num_blocks, *layout.block_shape]``, one contiguous block per slot.
        ``raw``: the same bytes as a uint8 tensor ``[num_blocks, block_bytes]``.
        ``rows``: for CPU pools, a uint8 numpy view ``[num_blocks, block_bytes]`` of the same
        memory (zero copy) for hashing and ``pwrite``; ``None`` on CUDA.
        ``path``/``file_id``: the shm pool file and its id (``None`` for a CUDA pool).

    Invariants: ``tensor`` and ``rows`` alias the same bytes; the mapping spans the whole file.

    NOTE: the shm file is created with ``posix_fallocate`` like a disk file: tmpfs pages are
    otherwise reserved on first touch, and a store into a full tmpfs is a SIGBUS, not an error.
    """

    def __init__(self, layout: KVLayout, kind: int, num_blocks: int, *, path: str | None,
                 fresh: bool = False, file_id: bytes | None = None, pin: bool = False) -> None:
        """Map (or allocate) the pool.

        Args:
            path: the shm pool file; ``None`` allocates on CUDA (device tier on a GPU host).
            fresh: replace an existing file instead of reopening it.
            file_id: expected id of an existing file (``None``: do not check), id of a new one
                (``fresh``); a file that is expected and missing is refused.
            pin: page-lock the mapping for fast DMA (``cudaHostRegister``; CUDA only).
        Raises:
            SpaceError: the file does not fit; HeaderMismatchError: an existing file is another pool's;
            PoolFileMissingError: ``file_id`` was given, ``fresh`` was not, and the file is gone.
        """
        self.layout = layout
        self.kind = kind
        self.num_blocks = num_blocks
        self.path = path
        self._mmap: mmap.mmap | None = None
        self._pinned_ptr: int | None = None
        if path is None:
            self.file_id = None
            self.tensor = torch.zeros(layout.pool_shape(num_blocks), dtype=layout.torch_dtype(), device="cuda")
            self.raw = self.tensor.view(num_blocks, -1).view(torch.uint8)
            self.rows = None
            return
        fd, header = _open_or_create(path, _header(layout, kind, num_blocks, file_id), fresh, file_id)
        try:
            self._mmap = _map_populated(fd, header.file_bytes)
        finally:
            os.close(fd)
        self.file_id = header.file_id
        raw = torch.frombuffer(self._mmap, dtype=torch.uint8, count=num_blocks * layout.block_bytes,
                               offset=header.data_offset) if num_blocks else torch.empty(0, dtype=torch.uint8)
        self.raw = raw.view(num_blocks, layout.block_bytes)
        self.rows = self.raw.numpy()
        self.tensor = raw.view(layout.torch_dtype()).view(layout.pool_shape(num_blocks))
        if pin and torch.cuda.is_available():  # pragma: no cover - needs a GPU
            nbytes = num_blocks * layout.block_bytes
            err = torch.cuda.cudart().cudaHostRegister(raw.data_ptr(), nbytes, 0)
            if int(err) != 0:
                raise StorageError(f"cudaHostRegister of {path} ({nbytes} bytes) failed: error {err}")
            self._pinned_ptr = raw.data_ptr()

    @property
    def is_cuda(self) -> bool:
        return self.tensor.is_cuda

    def descriptor(self) -> dict:
        """What a client needs to map this pool (the Attach reply's pool descriptor)."""
        return {
            "path": self.path, "offset": poolfile.DATA_OFFSET, "shape": list(self.tensor.shape),
            "strides": list(self.tensor.stride()), "dtype": self.layout.dtype, "file_id": self.file_id,
        }

    def close(self) -> None:
        """Drop the mapping (shm bytes stay in the file). Tensors handed out keep it alive."""
        if self._pinned_ptr is not None:  # pragma: no cover - needs a GPU
            torch.cuda.cudart().cudaHostUnregister(self._pinned_ptr)
            self._pinned_ptr = None
        self.tensor = self.raw = self.rows = None
        self._mmap = None  # unmapped when the last tensor view is freed

    def check_invariants(self) -> None:
        if self.tensor is None:
            return
        assert self.tensor.shape[0] == self.num_blocks
        if self.rows is not None:
            assert self.rows.shape == (self.num_blocks, self.layout.block_bytes)
            assert self.rows.ctypes.data == self.tensor.data_ptr() or self.num_blocks == 0


class DiskPool:
    """A tier held in one preallocated pool file, moved with ``preadv``/``pwritev``.

    Data structure: ``fd`` open O_RDWR on ``path``; slot ``s`` lives at
    ``data_offset + s * block_bytes``; ``dirty`` says whether bytes were written since the last
    ``sync``.

    Invariants: the file is at least ``data_offset + num_blocks * block_bytes`` long when opened
    (a shorter file is re-extended; its lost slots then fail their checksums).
    """

    def __init__(self, layout: KVLayout, kind: int, num_blocks: int, *, path: str,
                 fresh: bool = False, file_id: bytes | None = None) -> None:
        """Open or create the pool file; same Args and Raises as ``TensorPool``."""
        self.layout = layout
        self.kind = kind
        self.num_blocks = num_blocks
        self.path = path
        self.block_bytes = layout.block_bytes
        self.fd, header = _open_or_create(path, _header(layout, kind, num_blocks, file_id), fresh, file_id)
        self.file_id = header.file_id
        self.data_offset = header.data_offset
        self.dirty = False
        self._dirty_lock = threading.Lock()

    def offset(self, slot: int) -> int:
        return self.data_offset + slot * self.block_bytes

    def write_run(self, slot: int, buffers: list) -> None:
        """Write ``buffers`` back to back starting at ``slot``.

        Raises:
            StorageError: on a short write or an I/O error, naming the file and offset.
        """
        want = sum(memoryview(b).nbytes for b in buffers)
        off = self.offset(slot)
        try:
            done = os.pwritev(self.fd, buffers, off)
        except OSError as exc:
            raise StorageError(f"write of {want} bytes at offset {off} of {self.path} failed: {exc}") from exc
        if done != want:
            raise StorageError(f"short write to {self.path} at offset {off}: {done} of {want} bytes")
        self.dirty = True

    def read_run(self, slot: int, buffer) -> int:
        """Read into ``buffer`` from ``slot`` on; bytes past end of file are zero-filled.

        Returns:
            the number of bytes actually read (less than ``len(buffer)`` for a truncated file).
        Raises:
            StorageError: on an I/O error, naming the file and offset.
        """
        view = memoryview(buffer).cast("B")
        off, total = self.offset(slot), 0
        while total < view.nbytes:
            try:
                n = os.preadv(self.fd, [view[total:]], off + total)
            except OSError as exc:
                raise StorageError(f"read at offset {off + total} of {self.path} failed: {exc}") from exc
            if n == 0:
                view[total:] = bytes(view.nbytes - total)
                break
            total += n
        return total

    def sync(self) -> bool:
        """Make every write so far durable; returns whether anything had to be flushed."""
        with self._dirty_lock:
            if not self.dirty:
                return False
            self.dirty = False
        try:
            os.fdatasync(self.fd)
        except OSError as exc:
            self.dirty = True
            raise StorageError(f"fdatasync of {self.path} failed: {exc}") from exc
        return True

    def prefetch(self, slot: int, n: int) -> None:
        """Start reading ``n`` slots from ``slot`` into the page cache without waiting."""
        os.posix_fadvise(self.fd, self.offset(slot), n * self.block_bytes, os.POSIX_FADV_WILLNEED)

    def drop_cache(self) -> None:
        """Ask the kernel to drop this file's clean pages (benchmarks: a cold read)."""
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def check_invariants(self) -> None:
        if self.fd >= 0:
            assert os.fstat(self.fd).st_size >= self.offset(self.num_blocks) or self.num_blocks == 0
