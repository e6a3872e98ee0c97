"""Reconnecting after a daemon restart: the backoff schedule, the Reclaims, applying their reply.

The procedure itself is ``Attachment._recover`` (it owns the session's state); the pieces here are
small and unit-tested on their own (``reclaim_sessions`` only calls the stub it is given).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Iterator

from prefixd.api import prefixd_pb2 as pb
from prefixd.client.handles import Sequence
from prefixd.client.wire import unpack_ints


@dataclasses.dataclass(frozen=True)
class Backoff:
    """Exponential backoff with a bounded total: ``initial_s``, times ``multiplier`` per try, at
    most ``max_s`` per wait, and no try starts after ``total_s``.

    Raises:
        ValueError: on construction, for non-positive values or ``max_s < initial_s``.
    """

    initial_s: float = 0.05
    max_s: float = 1.0
    total_s: float = 60.0
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        if self.initial_s <= 0 or self.total_s <= 0 or self.multiplier < 1 or self.max_s < self.initial_s:
            raise ValueError(f"backoff needs 0 < initial_s <= max_s, total_s > 0, multiplier >= 1; got {self}")

    def waits(self, clock=time.monotonic) -> Iterator[float]:
        """Seconds to wait before each next try; ends when the total would be passed."""
        deadline = clock() + self.total_s
        wait = self.initial_s
        while True:
            left = deadline - clock()
            if left <= 0:
                return
            yield min(wait, left)
            wait = min(self.max_s, wait * self.multiplier)


def reclaim_sessions(stub, session_id: int, previous: list[int], timeout_s: float | None) -> pb.ReclaimReply:
    """Reclaim every session of ``previous`` into ``session_id``, in order; one reply holding
    all their sequences.

    NOTE: more than one session after a Reclaim cut by another restart: the daemon answers a
    Reclaim once its sequences are durable under the new session (keeping their ids), so a
    cut one may have moved them there or not; the next recovery asks both.

    Raises:
        grpc.RpcError: the first Reclaim that failed (the daemon applied those before it:
            their sequences are in ``session_id`` now).
    """
    reply = pb.ReclaimReply()
    for prev in previous:
        got = stub.Reclaim(pb.ReclaimRequest(session_id=session_id, previous_session_id=prev),
                           timeout=timeout_s)
        reply.sequences.extend(got.sequences)
    return reply


def apply_reclaim(live: dict[int, Sequence], reply: pb.ReclaimReply, block_size: int) -> list[Sequence]:
    """Update the live handles in place from a Reclaim reply; returns them (re-keyed in ``live``).

    A handle the reply names with a new id becomes ``reclaimed`` with the surviving tokens and
    blocks (all committed, so ``num_indexed`` covers them); one it names with id 0, or does not
    name at all, becomes ``lost``. Both remember ``previous_num_tokens`` and are marked
    ``restarted`` (the next call naming them raises DaemonRestarted once).
    """
    by_previous = {r.previous_seq_id: r for r in reply.sequences}
    handles = list(live.values())
    live.clear()
    for seq in handles:
        seq.previous_num_tokens = seq.num_tokens
        seq.restarted = True
        seq.forget_fork()  # after a restart only committed blocks are shared
        got = by_previous.get(seq.id)
        if got is None or got.seq_id == 0:
            seq.lost = True
            seq.reclaimed = False
            seq.num_tokens = 0
            seq.block_table = []
            seq.num_indexed = 0
            continue
        seq.id = got.seq_id
        seq.num_tokens = got.num_tokens
        seq.cached_tokens = got.num_tokens
        seq.block_table = unpack_ints(got.block_table)
        seq.num_indexed = got.num_tokens // block_size
        seq.reclaimed = True
        live[seq.id] = seq
    return handles


def unknown_reclaimed(live: dict[int, Sequence], reply: pb.ReclaimReply) -> list[int]:
    """Ids of reclaimed sequences no handle asked for (opened by a call whose reply was lost):
    the session releases them."""
    return [r.seq_id for r in reply.sequences if r.seq_id and r.seq_id not in live]
