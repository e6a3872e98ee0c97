"""Pools: the memory of one tier for one KV layout.

``TensorPool`` is a tensor ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``:
on CUDA for the device tier when a GPU is present, otherwise a MAP_SHARED mapping of a pool file
in a shared-memory directory (``/dev/shm``), so clients can map it and its bytes outlive a daemon
crash (not a reboot). ``DiskPool`` is a pool file in the state directory, moved with
``pread``/``pwrite`` and made durable with one ``fdatasync`` per batch.

NOTE: disk pools are not mapped. ``pwrite`` + ``fsync`` and writes through a mapping +
``msync`` cost the same, and cold ``preadv`` is within noise of a cold mapped read; but a mapped disk file that is truncated behind our back turns the next load into SIGBUS,
which kills the daemon, while ``preadv`` just returns short and the block fails its checksum.

Both file-backed pools are sparse (``prefixd.storage.extents.SparsePoolFile``): the file is as
large as its ``num_blocks`` and a hole until extents are grown for the slots handed out
(``prefixd.storage.extent_slots``). A CUDA pool is allocated whole, and charged whole to the
device budget's ledger when it is opened (given back when it closes): CUDA's virtual-memory
API could grow it by extents, but there is no GPU here to test that on.

NOTE: a shm pool is mapped without ``MAP_POPULATE``, which would allocate the whole hole; each
extent is populated as it grows (``madvise(MADV_POPULATE_WRITE)`` on its range): its pages are
in this process's page tables before a slot in it is handed out, as a GPU host's pinned pool
is (``cudaHostRegister`` faults every page in). A page fault costs what a 4 KB copy costs
dozens of times over, and without it the first touch of every page, after every start, pays
one on the serving path (docs/design.md, "Storage tiers").
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading

import torch

from prefixd.api.layout import KVLayout
from prefixd.api.tiers import DEVICE, DISK, HOST, TIER_NAMES
from prefixd.storage import poolfile
from prefixd.storage.budget_ledger import BudgetLedger
from prefixd.storage.errors import PoolFileMissingError, StorageError
from prefixd.storage.extents import SparsePoolFile
from prefixd.storage.poolfile import PoolHeader

log = logging.getLogger(__name__)

POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux; elsewhere pages fault in on first touch
MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault the pages in writable, as MAP_POPULATE does
UNBOUNDED = 1 << 62  # a pool's own ledger when it is given none: no budget
DEFAULT_TENANT = "default"


def _libc_madvise():
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


_madvise = _libc_madvise() if POPULATE else None


def _populate(address: int, nbytes: int) -> None:
    """Fault ``nbytes`` of a shared mapping from ``address`` in, writable (best effort: a
    kernel before 5.14 refuses, and the pages then fault in on first touch).

    NOTE: through ctypes, which releases the GIL for the call: a pool grown or recovered
    beside the daemon's event loop (``prefixd.daemon.offloop``) does not hold the loop while
    its pages fault in (about a second for 768 MB of tmpfs).
    """
    if _madvise is not None and nbytes > 0:
        _madvise(address, nbytes, MADV_POPULATE_WRITE)


def _mapping_address(mapping: mmap.mmap) -> int:
    view = ctypes.c_char.from_buffer(mapping)
    try:
        return ctypes.addressof(view)
    finally:
        del view


def open_sparse(path: str, header: PoolHeader, *, fresh: bool, file_id: bytes | None,
                ledger: BudgetLedger | None, tenant: str, durable: bool) -> SparsePoolFile:
    """Create (``fresh``, or no file and no expected id) or open and check a sparse pool file,
    charged to ``ledger`` (None: a ledger of its own, unbounded).

    Raises:
        PoolFileMissingError: ``file_id`` names a file that should exist and does not.
        SpaceError, NoSpaceError, BudgetExceededError, HeaderMismatchError: see ``SparsePoolFile``.
    """
    if not fresh and file_id is not None and not os.path.exists(path):
        raise PoolFileMissingError(path, file_id)
    if ledger is None:
        ledger = BudgetLedger(f"kind {header.kind}", UNBOUNDED)
    return SparsePoolFile(path, header, ledger=ledger, tenant=tenant, durable=durable,
                          fresh=fresh, expect_file_id=file_id is not None)


def open_pool(layout: KVLayout, tier: int, num_blocks: int, *, state_dir: str, shm_dir: str,
              name: str, fresh: bool, file_id: bytes | None, cuda: bool, ledger: BudgetLedger,
              tenant: str) -> "TensorPool | DiskPool":
    """The pool of ``tier`` (``prefixd.api.tiers``): DISK in ``state_dir/<name>.disk.pool``; a
    CUDA tensor for DEVICE when ``cuda``; else ``shm_dir/<name>.<tier>.pool``. Raises what the
    pools' constructors raise."""
    if tier == DISK:
        return DiskPool(layout, tier, num_blocks, path=os.path.join(state_dir, f"{name}.disk.pool"),
                        fresh=fresh, file_id=file_id, ledger=ledger, tenant=tenant)
    if tier == DEVICE and cuda:  # pragma: no cover - needs a GPU
        return TensorPool(layout, tier, num_blocks, path=None, ledger=ledger, tenant=tenant)
    path = os.path.join(shm_dir, f"{name}.{TIER_NAMES[tier]}.pool")
    return TensorPool(layout, tier, num_blocks, path=path, fresh=fresh, file_id=file_id,
                      pin=tier == HOST and cuda, ledger=ledger, tenant=tenant)


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

        ``sparse``: the shm file (``SparsePoolFile``; None on CUDA).
        ``fixed_bytes``: what a whole (unmapped, CUDA) pool is charged to its ledger at open,
        all of it, and gives back at ``close`` (0 for a file-backed pool: ``sparse`` charges).

    Invariants: ``tensor`` and ``rows`` alias the same bytes; the mapping spans the whole file.

    NOTE: every extent of the shm file is fallocated before a slot in it is handed out: tmpfs
    pages are otherwise reserved on first touch, and a store into a full tmpfs is a SIGBUS, not
    an error.
    """

    def __init__(self, layout: KVLayout, kind: int, num_blocks: int, *, path: str | None,
                 fresh: bool = False, file_id: bytes | None = None, pin: bool = False,
                 ledger: BudgetLedger | None = None, tenant: str = DEFAULT_TENANT,
                 device: str = "cuda") -> None:
        """Map (or allocate) the pool.

        Args:
            path: the shm pool file; ``None`` allocates the whole pool on ``device`` (CUDA: the
                device tier on a GPU host), charged whole to ``ledger`` first.
            fresh: replace an existing file instead of reopening it.
            file_id: expected id of an existing file (``None``: do not check), id of a new one
                (``fresh``); a file that is expected and missing is refused.
            pin: page-lock the mapping for fast DMA (``cudaHostRegister``; CUDA only).
            ledger, tenant: who the file's extents are charged to (``open_sparse``).
        Raises:
            SpaceError: the header's extent does not fit; BudgetExceededError: nor its budget
            (a whole pool: all of it);
            HeaderMismatchError: an existing file is another pool's;
            PoolFileMissingError: ``file_id`` was given, ``fresh`` was not, and the file is gone.
        """
        self.layout = layout
        self.kind = kind
        self.num_blocks = num_blocks
        self.path = path
        self._mmap: mmap.mmap | None = None
        self._pinned_ptr: int | None = None
        self.sparse: SparsePoolFile | None = None
        self.fixed_bytes = 0
        self._ledger, self._tenant = ledger, tenant
        if path is None:
            self.file_id = None
            nbytes = num_blocks * layout.block_bytes
            if ledger is not None:
                ledger.charge(tenant, nbytes)  # NOTE: a GPU pool stays whole (module docstring)
            try:
                self.tensor = torch.zeros(layout.pool_shape(num_blocks), dtype=layout.torch_dtype(),
                                          device=device)
            except BaseException:
                if ledger is not None:
                    ledger.release(tenant, nbytes)
                raise
            self.fixed_bytes = nbytes if ledger is not None else 0
            self.raw = self.tensor.view(num_blocks, -1).view(torch.uint8)
            self.rows = None
            return
        self.sparse = open_sparse(path, _header(layout, kind, num_blocks, file_id), fresh=fresh,
                                  file_id=file_id, ledger=ledger, tenant=tenant, durable=False)
        header = self.sparse.header
        try:
            self._mmap = mmap.mmap(self.sparse.fd, header.file_bytes, mmap.MAP_SHARED,
                                   mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            self.sparse.close()
            raise
        self._address = _mapping_address(self._mmap)
        _populate(self._address, self.sparse.extent_map.charge(0))
        self.sparse.on_grow = self._populate
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

    def _populate(self, offset: int, nbytes: int) -> None:
        """A grown range of the file: its pages into the page tables (module NOTE)."""
        _populate(self._address + offset, nbytes)

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
        if self.fixed_bytes:
            self._ledger.release(self._tenant, self.fixed_bytes)
            self.fixed_bytes = 0
        if self.sparse is not None:
            self.sparse.on_grow = None
            self.sparse.close()

    def check_invariants(self) -> None:
        if self.tensor is None:
            return
        assert self.tensor.shape[0] == self.num_blocks
        if self.rows is not None:
            assert self.rows.shape == (self.num_blocks, self.layout.block_bytes)
            assert self.rows.ctypes.data == self.tensor.data_ptr() or self.num_blocks == 0


class DiskPool:
    """A tier held in one sparse pool file, moved with ``preadv``/``pwritev``.

    Data structure: ``sparse`` the file (``SparsePoolFile``, fsynced after each grow), ``fd``
    its descriptor; slot ``s`` lives at
    ``data_offset + s * block_bytes``; ``dirty`` says whether bytes were written since the last
    ``sync``.

    Invariants: the file is at least ``data_offset + num_blocks * block_bytes`` long when opened
    (a shorter file is re-extended; its lost slots then fail their checksums).
    """

    def __init__(self, layout: KVLayout, kind: int, num_blocks: int, *, path: str,
                 fresh: bool = False, file_id: bytes | None = None,
                 ledger: BudgetLedger | None = None, tenant: str = DEFAULT_TENANT) -> None:
        """Open or create the pool file; same Args and Raises as ``TensorPool``."""
        self.layout = layout
        self.kind = kind
        self.num_blocks = num_blocks
        self.path = path
        self.block_bytes = layout.block_bytes
        self.sparse = open_sparse(path, _header(layout, kind, num_blocks, file_id), fresh=fresh,
                                  file_id=file_id, ledger=ledger, tenant=tenant, durable=True)
        self.fd, header = self.sparse.fd, self.sparse.header
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
        self.sparse.close()
        self.fd = -1

    def check_invariants(self) -> None:
        if self.fd >= 0:
            assert os.fstat(self.fd).st_size >= self.offset(self.num_blocks) or self.num_blocks == 0
