"""The cluster tier's engine side: fleet-wide block names, the write policy, write-behind and
fetch on a local miss (``ClusterTier``, one per ``DurableCache`` with ``[engine.cluster]``).

Fleet names. A pool names its blocks by hashes chained from a root made of the state
directory's random root seed (``prefixd.cache.hashing.root_hash``), so two hosts name the same
prefix differently. The cluster needs one name per prefix across the fleet, so this tier chains
a second hash from ``fleet_root``: ``FLEET_SEED`` where the root seed goes, then the tenant salt
and the layout digest (the same on every host of a fleet, from config), then ``extra`` as the
local chain does. Fleet hashes are computed only here: at write-behind and on a local miss.

Write-behind. After a commit (policy ``all``, or ``power`` for commits at ``power``) or an
open (``hits>=N``, once a run's hit count reaches N), the selected blocks' KV bytes are copied
out of the device pool on the engine thread and offered to ``ClusterWriter`` (bounded: a full
queue drops them and counts). NOTE: the copy is made at once, on the engine thread, because
it is the one moment the bytes are certainly where the index says: a device slot may be
evicted and reused right after the call returns, and a host or disk slot once its drop is
durable; reading them later from another thread would race with that reuse. A memcpy of the
committed blocks (the host write-through already makes one) is the price.

Fetch. ``promote`` runs first in every ``open``: if the prompt has full blocks past the local
match (at most ``len - 1`` tokens are served, as ``open`` does), it asks the cluster for the
run after the match in one ``get_run`` (bounded by the store's timeout), and indexes what came
back exactly as a local commit of those blocks would: a short-lived sequence of the prompt up
to the end of the run is opened (sharing the local match, allocating device slots with the
usual allocate-evict-retry), the fetched KV is copied into its private slots, and it is
committed and released. The records (open, block stored, commit, release) are those of any
commit; the caller's own ``open`` that follows then hits them. Any failure of the cluster
(down, slow, a value that does not verify) is fewer cached tokens, never an error.

NOTE: the helper's commit indexes the run at the device alone (``write_back`` for its
duration); ``tick`` (the daemon's loop, through ``DurableCache.tick``) then hands the promoted
runs to the pool's write policy (``write_through``: host now, disk with the next spill). The
blocks are safe in the cluster meanwhile, and the write-through inside ``open`` was most of a
promotion's time. A crash before the tick forgets them locally (device residency does not
survive recovery): the next ``open`` fetches them again. A client's own commit on top writes
the whole path down itself (``WriteOrder.make_durable``).

NOTE: the short-lived sequence is bookkeeping, not a client's request, so ``promote`` takes
its ``open`` and ``commit`` back out of the cache's counters (opens, requested and hit tokens,
committed blocks) and undoes the hit it added to the matched runs' ``hit_count`` (an eviction
key and the ``hits>=N`` trigger); promotions from lower tiers that it made stay counted, as
the caller's open would have made them. Remote hits are counted here (``stats``).

NOTE: the fetch is synchronous inside ``open`` (the daemon's loop waits for it, at most the
store's ``timeout_ms`` per batch, and not at all for a node marked down): an asynchronous
fetch would need a two-step Open in the API. A miss in the cluster costs one round trip per
open that has uncached full blocks.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import numpy as np
import torch

from prefixd.api.layout import as_token_bytes
from prefixd.api.tiers import Tier
from prefixd.cache.errors import OutOfBlocks
from prefixd.cache.hashing import chain_hashes, namespace_hash, root_hash
from prefixd.cache.node import DEVICE, attached, path_to
from prefixd.engine.cluster_writer import ClusterWriter
from prefixd.storage.cluster import ClusterBlock, ClusterStore  # imports redis: see durable.py

log = logging.getLogger(__name__)

FLEET_SEED = b"prefixd-fleet-v1"  # stands where a state directory's random root seed goes
SENT_LIMIT = 1 << 20  # local hashes remembered as sent (``hits>=N``); cleared when full
PENDING_LIMIT = 4096  # promoted runs waiting for ``tick``; the oldest half goes when full
_UNDONE_STATS = ("opens", "requested_tokens", "requested_blocks", "hit_tokens", "committed_blocks")


def fleet_root(tenant_salt: bytes, layout_digest: bytes) -> bytes:
    """The root of a (tenant, layout) namespace's fleet-wide chain: no per-directory seed."""
    return root_hash(FLEET_SEED, tenant_salt, layout_digest)


def cluster_namespace(tenant_salt: bytes, layout_digest: bytes) -> bytes:
    """The key prefix of a (tenant, layout) pool in the cluster: 16 bytes of a keyed digest of
    the salt and the layout, so tenants and models never meet and the salt is not in the keys."""
    h = hashlib.blake2b(digest_size=16, person=b"prefixd-cluster")
    h.update(len(tenant_salt).to_bytes(4, "little") + tenant_salt + layout_digest)
    return h.digest()


@contextlib.contextmanager
def _device_only(tiering):
    """Index a commit at the device alone: ``write_back`` for its duration (``tiering`` None: a
    device-only cache, nothing to write down)."""
    if tiering is None or tiering.write_policy == "write_back":
        yield
        return
    policy = tiering.write_policy
    tiering.write_policy = "write_back"
    try:
        yield
    finally:
        tiering.write_policy = policy


def connect(config, namespace: bytes) -> ClusterStore:
    """The ``ClusterStore`` of ``config`` under ``namespace``."""
    return ClusterStore(config.nodes, namespace, timeout_s=config.timeout_ms / 1000.0,
                       connect_timeout_s=config.connect_timeout_ms / 1000.0,
                       retry_after_s=config.retry_after_s)


class ClusterTier:
    """One pool's link to the cluster: policy, write-behind, fetch and promotion.

    Args:
        cache: the pool's ``PrefixCache``.
        tiers: the pool's ``TierStore`` (the device pool's bytes are read and written here).
        layout: the pool's ``KVLayout``.
        tenant_salt: the pool's tenant salt (the same on every host for a tenant).
        config: ``ClusterConfig``.
        remote: the store to use (default: ``connect(config, namespace)``); tests pass theirs.

    Invariants: a block is offered to the writer with its fleet hash, its parent's fleet hash
    and its own token ids, and KV bytes copied from the device slot the index named at that
    moment; promoted blocks are never offered back (they are in ``_sent``); every counter
    only grows.
    """

    def __init__(self, cache, tiers, layout, tenant_salt: bytes, config, remote=None) -> None:
        self.cache = cache
        self.tiers = tiers
        self.layout = layout
        self.config = config
        self.min_hits = config.min_hits
        digest = layout.digest()
        self.root = fleet_root(tenant_salt, digest)
        self.namespace = cluster_namespace(tenant_salt, digest)
        self.remote = remote if remote is not None else connect(config, self.namespace)
        self.block_bytes = layout.block_bytes
        self.writer = ClusterWriter(self.remote, batch_blocks=config.batch_blocks,
                                    queue_bytes=int(config.queue_mib * (1 << 20)))
        self._sent: dict[bytes, None] = {}  # local hashes already offered (``hits>=N``)
        self.fetches = 0          # opens that asked the cluster
        self.fetch_errors = 0     # get_run raised
        self.remote_hit_blocks = 0
        self.remote_hit_tokens = 0
        self.bad_blocks = 0       # returned blocks this side refused (wrong hash, tokens, size)
        self.promote_refused = 0  # a run found but no device room (or a local block cut)
        self._promoted: list = []  # runs indexed at the device alone, for ``tick`` to write down

    # -- fleet names ---------------------------------------------------------------------------

    def fleet_hashes(self, tokens: bytes, extra: bytes, num_blocks: int) -> list[bytes]:
        """The fleet hashes of the first ``num_blocks`` full blocks of packed ``tokens``."""
        bb = self.cache.block_bytes
        return chain_hashes(namespace_hash(self.root, extra), bytes(tokens[:num_blocks * bb]), bb)

    # -- the engine's calls ----------------------------------------------------------------------

    def open(self, tokens, extra: bytes = b""):
        """``PrefixCache.open`` with the cluster: promote the run past the local match first,
        and offer what the open's hits selected (``hits>=N``)."""
        self.promote(tokens, extra)
        seq = self.cache.open(tokens, extra)
        self.after_open(seq)
        return seq

    def fork(self, seq_id: int, num_children: int):
        """``PrefixCache.fork``, offering the parent's blocks the fork indexed."""
        indexed = self.cache.sequence(seq_id).num_indexed
        children = self.cache.fork(seq_id, num_children)
        seq = self.cache.sequence(seq_id)
        self.after_commit(seq, "index", seq.num_indexed - indexed)
        return children

    # -- write-behind --------------------------------------------------------------------------

    def after_commit(self, seq, durability: str, added: int) -> None:
        """Offer the ``added`` blocks a commit of ``seq`` just indexed, when the policy takes
        them. They end the sequence's indexed prefix, in its own device slots.

        NOTE: counted by the commit's return value, not found among the cache's pending
        ``BlocksStored`` events: a commit whose write-through ran short of quarantined slots
        logs (drains) the events inside the commit (``Upkeep.force_release``)."""
        if not added or self.min_hits or (self.config.write_policy == "power"
                                          and durability != "power"):
            return
        end = seq.num_indexed
        self._offer(seq.tokens, seq.extra, end - added, end, seq.block_table[end - added:end])

    def after_open(self, seq) -> None:
        """``hits>=N``: offer the runs of the match whose hit count reached N, once each."""
        if not self.min_hits or not seq.num_indexed:
            return
        start = 0
        first = None
        for node in path_to(seq.node):
            if node.hit_count >= self.min_hits and node.hashes[-1] not in self._sent:
                if first is None:
                    first = start
                for h in node.hashes:
                    self._remember(h)
            elif first is not None:
                break  # offer one contiguous stretch per open; the rest comes at the next hit
            start += node.num_blocks
        if first is not None:
            self._offer(seq.tokens, seq.extra, first, start, seq.block_table[first:start])

    def _offer(self, tokens, extra: bytes, first: int, end: int, slots) -> None:
        """Copy blocks ``first .. end`` of a sequence (at device ``slots``) into the queue."""
        bb, nbytes = self.cache.block_bytes, self.block_bytes
        if not self.writer.fits(nbytes * (end - first)):
            self.writer.refuse(end - first)  # dropped before any copy
            return
        hashes = self.fleet_hashes(tokens, extra, end)
        parent = namespace_hash(self.root, extra)
        kv = self._read(slots)
        out = []
        for i in range(first, end):
            out.append(ClusterBlock(hashes[i], hashes[i - 1] if i else parent,
                                   bytes(tokens[i * bb:(i + 1) * bb]), kv[i - first]))
        self.writer.offer(out)

    def _remember(self, local_hash: bytes) -> None:
        if len(self._sent) >= SENT_LIMIT:
            self._sent.clear()  # a block offered twice is written twice: harmless
        self._sent[local_hash] = None

    # -- fetch ---------------------------------------------------------------------------------

    def promote(self, tokens, extra: bytes) -> int:
        """Before ``open(tokens, extra)``: fetch the run after the local match from the cluster
        and index it; returns the blocks promoted (0 on any miss or failure; tokens that are
        not valid are left for ``open`` to refuse)."""
        cache = self.cache
        if type(tokens) is not bytes:
            try:
                tokens = as_token_bytes(tokens)
            except (ValueError, TypeError):
                return 0
        bs, bb = cache.block_size, cache.block_bytes
        servable = ((len(tokens) >> 2) - 1) // bs if not len(tokens) & 3 else 0
        if servable < 1:
            return 0
        local = cache.lookup(tokens, extra)
        have = (local.cached_tokens + local.unverified_tokens) // bs
        if have >= servable:
            return 0
        hashes = self.fleet_hashes(tokens, extra, servable)
        want = hashes[have:servable]
        token_ids = [bytes(tokens[i * bb:(i + 1) * bb]) for i in range(have, servable)]
        self.fetches += 1
        try:
            run = self.remote.get_run(want, token_ids)
        except Exception as exc:  # noqa: BLE001 - the cluster failing is a miss, never an error
            self.fetch_errors += 1
            log.warning("cluster fetch failed blocks=%d error=%r", len(want), exc)
            return 0
        run = self._verified(run, want, token_ids)
        if not run:
            return 0
        return self._index(tokens, extra, have, run)

    def _verified(self, run, want, token_ids) -> list:
        """The leading blocks of ``run`` that are what was asked for (the store verified them;
        this is the engine's own check of what it is about to index)."""
        good = []
        for block, h, toks in zip(run, want, token_ids):
            if block.block_hash != h or block.token_ids != toks or len(block.kv) != self.block_bytes:
                self.bad_blocks += 1
                log.warning("cluster returned a block that does not match the request; not served")
                break
            good.append(block)
        return good

    def _index(self, tokens: bytes, extra: bytes, have: int, run: list) -> int:
        """Index ``run`` after the ``have`` locally matched blocks (see the module docstring)."""
        cache = self.cache
        bs, bb = cache.block_size, cache.block_bytes
        r = len(run)
        stats = cache.stats
        saved = [getattr(stats, name) for name in _UNDONE_STATS]
        try:
            seq = cache.open(bytes(tokens[:(have + r) * bb]), extra, full_match=True)
        except OutOfBlocks:
            self.promote_refused += 1
            return 0
        for node in path_to(seq.node):  # the helper's hit on the match is not a request's
            node.hit_count -= 1  # marked for a picture by the open's touch
        try:
            if seq.num_indexed != have:  # a local disk block failed its checksum: cut there
                self.promote_refused += 1
                return 0
            self._write(seq.block_table[have:have + r], [b.kv for b in run])
            with _device_only(cache.tiering):  # written down when evicted (see the NOTE)
                cache.commit(seq.id)
            at = 0
            for node in path_to(seq.node):
                if at >= have:  # from the cluster: never offered back (``hits>=N``)
                    for h in node.hashes:
                        self._remember(h)
                    self._write_later(node)
                at += node.num_blocks
        finally:
            cache.release(seq.id)
            for name, value in zip(_UNDONE_STATS, saved):
                setattr(stats, name, value)
        self.remote_hit_blocks += r
        self.remote_hit_tokens += r * bs
        return r

    def _write_later(self, node) -> None:
        if len(self._promoted) >= PENDING_LIMIT:  # no tick for a long while: eviction demotes them
            del self._promoted[:PENDING_LIMIT // 2]
        self._promoted.append(node)

    def tick(self) -> int:
        """Write promoted runs down by the pool's write policy (``write_through``: to host now,
        to disk with the next spill), off the ``open`` that promoted them; the daemon's loop
        calls it through ``DurableCache.tick``. Returns the runs handed to the policy."""
        pending, self._promoted = self._promoted, []
        tiering = self.cache.tiering
        if tiering is None:
            return 0
        done = 0
        for node in pending:
            if attached(node) and node.slots[DEVICE] is not None:
                tiering.write_through(node)  # copies ancestors missing below too; a no-op
                done += 1                    # under write_back and selective
        return done

    # -- device bytes --------------------------------------------------------------------------

    def _read(self, slots) -> list[bytes]:
        raw = self.tiers.pool(Tier.DEVICE).raw
        if raw.is_cuda:
            rows = raw[torch.tensor(list(slots), device=raw.device)].cpu().numpy()
            return [row.tobytes() for row in rows]
        rows = raw.numpy()
        return [rows[s].tobytes() for s in slots]

    def _write(self, slots, kvs: list[bytes]) -> None:
        raw = self.tiers.pool(Tier.DEVICE).raw
        if raw.is_cuda:
            src = torch.from_numpy(np.frombuffer(b"".join(kvs), np.uint8).reshape(len(kvs), -1).copy())
            raw[torch.tensor(list(slots), device=raw.device)] = src.to(raw.device)
            return
        rows = raw.numpy()
        for s, kv in zip(slots, kvs):
            rows[s] = np.frombuffer(kv, np.uint8)

    # -- the rest ------------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Counters for the daemon's Stats and metrics, all monotonic.

        ``fetches`` opens that asked the cluster; ``fetch_errors`` asks that raised;
        ``remote_hit_blocks`` / ``remote_hit_tokens`` promoted from the cluster (also part of
        the cache's ``hit_tokens``); ``bad_blocks`` returned blocks this side refused;
        ``promote_refused`` runs found but not indexed (no device room, a local block cut);
        ``offered_blocks`` / ``dropped_blocks`` / ``written_blocks`` / ``write_errors`` the
        write-behind (``ClusterWriter``); ``remote_<name>`` the store's own
        (``ClusterStore.stats``: hits, misses, corrupt, timeouts, skipped_down, ...)."""
        w = self.writer
        out = {"fetches": self.fetches, "fetch_errors": self.fetch_errors,
               "remote_hit_blocks": self.remote_hit_blocks,
               "remote_hit_tokens": self.remote_hit_tokens, "bad_blocks": self.bad_blocks,
               "promote_refused": self.promote_refused, "offered_blocks": w.offered_blocks,
               "dropped_blocks": w.dropped_blocks, "written_blocks": w.written_blocks,
               "write_errors": w.write_errors}
        try:
            remote = self.remote.stats()
        except Exception:  # noqa: BLE001 - counters must never fail a Stats call
            remote = {}
        out.update({f"remote_{k}": v for k, v in remote.items()})
        return out

    def drain(self, timeout_s: float = 10.0) -> bool:
        """Wait until the write-behind queue is written (tests, benchmarks)."""
        return self.writer.drain(timeout_s)

    def close(self) -> None:
        try:
            self.writer.close()
        finally:
            self.remote.close()

    def check_invariants(self) -> None:
        self.writer.check_invariants()
        assert len(self._sent) <= SENT_LIMIT
        assert len(self._promoted) <= PENDING_LIMIT
