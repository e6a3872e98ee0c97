"""Random open / extend / commit / fork / release / evict against a plain model.

The model knows which block-aligned prefixes are indexed (it learns of evictions only from the
cache's BlocksDropped(forgotten=True) events, named by hashes it computes itself), so after every step:
a new sequence's cached tokens equal the model's longest cached prefix; every live sequence's
KV (a deterministic function of its prefix, in a tiny data pool) is intact, so a shared block's
bytes never change and copy-on-write works; and ``check_invariants`` holds (refcounts equal
block-table references, no slot owned twice, free + used = capacity).
"""

import shutil
import tempfile

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from prefixd.cache import OutOfBlocks, PrefixCache
from prefixd.cache import events as ev
from prefixd.cache.hashing import chain_hashes, namespace_hash
from prefixd.cache.node import DISK, HOST
from prefixd.api.tiers import Tier
from prefixd.storage.tier_store import TierStore
from tests.cache.helpers import StoreTokens, TokenPool, tiny_layout, toks, tree_state

BS = 2
NUM_BLOCKS = 24
ROOT = b"\x07" * 16

# Few distinct tokens and short prompts so that prefixes collide often.
token_lists = st.lists(st.integers(0, 2), min_size=1, max_size=9)


class CacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool = TokenPool(NUM_BLOCKS, BS)
        self.cache = PrefixCache(NUM_BLOCKS, BS, root_hash=ROOT, data=self.pool)
        self.live: dict[int, list[int]] = {}  # seq id -> tokens
        self.indexed: dict[bytes, tuple] = {}  # block hash -> block-aligned prefix (model)

    # -- model -------------------------------------------------------------------------

    def _prefix_hashes(self, tokens):
        n = len(tokens) // BS * BS
        return chain_hashes(namespace_hash(ROOT, b""), toks(*tokens[:n]), BS * 4)

    def _absorb_events(self):
        for e in self.cache.drain_events():
            if isinstance(e, ev.BlocksStored):
                for h in e.hashes:
                    self.indexed[h] = True
            elif isinstance(e, ev.BlocksDropped) and e.forgotten:
                for h in e.hashes:
                    del self.indexed[h]

    def _expected_cached(self, tokens):
        limit = (len(tokens) - 1) // BS
        count = 0
        for h in self._prefix_hashes(tokens)[:limit]:
            if h not in self.indexed:
                break
            count += 1
        return count * BS

    # -- rules -------------------------------------------------------------------------

    @rule(tokens=token_lists)
    def open(self, tokens):
        expected = self._expected_cached(tokens)
        on_device = self.cache.lookup(tokens).device_tokens
        before = tree_state(self.cache)
        try:
            seq = self.cache.open(tokens)
        except OutOfBlocks:
            assert tree_state(self.cache) == before, "a refused open changed the cache"
            return
        if on_device >= expected:
            assert seq.cached_tokens == expected, (seq.cached_tokens, expected)
        else:  # a promotion from host or disk may be cut short by a full device
            assert seq.cached_tokens <= expected, (seq.cached_tokens, expected)
        self.pool.check(seq.block_table[: expected // BS], tokens[:expected])
        self.pool.write(seq.block_table, tokens, seq.cached_tokens)
        self.live[seq.id] = list(tokens)
        self._absorb_events()

    @precondition(lambda self: self.live)
    @rule(data=st.data(), more=token_lists)
    def extend(self, data, more):
        seq_id = data.draw(st.sampled_from(sorted(self.live)))
        before = tree_state(self.cache)
        try:
            self.cache.extend(seq_id, more)
        except OutOfBlocks:
            assert tree_state(self.cache) == before, "a refused extend changed the cache"
            return
        old = self.live[seq_id]
        self.live[seq_id] = old + more
        self.pool.write(self.cache.sequence(seq_id).block_table, old + more, len(old))
        self._absorb_events()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def commit(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.live)))
        self.cache.commit(seq_id)
        self._absorb_events()
        hashes = self._prefix_hashes(self.live[seq_id])
        assert all(h in self.indexed for h in hashes), "a committed block is not indexed"

    @precondition(lambda self: self.live)
    @rule(data=st.data(), n=st.integers(1, 3))
    def fork(self, data, n):
        seq_id = data.draw(st.sampled_from(sorted(self.live)))
        for child in self.cache.fork(seq_id, n):
            self.live[child.id] = list(self.live[seq_id])
        self._absorb_events()

    @precondition(lambda self: self.live)
    @rule(data=st.data(), commit=st.booleans())
    def release(self, data, commit):
        seq_id = data.draw(st.sampled_from(sorted(self.live)))
        self.cache.release(seq_id, commit=commit)
        del self.live[seq_id]
        self._absorb_events()

    @rule(n=st.integers(1, 6))
    def evict(self, n):
        self.cache.evict(n)
        self._absorb_events()

    # -- checks after every step ---------------------------------------------------------

    @invariant()
    def consistent(self):
        self.cache.check_invariants()
        for seq_id, tokens in self.live.items():
            seq = self.cache.sequence(seq_id)
            assert bytes(seq.tokens) == toks(*tokens)
            self.pool.check(seq.block_table, tokens)
        assert self.cache.num_sequences == len(self.live)


CacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestCacheMachine = CacheMachine.TestCase


class TieredCacheMachine(CacheMachine):
    """The same machine over three small tiers of a real ``TierStore``, with random evictions
    from every tier and a random write policy: bytes must survive every demotion and
    promotion, and every tier must stay root-anchored."""

    def __init__(self):
        RuleBasedStateMachine.__init__(self)
        self._dir = tempfile.mkdtemp(prefix="prefixd-sm-")
        self.store = TierStore(tiny_layout(BS), {Tier.DEVICE: 10, Tier.HOST: 6, Tier.DISK: 12},
                               state_dir=self._dir, shm_dir=self._dir, name="sm", fresh=True,
                               use_cuda=False)
        self.pool = StoreTokens(self.store, BS)
        self.cache = None
        self.live = {}
        self.indexed = {}

    @initialize(write_policy=st.sampled_from(["write_through", "write_back", "selective"]))
    def setup(self, write_policy):
        self.cache = PrefixCache((10, 6, 12), BS, root_hash=ROOT, data=self.store,
                                 write_policy=write_policy, selective_hits=1)

    @rule(tier=st.sampled_from([HOST, DISK]), n=st.integers(1, 4))
    def evict_lower(self, tier, n):
        self.cache.evict(n, tier)
        self._absorb_events()

    def teardown(self):
        self.store.close()
        shutil.rmtree(self._dir, ignore_errors=True)


TieredCacheMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestTieredCacheMachine = TieredCacheMachine.TestCase
