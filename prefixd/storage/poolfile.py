"""Pool files: the on-disk (and in-shm) format of one pool, its header, and its allocation.

A pool file is::

    offset 0            header (HEADER_BYTES = 4096, zero padded)
    offset DATA_OFFSET  slot 0 | slot 1 | ... | slot num_slots-1     (each block_bytes long)

Header fields, little-endian, in this order:

    magic        8 bytes  b"PFXDPOOL"
    version      u32      FORMAT_VERSION; a different version is refused
    kind         u32      which tier wrote it (0 device, 1 host, 2 disk); a different kind is refused
    data_offset  u64      where slot 0 starts (page aligned)
    block_bytes  u64      bytes per slot
    num_slots    u64      slots in the file
    file_id      16 bytes random at creation; the cache core persists it and passes it back,
                          so a file swapped in from another state directory is refused
    layout_len   u32      length of the layout bytes that follow
    layout       bytes    ``KVLayout.to_bytes()``
    header_hash  u64      xxh3-64 of every header byte before it (a torn header is refused)

Slots carry no per-slot metadata: a block's checksum lives in the index (the WAL), because
the index is what says which bytes are supposed to be in a slot.

NOTE: a fresh file is built under a temporary name (allocate, write header, fsync) and renamed
into place, then the directory is fsynced. A crash during creation leaves a stray ``*.tmp``,
never a file with a valid header over missing space.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import secrets
import struct

import xxhash

from prefixd.api.layout import KVLayout
from prefixd.storage.errors import HeaderMismatchError, SpaceError, StorageError

log = logging.getLogger(__name__)

MAGIC = b"PFXDPOOL"
FORMAT_VERSION = 1
HEADER_BYTES = 4096
DATA_OFFSET = HEADER_BYTES  # slots start on a page boundary
_FIXED = struct.Struct("<8sIIQQQ16sI")
_DAMAGED_ADVICE = ("restore the file, or move it aside to start that tier empty (the blocks cached "
                   "in it are lost; the index forgets them only with forget_missing_tier)")


@dataclasses.dataclass(frozen=True)
class PoolHeader:
    """What a pool file says about itself (see the module docstring for the byte layout)."""

    kind: int
    block_bytes: int
    num_slots: int
    file_id: bytes
    layout_bytes: bytes
    version: int = FORMAT_VERSION
    data_offset: int = DATA_OFFSET

    @property
    def file_bytes(self) -> int:
        return self.data_offset + self.block_bytes * self.num_slots

    def encode(self) -> bytes:
        fixed = _FIXED.pack(
            MAGIC, self.version, self.kind, self.data_offset, self.block_bytes, self.num_slots,
            self.file_id, len(self.layout_bytes),
        )
        body = fixed + self.layout_bytes
        body += struct.pack("<Q", xxhash.xxh3_64_intdigest(body))
        if len(body) > HEADER_BYTES:
            raise ValueError(f"layout too long for a pool header: {len(self.layout_bytes)} bytes")
        return body.ljust(HEADER_BYTES, b"\0")

    @classmethod
    def decode(cls, raw: bytes, path: str) -> "PoolHeader":
        """Parse a header; raises HeaderMismatchError naming ``path`` if it is not one."""
        if len(raw) < _FIXED.size or raw[:8] != MAGIC:
            raise HeaderMismatchError(f"{path} is not a prefixd pool file (bad magic); {_DAMAGED_ADVICE}")
        magic, version, kind, data_offset, block_bytes, num_slots, file_id, n = _FIXED.unpack_from(raw)
        end = _FIXED.size + n
        if end + 8 > len(raw):
            raise HeaderMismatchError(f"{path}: pool header is truncated (layout length {n}); {_DAMAGED_ADVICE}")
        (stored,) = struct.unpack_from("<Q", raw, end)
        if stored != xxhash.xxh3_64_intdigest(raw[:end]):
            raise HeaderMismatchError(f"{path}: pool header checksum does not match (torn or corrupt "
                                      f"header); {_DAMAGED_ADVICE}")
        return cls(kind, block_bytes, num_slots, file_id, bytes(raw[_FIXED.size:end]), version, data_offset)


def free_bytes(directory: str) -> int:
    """Bytes an unprivileged writer may still allocate on ``directory``'s filesystem."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def _allocate(fd: int, path: str, size: int) -> None:
    """Reserve ``size`` bytes for ``fd`` so that later writes (or mapped stores) cannot fail.

    Raises:
        SpaceError: when the filesystem cannot hold ``size`` bytes.
    """
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise SpaceError(path, size, free_bytes(os.path.dirname(path) or "."), os.strerror(exc.errno)) from exc
        raise StorageError(f"posix_fallocate({path}, {size}) failed: {exc}") from exc


def check_space(directory: str, path: str, size: int) -> None:
    """Refuse early, before touching anything, when ``size`` bytes cannot fit in ``directory``.

    Raises:
        SpaceError: with the asked and the free byte counts.
    """
    free = free_bytes(directory)
    if size > free:
        raise SpaceError(path, size, free)


def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def create_pool_file(path: str, header: PoolHeader, allocate_bytes: int | None = None) -> int:
    """Create ``path`` fresh (replacing any file there) and return an O_RDWR fd to it.

    Args:
        allocate_bytes: allocate only the first this many bytes and leave the rest of the file
            a hole (a sparse pool file, ``prefixd.storage.extents``); None: all of it.
    Raises:
        SpaceError: if the filesystem cannot hold what is allocated (nothing is left behind).
    """
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    tmp = path + ".tmp"
    if os.path.exists(tmp):
        os.unlink(tmp)
    allocate = header.file_bytes if allocate_bytes is None else min(allocate_bytes, header.file_bytes)
    check_space(directory, path, allocate)
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, header.file_bytes)
        _allocate(fd, path, allocate)
        os.pwrite(fd, header.encode(), 0)
        os.fsync(fd)
        os.rename(tmp, path)
        fsync_dir(directory)
    except BaseException:
        os.close(fd)
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    log.info("pool file created path=%s bytes=%d allocated=%d slots=%d", path, header.file_bytes,
             allocate, header.num_slots)
    return fd


def open_pool_file(path: str, expected: PoolHeader, expect_file_id: bool,
                   sparse: bool = False) -> tuple[int, PoolHeader]:
    """Open an existing pool file and check its header against ``expected``.

    ``expected.file_id`` is compared only when ``expect_file_id`` is true (the caller knows it
    from its own durable state). A file shorter than its header says (truncated behind our back)
    is extended back to full size: the lost slots read as zeros and fail their checksums. A
    ``sparse`` file is extended as a hole (its extents are allocated as they are used).

    Returns:
        (fd, the header found in the file).
    Raises:
        HeaderMismatchError: version, kind, layout, block size, slot count or file id differ.
    """
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        found = PoolHeader.decode(os.pread(fd, HEADER_BYTES, 0), path)
        _compare(path, expected, found, expect_file_id)
        size = os.fstat(fd).st_size
        if size < found.file_bytes:
            log.warning("pool file shorter than its header says, re-extending path=%s size=%d expected=%d",
                        path, size, found.file_bytes)
            if sparse:
                os.ftruncate(fd, found.file_bytes)
            else:
                _allocate(fd, path, found.file_bytes)
    except BaseException:
        os.close(fd)
        raise
    return fd, found


def _compare(path: str, want: PoolHeader, got: PoolHeader, expect_file_id: bool) -> None:
    def refuse(field: str, w, g) -> None:
        raise HeaderMismatchError(
            f"{path}: pool file {field} is {g!r} but this pool expects {w!r}; "
            "point the daemon at the right state directory, or create the pool fresh (its cached blocks are lost)"
        )

    if got.version != want.version:
        refuse("format version", want.version, got.version)
    if got.kind != want.kind:
        refuse("tier kind", want.kind, got.kind)
    if got.layout_bytes != want.layout_bytes:
        refuse("layout", KVLayout.from_bytes(want.layout_bytes), _layout_or_raw(got.layout_bytes))
    if got.block_bytes != want.block_bytes:
        refuse("block_bytes", want.block_bytes, got.block_bytes)
    if got.num_slots != want.num_slots:
        refuse("num_slots", want.num_slots, got.num_slots)
    if got.data_offset % 4096 or got.data_offset < HEADER_BYTES:
        refuse("data_offset", want.data_offset, got.data_offset)
    if expect_file_id and got.file_id != want.file_id:
        refuse("file id", want.file_id.hex(), got.file_id.hex())


def _layout_or_raw(raw: bytes):
    try:
        return KVLayout.from_bytes(raw)
    except (ValueError, UnicodeDecodeError):
        return raw


def new_file_id() -> bytes:
    return secrets.token_bytes(16)
