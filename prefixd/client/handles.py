"""What session calls hand back: ``Sequence`` (a live handle, updated in place) and
``LookupResult``."""

from __future__ import annotations

from typing import NamedTuple

from prefixd.api import prefixd_pb2 as pb
from prefixd.client.errors import DaemonRestarted, NotFound
from prefixd.client.wire import unpack_ints


class LookupResult(NamedTuple):
    """Cached tokens of a prompt, by tier (``Session.lookup_tiers``); nothing is pinned."""

    cached_tokens: int
    device_tokens: int
    host_tokens: int
    disk_tokens: int
    unverified_tokens: int


class Sequence:
    """A sequence this session holds in the daemon: its id and block table as of the last reply.

    Data structure:
        ``id``: the daemon's sequence id (changes when the session reclaims it after a restart).
        ``num_tokens`` (also ``len(seq)``), ``cached_tokens`` (tokens that were hits at open).
        ``block_table``: list of device-pool slots, one per block; token ``t`` is row
        ``t % block_size`` of slot ``block_table[t // block_size]``.
        ``num_indexed``: leading blocks that are committed (shared, read-only).
        ``reclaimed``: True after a daemon restart gave the sequence back; then ``num_tokens``
        is what survived (whole committed blocks) and ``previous_num_tokens`` what it had, so
        the caller recomputes (extends and writes) tokens ``num_tokens .. previous_num_tokens``.
        ``lost``: nothing survived; the handle is dead, open the prompt again.
        ``released``: released (or the session ended); the handle is dead.
        ``restarted``: a recovery changed the handle and no call has told the caller yet: the
        next call naming it raises ``DaemonRestarted`` once (and clears it), so a caller never
        extends a sequence that was cut back without knowing.

    Invariants: ``num_indexed <= len(block_table)``; every field comes from one daemon reply
    (``update``), never computed locally, so the handle cannot drift from the daemon's view.

    NOTE: after ``fork`` the parent and its children share every block, including a partial
    last one that the daemon copies on the next ``extend`` (copy-on-write). The handle
    remembers the table at the fork; blocks still equal to it may be shared with siblings, so
    the mapped path sends writes that reach them over the rpc, where the daemon knows the
    refcounts, instead of storing into memory a sibling reads.
    """

    __slots__ = ("id", "num_tokens", "cached_tokens", "block_table", "num_indexed", "reclaimed",
                 "lost", "released", "previous_num_tokens", "restarted", "_fork_table")

    def __init__(self, reply: pb.SequenceReply) -> None:
        self.id = 0
        self.num_tokens = 0
        self.cached_tokens = 0
        self.block_table: list[int] = []
        self.num_indexed = 0
        self.reclaimed = False
        self.lost = False
        self.released = False
        self.previous_num_tokens = 0
        self.restarted = False
        self._fork_table: list[int] | None = None
        self.update(reply)

    def update(self, reply: pb.SequenceReply) -> None:
        """Take the id, lengths and full block table of a daemon reply."""
        self.id = reply.seq_id
        self.num_tokens = reply.num_tokens
        self.cached_tokens = reply.cached_tokens
        self.block_table = unpack_ints(reply.block_table)
        self.num_indexed = reply.num_indexed

    def mark_forked(self) -> None:
        """Remember the table as it is at a fork: its blocks may be shared with siblings."""
        self._fork_table = list(self.block_table)

    def forget_fork(self) -> None:
        """After a daemon restart only committed blocks are shared: drop the fork's table."""
        self._fork_table = None

    def shared_blocks(self) -> int:
        """Leading blocks that may be shared (committed, or still as they were at a fork)."""
        shared = self.num_indexed
        fork = self._fork_table
        if fork:
            same = 0
            for a, b in zip(fork, self.block_table):
                if a != b:
                    break
                same += 1
            shared = max(shared, same)
        return shared

    def check_live(self) -> None:
        """Raises DaemonRestarted once after a recovery changed the handle, then NotFound for
        a lost one; NotFound for a released one (each with what to do)."""
        if self.restarted:
            self.restarted = False
            what = ("nothing of it survived: open the prompt again" if self.lost else
                    f"it kept {self.num_tokens} of its {self.previous_num_tokens} tokens: extend it "
                    f"with the rest and write their KV again")
            raise DaemonRestarted(f"the daemon restarted and sequence {self.id} was reclaimed; {what}", [self])
        if self.released:
            raise NotFound(f"sequence {self.id} was released; open the prompt again")
        if self.lost:
            raise NotFound("this sequence did not survive the daemon's restart (none of its blocks "
                           "were committed); open the prompt again")

    def __len__(self) -> int:
        return self.num_tokens

    def __repr__(self) -> str:
        state = " released" if self.released else " lost" if self.lost else " reclaimed" if self.reclaimed else ""
        return (f"Sequence(id={self.id}, num_tokens={self.num_tokens}, cached_tokens={self.cached_tokens}, "
                f"blocks={len(self.block_table)}, num_indexed={self.num_indexed}{state})")

    def check_invariants(self) -> None:
        assert 0 <= self.num_indexed <= len(self.block_table), self
        assert all(s >= 0 for s in self.block_table), self
