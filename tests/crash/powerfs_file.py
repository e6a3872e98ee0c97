"""One PowerFS file's bytes: a durable store file under a volatile overlay of dirty pages.

`FileNode` is the file's node in the PowerFS tree (`powerfs_nodes.Node`) and owns its bytes:

- The durable bytes live in one store file (``fd``, ``store/<ino>`` of the model), exactly
  ``durable_size`` long. Writes never touch it: they go to ``dirty``, a dict of whole 4 KiB
  pages (page index -> 4096 bytes), which is the volatile overlay.
- What a process reads is the overlay over the store: a dirty page if there is one, else the
  store bytes below ``floor``, else zeros, clipped to ``live_size``.
- ``floor <= min(durable_size, live_size)``: a truncate since the last sync hides the store
  bytes past it; the store file itself is only cut at the next sync.
- Every dirty page starts below ``live_size`` and its bytes past ``live_size`` are zero.

The file knows nothing of names, handles or counters: `powerfs_model.PowerModel` resolves a
call to a `FileNode`, counts it, and decides when the rules make the file durable (`sync`,
`sync_pages`). A file whose store was handed to the backing directory at a power cut has
``fd == -1``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from tests.crash.powerfs_nodes import PAGE_SIZE, Node, PowerFSError


@dataclass(eq=False)
class FileNode(Node):
    """A regular file: its store file, its sizes and its dirty pages (see the module doc)."""

    fd: int = -1  # the store file, O_RDWR
    durable_size: int = 0
    live_size: int = 0
    floor: int = 0
    dirty: dict[int, bytearray] = field(default_factory=dict)

    # ---- what a process sees -----------------------------------------------------------

    def page(self, idx: int) -> bytearray:
        """A copy of the visible 4 KiB of page `idx` (not clipped to live_size: past it, 0)."""
        page = self.dirty.get(idx)
        if page is not None:
            return bytearray(page)
        start = idx * PAGE_SIZE
        buf = bytearray(PAGE_SIZE)
        if start < self.floor:
            got = os.pread(self.fd, min(PAGE_SIZE, self.floor - start), start)
            buf[: len(got)] = got
        return buf

    def read(self, size: int, offset: int) -> bytes:
        """Up to `size` visible bytes from `offset` (fewer past ``live_size``)."""
        end = min(offset + size, self.live_size)
        if offset >= end:
            return b""
        buf = bytearray(end - offset)
        if offset < self.floor:
            got = os.pread(self.fd, min(end, self.floor) - offset, offset)
            buf[: len(got)] = got
        for idx in range(offset // PAGE_SIZE, (end - 1) // PAGE_SIZE + 1):
            page = self.dirty.get(idx)
            if page is None:
                continue
            lo, hi = max(idx * PAGE_SIZE, offset), min((idx + 1) * PAGE_SIZE, end)
            buf[lo - offset : hi - offset] = page[lo - idx * PAGE_SIZE : hi - idx * PAGE_SIZE]
        return bytes(buf)

    # ---- changes to the overlay --------------------------------------------------------

    def write(self, data: bytes, offset: int) -> range:
        """Put `data` at `offset` into the overlay, growing the file past its end.

        Returns:
            The indexes of the pages written (empty for empty `data`).
        """
        end = offset + len(data)
        pages = self._overwrite(offset, end, memoryview(data))
        self.live_size = max(self.live_size, end)
        self.mtime_ns = time.time_ns()
        return pages

    def resize(self, length: int) -> None:
        """Truncate or extend to `length`: dirty bytes past it go; the store keeps its own."""
        if length < self.live_size:
            for idx in [i for i in self.dirty if i * PAGE_SIZE >= length]:
                del self.dirty[idx]
            tail = self.dirty.get(length // PAGE_SIZE)
            if tail is not None:
                tail[length % PAGE_SIZE :] = bytes(PAGE_SIZE - length % PAGE_SIZE)
            self.floor = min(self.floor, length)
        self.live_size = length
        self.mtime_ns = time.time_ns()

    def punch(self, offset: int, length: int) -> None:
        """Zero `length` bytes from `offset` inside the file, as a write of zeros would (the
        size does not change)."""
        self._overwrite(offset, min(offset + length, self.live_size), None)

    def _overwrite(self, offset: int, end: int, data: memoryview | None) -> range:
        """Put `data` (zeros when None) over ``[offset, end)``, page by page; the pages."""
        pages = range(offset // PAGE_SIZE, (end - 1) // PAGE_SIZE + 1 if end > offset else 0)
        for idx in pages:
            page = self.page(idx)
            lo, hi = max(idx * PAGE_SIZE, offset), min((idx + 1) * PAGE_SIZE, end)
            page[lo - idx * PAGE_SIZE : hi - idx * PAGE_SIZE] = (
                bytes(hi - lo) if data is None else data[lo - offset : hi - offset])
            self.dirty[idx] = page
        return pages

    # ---- durability --------------------------------------------------------------------

    def sync(self) -> None:
        """The whole file reaches the store: a pending truncate, every dirty page, the size."""
        if self.floor < self.durable_size:
            os.ftruncate(self.fd, self.floor)
        for idx in sorted(self.dirty):
            self._store_page(idx, self.dirty[idx])
        os.ftruncate(self.fd, self.live_size)
        self.dirty.clear()
        self.durable_size = self.floor = self.live_size

    def sync_pages(self, pages) -> None:
        """Only `pages` (those an O_DSYNC write wrote) and the size reach the store.

        Raises:
            PowerFSError: a truncate is pending (the caller syncs the whole file instead).
        """
        if self.floor < self.durable_size:
            raise PowerFSError(f"ino {self.ino}: a pending truncate must land before pages")
        for idx in pages:
            page = self.dirty.pop(idx, None)
            if page is not None:
                self._store_page(idx, page)
        os.ftruncate(self.fd, self.live_size)
        self.durable_size = self.floor = self.live_size

    def _store_page(self, idx: int, page: bytearray) -> None:
        """Write one dirty page to the store file, clipped to ``live_size``."""
        start = idx * PAGE_SIZE
        os.pwrite(self.fd, bytes(page[: max(0, min(PAGE_SIZE, self.live_size - start))]), start)

    # ---- checks ------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise PowerFSError naming the first broken invariant of the file's bytes."""
        if self.fd < 0:
            return
        if self.floor > min(self.durable_size, self.live_size):
            raise PowerFSError(f"ino {self.ino}: floor {self.floor} above sizes "
                               f"{self.durable_size}/{self.live_size}")
        if os.fstat(self.fd).st_size != self.durable_size:
            raise PowerFSError(f"ino {self.ino}: store size != durable_size {self.durable_size}")
        for idx, page in self.dirty.items():
            start = idx * PAGE_SIZE
            if start >= self.live_size or any(page[max(0, self.live_size - start):]):
                raise PowerFSError(f"ino {self.ino}: dirty page {idx} past size {self.live_size}")
