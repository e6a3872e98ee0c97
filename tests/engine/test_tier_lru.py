"""One LRU across the pools of a tier (``prefixd.engine.tier_lru``): which pool gives room when
a tier's byte budget is full, on pools that hold their blocks as sorted eviction keys and
charge the ledger per block; and that the keys of real pools compare across pools."""

import pytest

from prefixd.api.layout import KVLayout
from prefixd.config import EngineConfig, Tenant, TierSizes
from prefixd.engine import Engine
from prefixd.engine.tier_lru import BATCH_BYTES, TierLRU
from prefixd.storage.budget_ledger import BudgetLedger

HOST = 1
MiB = 1 << 20


class Pool:
    """A pool of ``block_bytes`` blocks with eviction keys ``keys``, each block charged."""

    def __init__(self, ledger, tenant, block_bytes, keys):
        self.ledger, self.tenant, self.block_bytes = ledger, tenant, block_bytes
        self.keys = sorted(keys)
        self.asked = []
        ledger.charge(tenant, block_bytes * len(self.keys))

    def coldest_key(self, tier):
        return self.keys[0] if self.keys else None

    def give_room(self, tier, num_blocks, own):
        self.asked.append((num_blocks, own))
        gone, self.keys = self.keys[:num_blocks], self.keys[num_blocks:]
        if own:
            return 0
        self.ledger.release(self.tenant, len(gone) * self.block_bytes)
        return len(gone) * self.block_bytes


def lru(ledger, pools):
    return TierLRU({"device": ledger, "host": ledger, "disk": ledger}, lambda: pools.items())


def test_the_coldest_block_of_any_pool_goes_first_charged_in_bytes():
    ledger = BudgetLedger("host", 64 * MiB)
    big = Pool(ledger, "t", 4 * MiB, [10, 11, 12, 13, 14, 15, 16, 17])  # 32 MiB, old
    small = Pool(ledger, "t", 1 * MiB, range(20, 52))  # 32 MiB, newer: the budget is full
    asker = Pool(ledger, "t", 2 * MiB, [])
    pools = {"big": big, "small": small, "asker": asker}
    assert lru(ledger, pools).make_room("asker", HOST, 3)  # 6 MiB: the 4 MiB blocks of big pay
    assert big.asked == [(2, False)] and not small.asked  # 6 MiB in whole 4 MiB blocks
    assert ledger.can_charge("t", 6 * MiB)
    # now small's blocks are the oldest left: it gives the next room
    ledger.charge("t", 8 * MiB)  # the asker took it all: the budget is full again
    big.keys = [100]
    assert lru(ledger, pools).make_room("asker", HOST, 1)
    assert small.asked == [(BATCH_BYTES // MiB, False)]  # a 2 MiB shortfall: one batch


def test_the_asking_pool_evicts_its_own_when_its_block_is_the_coldest():
    ledger = BudgetLedger("host", 8 * MiB)
    asker = Pool(ledger, "t", 1 * MiB, [1, 2, 3, 4])
    other = Pool(ledger, "t", 1 * MiB, [5, 6, 7, 8])
    assert lru(ledger, {"a": asker, "o": other}).make_room("a", HOST, 2)
    assert asker.asked == [(2, True)] and not other.asked


def test_a_tenant_at_its_max_evicts_its_own_blocks_even_when_others_are_colder():
    ledger = BudgetLedger("host", 16 * MiB, tenants=[("a", 4 * MiB, 0)])
    mine = Pool(ledger, "a", 1 * MiB, [50, 51, 52, 53])  # at its max of 4 MiB
    theirs = Pool(ledger, "b", 1 * MiB, [1, 2, 3])  # colder, but not a's to take
    asker = Pool(ledger, "a", 1 * MiB, [])
    pools = {"mine": mine, "theirs": theirs, "asker": asker}
    assert lru(ledger, pools).make_room("asker", HOST, 1)
    assert mine.asked and not theirs.asked


def test_reserved_bytes_of_another_tenant_are_never_evicted():
    ledger = BudgetLedger("host", 8 * MiB, tenants=[("a", None, 4 * MiB)])
    reserved = Pool(ledger, "a", 1 * MiB, [1, 2, 3, 4])  # exactly its reservation, the coldest
    b = Pool(ledger, "b", 1 * MiB, [10, 11, 12, 13])
    asker = Pool(ledger, "b", 1 * MiB, [])
    pools = {"reserved": reserved, "b": b, "asker": asker}
    assert lru(ledger, pools).make_room("asker", HOST, 2)
    assert not reserved.asked and b.asked
    assert reserved.keys == [1, 2, 3, 4]
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
    assert a.asked == [(1, False)]  # a block at a time: a batch would cut into the reservation
    assert ledger.used_by("a") == 5 * MiB


def test_nothing_evictable_anywhere_answers_no_and_changes_nothing():
    ledger = BudgetLedger("host", 4 * MiB)
    full = Pool(ledger, "t", 1 * MiB, [])
    ledger.charge("t", 4 * MiB)  # held by locked blocks: no key to evict
    asker = Pool(ledger, "t", 1 * MiB, [])
    assert not lru(ledger, {"full": full, "asker": asker}).make_room("asker", HOST, 1)
    assert ledger.used_bytes == 4 * MiB


def test_a_nested_call_does_not_pick_victims_again():
    ledger = BudgetLedger("host", 2 * MiB)
    pools = {}
    table = lru(ledger, pools)

    class Nested(Pool):
        def give_room(self, tier, num_blocks, own):
            assert table.make_room("asker", tier, 1) is False  # mid-eviction: no second choice
            return super().give_room(tier, num_blocks, own)

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
    assert not asker.asked and other.asked
