"""KV events for routers: ``KVEvent`` and the ``SubscribeEvents`` stream as a Python iterator.

A router keeps, per daemon and tenant, which blocks (by chained hash, per pool) are resident
in which tier. It applies ``stored`` / ``removed`` events in order; on ``cleared`` it forgets
everything that daemon's tenant told it before (the daemon restarted, or the events after the
number it asked from are no longer kept) and goes on with the events that follow. To resume
after the stream ends (RESOURCE_EXHAUSTED: it read too slowly; UNAVAILABLE: the daemon
stopped), subscribe again with the last event's ``sequence_number`` and ``epoch``: nothing is
missed and nothing repeated, or the stream begins with ``cleared``.

    last = None
    for event in session.subscribe_events():          # or kv_events.subscribe(stub, 0, ...)
        router.apply(event)
        last = event
    # ... on ResourceExhausted / Unavailable:
    session.subscribe_events(last.sequence_number, epoch=last.epoch)
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Iterator

import grpc

from prefixd.api import prefixd_pb2 as pb
from prefixd.client.errors import from_rpc_error

KINDS = ("stored", "removed", "cleared")


@dataclasses.dataclass(frozen=True)
class KVEvent:
    """One event: a run of blocks ``kind`` (stored / removed) in ``tier`` of the pool of
    ``model_id``; ``cleared`` carries no blocks. ``parent_block_hash`` and ``token_ids`` come
    with the blocks stored on the device at their commit (as vLLM's ``BlockStored``)."""

    sequence_number: int
    epoch: int
    kind: str
    tier: str = ""
    block_hashes: tuple[bytes, ...] = ()
    model_id: str = ""
    block_size: int = 0
    parent_block_hash: bytes = b""
    token_ids: tuple[int, ...] = ()

    @classmethod
    def from_message(cls, msg: pb.KVEvent) -> "KVEvent":
        return cls(msg.sequence_number, msg.epoch, msg.kind, msg.tier, tuple(msg.block_hashes),
                   msg.model_id, msg.block_size, msg.parent_block_hash,
                   _token_ids(msg.tokens))

    def to_json(self) -> dict:
        """A JSON-ready dict (hashes in hex)."""
        doc = {"sequence_number": self.sequence_number, "epoch": self.epoch, "kind": self.kind}
        if self.kind != "cleared":
            doc.update(tier=self.tier, model_id=self.model_id, block_size=self.block_size,
                       block_hashes=[h.hex() for h in self.block_hashes])
        if self.parent_block_hash:
            doc["parent_block_hash"] = self.parent_block_hash.hex()
        if self.token_ids:
            doc["token_ids"] = list(self.token_ids)
        return doc

    def __str__(self) -> str:
        if self.kind == "cleared":
            return f"#{self.sequence_number} cleared (forget this tenant's earlier events)"
        hashes = " ".join(h.hex() for h in self.block_hashes)
        return (f"#{self.sequence_number} {self.kind} {self.tier} model={self.model_id} "
                f"blocks={len(self.block_hashes)} {hashes}")


def _token_ids(raw: bytes) -> tuple[int, ...]:
    # NOTE: struct, not ``wire.unpack_ints``: prefixctl imports this module and must not
    # import torch (``wire`` does)
    return struct.unpack(f"<{len(raw) // 4}i", raw[:len(raw) & ~3]) if raw else ()


def subscribe(stub, session_id: int = 0, from_sequence_number: int = 0, epoch: int = 0, *,
              timeout: float | None = None) -> Iterator[KVEvent]:
    """The events of ``stub``'s socket's tenant after ``from_sequence_number`` of ``epoch``
    (0, 0: everything the daemon still holds), then live, until the stream ends.

    Raises (when the stream ends): ResourceExhausted (too slow: resume), Unavailable (the
    daemon stopped: resume once it is back), NotFound (``session_id`` ended). Leaving the
    loop early cancels the stream.
    """
    if from_sequence_number < 0 or epoch < 0:
        raise ValueError(f"from_sequence_number and epoch must be >= 0, got "
                         f"{from_sequence_number}, {epoch}")
    call = stub.SubscribeEvents(pb.SubscribeEventsRequest(
        session_id=session_id, from_sequence_number=from_sequence_number, epoch=epoch),
        timeout=timeout)
    return _events(call)  # the stream starts now, not at the first ``next``


def _events(call) -> Iterator[KVEvent]:
    try:
        for msg in call:
            yield KVEvent.from_message(msg)
    except grpc.RpcError as exc:
        raise from_rpc_error(exc) from None
    finally:
        call.cancel()
