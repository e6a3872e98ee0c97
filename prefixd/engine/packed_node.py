"""``PackedNode``: a radix node rebuilt by a checkpoint load, whose per-block hashes and
checksums stay packed bytes until something reads them."""

from __future__ import annotations

import sys
from array import array

import numpy as np

from prefixd.cache.node import Node

# the base class's slot descriptors: a PackedNode keeps its lists there once unpacked
_HASHES = Node.hashes
_CHECKSUMS = Node.checksums
_SWAP = sys.byteorder != "little"


class PackedNode(Node):
    """A ``Node`` whose ``hashes`` (16 bytes each) and ``checksums`` (u64 little-endian) stay
    the bytes the checkpoint stored until code first reads them; from then on they are the
    plain lists a ``Node`` holds, kept in its slots.

    Fields (besides ``Node``'s):
        _packed_hashes: the run's hashes, packed, or ``None`` once ``hashes`` was read or set.
        _packed_sums: the run's checksums, packed, or ``None`` once ``checksums`` was read or
            set (or when the run has none).

    Invariants: reading ``hashes`` or ``checksums`` gives exactly what a plain ``Node`` of the
    same run holds; at most one form of each is held at a time.

    Why: a 1M-block checkpoint made a million 16-byte hash objects and a million checksum
    ints at load (a fifth of a 1M-block recovery, with the page faults of ~90 MB of small
    objects), while replay names a run by its first and last hash (``run_ends``) and most
    runs are not touched again before the next checkpoint, which dumps the packed bytes as
    they are (``packed_hashes``, ``packed_checksums``).

    NOTE: a subclass, not a change to ``Node``: live nodes keep plain slot access on the hot
    path, and only nodes a restart loaded pay a property call (~0.1 us) per read.
    """

    __slots__ = ("_packed_hashes", "_packed_sums")

    def __init__(self, parent, key, tokens, num_blocks, packed_hashes: bytes, packed_sums: bytes | None,
                 slots, last_access=0) -> None:
        super().__init__(parent, key, tokens, num_blocks, None, slots, last_access)
        self._packed_hashes = packed_hashes
        self._packed_sums = packed_sums

    @property
    def hashes(self) -> list[bytes]:
        packed = self._packed_hashes
        if packed is not None:
            self._packed_hashes = None
            # V16, not S16 (that would strip trailing zero bytes): bytes objects made in C
            _HASHES.__set__(self, np.frombuffer(packed, "V16").tolist())
        return _HASHES.__get__(self, PackedNode)

    @hashes.setter
    def hashes(self, value: list[bytes]) -> None:
        self._packed_hashes = None
        _HASHES.__set__(self, value)

    @property
    def checksums(self) -> list[int] | None:
        packed = self._packed_sums
        if packed is not None:
            self._packed_sums = None
            _CHECKSUMS.__set__(self, np.frombuffer(packed, "<u8").tolist())
        return _CHECKSUMS.__get__(self, PackedNode)

    @checksums.setter
    def checksums(self, value: list[int] | None) -> None:
        self._packed_sums = None
        _CHECKSUMS.__set__(self, value)

    @property
    def last_hash(self) -> bytes:
        packed = self._packed_hashes
        return packed[-16:] if packed is not None else self.hashes[-1]

    def still_packed(self) -> tuple[bytes | None, bytes | None]:
        """``(hashes, checksums)`` as the checkpoint stored them, each ``None`` once unpacked
        (read or set) or, for checksums, when the run has none."""
        return self._packed_hashes, self._packed_sums


def run_ends(node: Node) -> tuple[bytes, bytes]:
    """``node``'s first and last block hash, without unpacking a ``PackedNode``."""
    packed = node.still_packed()[0] if type(node) is PackedNode else None
    if packed is not None:
        return packed[:16], packed[-16:]
    hashes = node.hashes
    return hashes[0], hashes[-1]


def packed_hashes(node: Node) -> bytes:
    """``node``'s hashes as the checkpoint stores them (16 bytes each, in block order)."""
    packed = node.still_packed()[0] if type(node) is PackedNode else None
    if packed is not None:
        return packed
    return b"".join(node.hashes)


def packed_checksums(node: Node) -> bytes | None:
    """``node``'s checksums as the checkpoint stores them (u64 little-endian), or ``None``."""
    packed = node.still_packed()[1] if type(node) is PackedNode else None
    if packed is not None:
        return packed
    sums = node.checksums
    if sums is None:
        return None
    packed = array("Q", sums)  # NOTE: not numpy.asarray: see prefixd.engine.records
    if _SWAP:  # pragma: no cover - big-endian hosts
        packed.byteswap()
    return packed.tobytes()
