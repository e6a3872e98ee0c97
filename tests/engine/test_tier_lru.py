"""One LRU across the pools of a tier (``prefixd.engine.tier_lru``): which pool gives room when
a tier's byte budget is full, on pools that hold their blocks as sorted eviction keys and
charge the ledger per block; and that the keys of real pools compare across pools."""

import pytest

from prefixd.api.layout import KVLayout
from prefixd.config import EngineConfig, Tenant, TierSizes
from prefixd.engine import Engine
from prefixd.engine.tier_lru import TierLRU
from prefixd.storage.budget_ledger import BudgetLedger

HOST = 1
MiB = 1 << 20


class Pool:
    """A pool of ``block_bytes`` blocks, one run each, with eviction keys ``keys``, each block
    charged; settling gives back the bytes of what it evicted."""

    def __init__(self, ledger, tenant, block_bytes, keys):
        self.ledger, self.tenant, self.block_bytes = ledger, tenant, block_bytes
        self.keys = sorted(keys)
        self.evicted = []  # keys evicted, in order
        self.unsettled = 0
        ledger.charge(tenant, block_bytes * len(self.keys))

    def coldest_key(self, tier):
        return self.keys[0] if self.keys else None

    def evict_coldest(self, tier, limit, max_blocks):
        n = 0
        while self.keys and n < max_blocks and (not n or limit is None or self.keys[0] <= limit):
            self.evicted.append(self.keys.pop(0))
            n += 1
        self.unsettled += n
        return n

    def settle(self, tier):
        nbytes, self.unsettled = self.unsettled * self.block_bytes, 0
        self.ledger.release(self.tenant, nbytes)
        return nbytes

    def is_empty(self):
        return not self.keys

    def fixed(self, tier):
        return False


def lru(ledger, pools):
    return TierLRU({"device": ledger, "host": ledger, "disk": ledger}, lambda: pools.items())


def test_the_coldest_blocks_of_any_pool_go_first_charged_in_bytes():
    """Blocks go in one LRU order across pools; the shortfall is counted in bytes, so the
    4 MiB blocks of one pool pay for two of the 2 MiB blocks asked."""
    ledger = BudgetLedger("host", 64 * MiB)
    big = Pool(ledger, "t", 4 * MiB, [10, 12, 14, 16, 30, 31, 32, 33])  # 32 MiB
    small = Pool(ledger, "t", 1 * MiB, [11, 13] + list(range(40, 70)))  # 32 MiB: the budget is full
    asker = Pool(ledger, "t", 2 * MiB, [])
    pools = {"big": big, "small": small, "asker": asker}
    assert lru(ledger, pools).make_room("asker", HOST, 3)  # 6 MiB
    assert big.evicted == [10, 12] and small.evicted == [11]  # 4 + 1 + 4 MiB, oldest first
    assert ledger.can_charge("t", 6 * MiB)


def test_a_round_that_frees_too_little_evicts_more_in_the_next():
    """Evicted blocks give bytes back only when their extent empties: here only a quarter of
    what a pool evicts comes back, so rounds double until the charge fits."""
    ledger = BudgetLedger("host", 16 * MiB)

    class Fragmented(Pool):
        def settle(self, tier):
            nbytes = self.unsettled * self.block_bytes // 4
            self.unsettled = 0
            self.ledger.release(self.tenant, nbytes)
            return nbytes

    other = Fragmented(ledger, "t", 1 * MiB, range(16))
    asker = Pool(ledger, "t", 1 * MiB, [])
    table = lru(ledger, {"other": other, "asker": asker})
    assert table.make_room("asker", HOST, 2)
    assert len(other.evicted) >= 8 and table.cross_pool[HOST] >= 2


def test_the_asking_pool_evicts_its_own_when_its_blocks_are_the_coldest():
    ledger = BudgetLedger("host", 8 * MiB)
    asker = Pool(ledger, "t", 1 * MiB, [1, 2, 3, 4])
    other = Pool(ledger, "t", 1 * MiB, [5, 6, 7, 8])
    assert lru(ledger, {"a": asker, "o": other}).make_room("a", HOST, 2)
    assert asker.evicted == [1, 2] and not other.evicted
    assert asker.unsettled == 2  # mid-operation: its own log step records them


def test_a_tenant_at_its_max_evicts_its_own_blocks_even_when_others_are_colder():
    ledger = BudgetLedger("host", 16 * MiB, tenants=[("a", 4 * MiB, 0)])
    mine = Pool(ledger, "a", 1 * MiB, [50, 51, 52, 53])  # at its max of 4 MiB
    theirs = Pool(ledger, "b", 1 * MiB, [1, 2, 3])  # colder, but not a's to take
    asker = Pool(ledger, "a", 1 * MiB, [])
    pools = {"mine": mine, "theirs": theirs, "asker": asker}
    assert lru(ledger, pools).make_room("asker", HOST, 1)
    assert mine.evicted == [50] and not theirs.evicted


def test_reserved_bytes_of_another_tenant_are_never_evicted():
    ledger = BudgetLedger("host", 8 * MiB, tenants=[("a", None, 4 * MiB)])
    reserved = Pool(ledger, "a", 1 * MiB, [1, 2, 3, 4])  # exactly its reservation, the coldest
    b = Pool(ledger, "b", 1 * MiB, [10, 11, 12, 13])
    asker = Pool(ledger, "b", 1 * MiB, [])
    pools = {"reserved": reserved, "b": b, "asker": asker}
    assert lru(ledger, pools).make_room("asker", HOST, 2)
    assert not reserved.evicted and b.evicted == [10, 11]
    # once nothing but the reservation is left, b is refused: nothing of a's goes
    b.keys = []
    ledger.release("b", ledger.used_by("b"))
    ledger.charge("b", 4 * MiB)
    assert not lru(ledger, pools).make_room("asker", HOST, 1)
    assert reserved.keys == [1, 2, 3, 4]


def test_a_tenant_above_its_reservation_gives_only_what_is_above_it():
    ledger = BudgetLedger("host", 8 * MiB, tenants=[("a", None, 4 * MiB)])
    a = Pool(ledger, "a", 1 * MiB, [1, 2, 3, 4, 5, 6])  # 2 MiB above its reservation
    asker = Pool(ledger, "b", 1 * MiB, [7, 8])
    assert lru(ledger, {"a": a, "asker": asker}).make_room("asker", HOST, 1)
    assert a.evicted == [1] and ledger.used_by("a") == 5 * MiB


def test_nothing_evictable_anywhere_answers_no_and_changes_nothing():
    ledger = BudgetLedger("host", 4 * MiB)
    full = Pool(ledger, "t", 1 * MiB, [])
    ledger.charge("t", 4 * MiB)  # held by locked blocks: no key to evict
    asker = Pool(ledger, "t", 1 * MiB, [])
    assert not lru(ledger, {"full": full, "asker": asker}).make_room("asker", HOST, 1)
    assert ledger.used_bytes == 4 * MiB


def test_a_nested_call_does_not_choose_again():
    ledger = BudgetLedger("host", 2 * MiB)
    pools = {}
    table = lru(ledger, pools)

    class Nested(Pool):
        def evict_coldest(self, tier, limit, max_blocks):
            assert table.make_room("asker", tier, 1) is False  # mid-eviction: no second choice
            return super().evict_coldest(tier, limit, max_blocks)

    pools["victim"] = Nested(ledger, "t", 1 * MiB, [1, 2])
    pools["asker"] = Pool(ledger, "t", 1 * MiB, [])
    assert table.make_room("asker", HOST, 1)


LAYOUT_A = KVLayout("lru-a", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32", block_size=4)
LAYOUT_B = KVLayout("lru-b", num_layers=1, num_kv_heads=1, head_dim=16, dtype="float32", block_size=4)


@pytest.fixture
def engine(tmp_path):
    config = EngineConfig(blocks=TierSizes(device=16, host=32, disk=0), shm_dir=str(tmp_path / "shm"),
                          tenants=(Tenant("t"),))
    with Engine(str(tmp_path / "state"), config) as eng:
        yield eng


def _store(dc, first):
    seq = dc.open(list(range(first, first + 8)))
    dc.commit(seq.id).result()
    dc.release(seq.id).result()


def test_eviction_keys_of_real_pools_compare_across_pools(engine):
    """Pool A is touched first, then B many times, then A once more: A's first run is the
    coldest of the two pools, B's runs are colder than A's last one."""
    a, b = engine.pool("t", LAYOUT_A), engine.pool("t", LAYOUT_B)
    _store(a, 1000)
    for i in range(5):
        _store(b, 2000 + 100 * i)
    _store(a, 3000)
    rooms = dict(engine.tier_lru.pools())
    key_a, key_b = rooms[("t", LAYOUT_A)].coldest_key(0), rooms[("t", LAYOUT_B)].coldest_key(0)
    assert key_a < key_b
    newest_a = max(node.last_access for node in a.cache.tree.queues[0].live_nodes())
    assert newest_a > max(node.last_access for node in b.cache.tree.queues[0].live_nodes())
    engine.check_invariants()


def test_others_only_never_takes_the_asking_pools_blocks():
    """What a request's pool could evict itself is counted before it asks; then only other
    pools give, even when its own block is the coldest."""
    ledger = BudgetLedger("host", 4 * MiB)
    asker = Pool(ledger, "t", 1 * MiB, [1, 2])
    other = Pool(ledger, "t", 1 * MiB, [5, 6])
    assert lru(ledger, {"a": asker, "o": other}).make_room("a", HOST, 1, others_only=True)
    assert not asker.evicted and other.evicted == [5]
