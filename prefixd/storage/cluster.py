"""The cluster tier's client: content-addressed, immutable blocks in a Redis Cluster.

``ClusterStore`` is the storage half of the cluster tier; the engine owns the policy (what to
write behind, when to ask, where to promote). Every failure of the cluster is a miss or a skipped
write, never an exception and never a stall past the timeouts: see ``cluster_nodes`` for routing
and node health, ``cluster_value`` for the key and value format and the checks on read.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Sequence

from redis.crc import key_slot
from redis.exceptions import MovedError, OutOfMemoryError, ResponseError

from prefixd.storage.cluster_nodes import ClusterLinks, NodeFailure
from prefixd.storage.cluster_value import (HASH_BYTES, ClusterBlock, Verdict, check_block, decode,
                                          encode, key_of, namespace_digest)

__all__ = ["ClusterBlock", "ClusterStore", "STAT_NAMES"]

log = logging.getLogger(__name__)

STAT_NAMES = ("hits", "misses", "corrupt", "mismatch", "errors", "timeouts", "written",
              "skipped_down", "oom")


class ClusterStore:
    """Content-addressed, immutable blocks in a Redis Cluster under one namespace.

    Counters (``stats()``), all monotonic:
        hits / misses: blocks returned by ``get_run`` / blocks asked for and not returned.
        corrupt: values that failed a check (format, checksum, stored hash, parent chain);
            mismatch: intact values holding other token ids than asked. Both are deleted and
            never returned.
        errors / timeouts: node batches that failed / went silent past ``timeout_s``, and error
            replies other than OOM (e.g. MOVED during a reshard).
        written: blocks stored by ``put``; oom: blocks refused by a node at ``maxmemory`` (a
            cluster on ``noeviction``); skipped_down: blocks not sent, or not asked for, because
            their node (or the whole cluster) was in an outage.

    Invariants: every counter >= 0; a value is returned by ``get_run`` only if every check in
    ``cluster_value.decode`` held for it and for every block before it in the run.

    NOTE: ``get_run`` asks for every block up to the first one on a node that is down, in one
    pipelined batch per node with all nodes in flight at once, and cuts the run afterwards. Asking
    block by block would cost a round trip per block; asking in waves would save bytes only when
    the cluster holds a short run, which the engine's own index usually already predicts.

    NOTE: a token mismatch deletes the value too (a mismatch is never served, it is counted
    and the value is deleted). With 128-bit chained hashes a real collision is not
    expected, so a mismatch means a writer bug; deleting costs at most a rewrite by the owner.

    Thread-safe: ``put`` and ``get_run`` may run at once on different threads (each thread has
    its own connections); ``close`` is called once, after the callers stop.
    """

    def __init__(self, nodes: Sequence[str], namespace: bytes, *, timeout_s: float = 0.005,
                 connect_timeout_s: float = 0.05, retry_after_s: float = 1.0) -> None:
        if not namespace:
            raise ValueError("namespace must be non-empty bytes (the pool's tenant salt and layout)")
        if timeout_s <= 0 or connect_timeout_s <= 0 or retry_after_s < 0:
            raise ValueError("timeouts must be > 0 and retry_after_s >= 0")
        self._links = ClusterLinks(nodes, timeout_s=timeout_s, connect_timeout_s=connect_timeout_s,
                                   retry_after_s=retry_after_s)
        self._ns_hex = namespace_digest(bytes(namespace)).hex().encode()
        self._lock = threading.Lock()
        self._stats = dict.fromkeys(STAT_NAMES, 0)
        self._oom_nodes: set[str] = set()

    def key(self, block_hash: bytes) -> bytes:
        """The Redis key of ``block_hash`` in this store's namespace."""
        return key_of(self._ns_hex, block_hash)

    # -- writes -------------------------------------------------------------------------------

    def put(self, blocks: Sequence[ClusterBlock]) -> int:
        """Store ``blocks`` (pipelined, one batch per node); returns how many were written.

        A block on a node that is down, refused for memory or lost with its node's batch is
        skipped and counted; the caller may offer it again later (values are immutable, so a
        rewrite is harmless).

        Raises:
            ValueError: a block with hashes not of 16 bytes or token ids not packed int32.
        """
        for block in blocks:
            check_block(block)
        if not blocks or self._links.closed:
            return 0
        keys = [self.key(b.block_hash) for b in blocks]
        deadline = self._links.batch_deadline("put")  # the slot map's reload and the writes
        owners = self._links.nodes_of(keys, deadline)
        if owners is None:
            self._count(skipped_down=len(blocks))
            return 0
        groups: dict[str, list[tuple]] = {}
        skipped = 0
        now = time.monotonic()
        for key, owner, block in zip(keys, owners, blocks):
            if not owner or self._links.is_down(owner, now):
                skipped += 1
                continue
            groups.setdefault(owner, []).append(("SET", key, encode(block)))
        written = errors = timeouts = oom = 0
        for node, replies in self._links.pipeline(groups, "put", deadline).items():
            if isinstance(replies, NodeFailure):
                self._links.mark_down(node, replies.cause)
                timeouts += replies.timeout
                errors += not replies.timeout
                continue
            node_ok = node_oom = 0
            for reply in replies:
                if isinstance(reply, OutOfMemoryError) or (
                        isinstance(reply, ResponseError) and str(reply).startswith("OOM")):
                    node_oom += 1
                elif isinstance(reply, ResponseError):
                    errors += 1
                else:
                    node_ok += 1
            self._links.mark_up(node)
            self._note_oom(node, node_oom, node_ok)
            written += node_ok
            oom += node_oom
        self._count(written=written, skipped_down=skipped, errors=errors, timeouts=timeouts, oom=oom)
        return written

    def _note_oom(self, node: str, refused: int, stored: int) -> None:
        """One log line when a node starts refusing writes for memory, one when it stores again."""
        if refused and node not in self._oom_nodes:
            self._oom_nodes.add(node)
            log.warning("cluster node out of memory node=%s: writes to it are skipped; set "
                        "maxmemory-policy allkeys-lru so Redis evicts instead", node)
        elif stored and not refused and node in self._oom_nodes:
            self._oom_nodes.discard(node)
            log.warning("cluster node stores again node=%s", node)

    # -- reads --------------------------------------------------------------------------------

    def get_run(self, hashes: Sequence[bytes], token_ids: Sequence[bytes]) -> list[ClusterBlock]:
        """The longest leading run of ``hashes`` the cluster holds intact, with the asked tokens.

        Args:
            hashes: chained block hashes of consecutive blocks of one prefix (16 bytes each).
            token_ids: the packed int32 token ids each block must hold.

        Returns:
            ``ClusterBlock`` for blocks 0..k-1 (k may be 0): each value present, its checksum
            good, its stored hash the asked one, its parent the previous hash, its tokens the
            asked ones. A value that fails a check is deleted and ends the run.

        Raises:
            ValueError: lengths differ, or a hash is not 16 bytes (caller bugs only).
        """
        if len(hashes) != len(token_ids):
            raise ValueError(f"{len(hashes)} hashes but {len(token_ids)} token id blocks")
        for h in hashes:
            if len(h) != HASH_BYTES:
                raise ValueError(f"block hashes must be {HASH_BYTES} bytes, got {len(h)}")
        if not hashes or self._links.closed:
            return []
        keys = [self.key(h) for h in hashes]
        # one deadline for the fetch: the slot map's reload (if due) and every node's reads
        deadline = self._links.batch_deadline("get")
        owners = self._links.nodes_of(keys, deadline)
        if owners is None:
            self._count(misses=len(hashes), skipped_down=len(hashes))
            return []
        now = time.monotonic()
        limit = next((i for i, o in enumerate(owners) if not o or self._links.is_down(o, now)),
                     len(keys))
        values, errors, timeouts = self._fetch(keys[:limit], owners[:limit], deadline)
        run: list[ClusterBlock] = []
        parent = None
        bad = None
        for i, value in enumerate(values):
            if value is None:
                break
            verdict, block = decode(value, hashes[i], parent, token_ids[i])
            if verdict is not Verdict.OK:
                bad = (i, verdict)
                break
            run.append(block)
            parent = hashes[i]
        corrupt = mismatch = 0
        if bad is not None:
            i, verdict = bad
            corrupt, mismatch = verdict is Verdict.CORRUPT, verdict is Verdict.MISMATCH
            log.warning("cluster value failed its check, deleted verdict=%s key=%s node=%s",
                        verdict.value, keys[i].decode(), owners[i])
            self._links.pipeline({owners[i]: [("DEL", keys[i])]}, "get")
        self._count(hits=len(run), misses=len(hashes) - len(run), skipped_down=len(keys) - limit,
                    errors=errors, timeouts=timeouts, corrupt=int(corrupt), mismatch=int(mismatch))
        return run

    def _fetch(self, keys: list[bytes], owners: list[str],
               deadline: float) -> tuple[list[bytes | None], int, int]:
        """Values of ``keys`` (None where absent or lost): one MGET per hash slot, all nodes at
        once, every node's reply by ``deadline``."""
        values: list[bytes | None] = [None] * len(keys)
        if not keys:
            return values, 0, 0
        by_slot: dict[tuple[str, int], list[int]] = {}
        for i, (key, owner) in enumerate(zip(keys, owners)):
            by_slot.setdefault((owner, key_slot(key)), []).append(i)
        groups: dict[str, list[tuple]] = {}
        positions: dict[str, list[list[int]]] = {}
        for (owner, _), idx in by_slot.items():
            groups.setdefault(owner, []).append(("MGET", *(keys[i] for i in idx)))
            positions.setdefault(owner, []).append(idx)
        errors = timeouts = 0
        for node, replies in self._links.pipeline(groups, "get", deadline).items():
            if isinstance(replies, NodeFailure):
                self._links.mark_down(node, replies.cause)
                timeouts += replies.timeout
                errors += not replies.timeout
                continue
            self._links.mark_up(node)
            for idx, reply in zip(positions[node], replies):
                if isinstance(reply, ResponseError):
                    errors += 1
                    if isinstance(reply, MovedError):
                        self._links.mark_stale()
                    continue
                for i, value in zip(idx, reply):
                    values[i] = value
        return values, errors, timeouts

    # -- the rest -----------------------------------------------------------------------------

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, n in deltas.items():
                self._stats[name] += n

    def stats(self) -> dict[str, int]:
        """A copy of the counters (``STAT_NAMES``)."""
        with self._lock:
            return dict(self._stats)

    def close(self) -> None:
        """Close every connection; later calls answer misses and skip writes."""
        self._links.close()

    def check_invariants(self) -> None:
        with self._lock:
            assert set(self._stats) == set(STAT_NAMES), f"unknown counters {set(self._stats)}"
            assert all(v >= 0 for v in self._stats.values()), f"negative counter {self._stats}"
        self._links.check_invariants()
