"""The engine closes pools that hold nothing (``prefixd.engine.pool_close``): their charges
come back in every ledger, their shm files go, and ``pool`` opens them again; a pool that
holds a block or a sequence, or that a session uses, stays open; a pool the cross-pool LRU
evicted to nothing is closed without anyone naming it."""

import os

from prefixd.api.layout import KVLayout
from prefixd.engine import Engine
from tests.engine.test_budgets import LAYOUT, OTHER, config, store

KEY = ("a", LAYOUT)


def shm_files(shm: str) -> set[str]:
    return set(os.listdir(shm))


def disk_bytes(path: str) -> int:
    return sum(os.stat(os.path.join(d, f)).st_blocks * 512 for d, _, fs in os.walk(path) for f in fs)


def test_an_empty_pool_closes_gives_everything_back_and_opens_again(tmp_path):
    shm = str(tmp_path / "shm")
    with Engine(str(tmp_path / "state"), config(shm)) as engine:
        dc = engine.pool("a", LAYOUT)
        seq = dc.open(list(range(41)))
        dc.release(seq.id)  # nothing committed
        assert shm_files(shm) and all(ledger.used_bytes for ledger in engine.budgets.ledgers.values())
        open_charge = engine.budgets.ledgers["disk"].used_by("a")
        engine.note_unused(*KEY)
        assert engine.close_empty_pools(set()) == [KEY]
        assert engine.pools() == [] and shm_files(shm) == set()
        ledgers = engine.budgets.ledgers
        assert ledgers["device"].used_bytes == ledgers["host"].used_bytes == 0
        # what the closed pool's directory still takes stays charged to its tenant
        left = disk_bytes(engine.pool_path(*KEY))
        assert 0 < left < 1 << 20 and ledgers["disk"].used_by("a") == left
        assert engine.closer.leftovers == {KEY: left}
        assert engine.closer.num_closed == 1
        dc = engine.pool("a", LAYOUT)  # opened again (recovered: an empty index)
        assert not engine.closer.leftovers
        assert ledgers["disk"].used_by("a") == open_charge  # as first opened: no leftover kept
        store(dc, 0)
        assert dc.lookup(list(range(41))).cached_tokens == 40
        engine.check_invariants()


def test_a_pool_with_a_block_a_sequence_or_a_session_stays_open(tmp_path):
    with Engine(str(tmp_path / "state"), config(str(tmp_path / "shm"))) as engine:
        cached = engine.pool("a", LAYOUT)
        store(cached, 0)
        holding = engine.pool("b", OTHER)
        holding.open(list(range(41)))  # a live sequence, nothing committed
        engine.pool("a", OTHER)  # a session uses it
        for key in (KEY, ("b", OTHER), ("a", OTHER)):
            engine.note_unused(*key)
        assert engine.close_empty_pools({("a", OTHER)}) == []
        assert len(engine.pools()) == 3 and not engine.closer.candidates
        engine.check_invariants()


def test_a_pool_evicted_to_nothing_by_the_shared_lru_is_closed(tmp_path):
    """Another tenant's new pool needs every byte of every tier: the LRU across pools evicts
    all of pool a's blocks, and the engine closes it though no session end named it."""
    with Engine(str(tmp_path / "state"), config(str(tmp_path / "shm"))) as engine:
        store(engine.pool("a", LAYOUT), 0)
        for tier, name in enumerate(("device", "host", "disk")):
            engine.tier_lru.make_room_bytes("b", tier, engine.budgets.ledgers[name].capacity)
        assert KEY in engine.tier_lru.emptied and not engine.closer.candidates
        assert engine.close_empty_pools(set()) == [KEY]
        assert engine.pools() == []
        assert engine.pool("a", LAYOUT).lookup(list(range(41))).cached_tokens == 0
        engine.check_invariants()


def test_a_pool_closed_then_found_at_the_next_start_recovers_empty(tmp_path):
    state, shm = str(tmp_path / "state"), str(tmp_path / "shm")
    with Engine(state, config(shm)) as engine:
        engine.pool("a", LAYOUT)
        store(engine.pool("b", OTHER), 0)
        engine.note_unused(*KEY)
        assert engine.close_empty_pools(set()) == [KEY]
    with Engine(state, config(shm)) as engine:
        assert {k for k, _ in engine.pool_items()} == {KEY, ("b", OTHER)}
        assert engine.close_empty_pools(set()) == [KEY]  # every pool a start found is a candidate
        assert engine.pool("b", OTHER).lookup(list(range(41))).cached_tokens == 40
        engine.check_invariants()


def test_a_close_that_cannot_give_its_extents_back_is_retried_then_dropped(tmp_path, monkeypatch):
    """A pool whose files still hold more than their headers after the punches (a filesystem
    that cannot punch, a disk writer still busy) is not closed: tried again at the next call,
    ``MAX_TRIES`` times in a row at most, then dropped until it is named again; it keeps
    serving."""
    from prefixd.engine.pool_close import MAX_TRIES

    with Engine(str(tmp_path / "state"), config(str(tmp_path / "shm"))) as engine:
        dc = engine.pool("a", LAYOUT)
        monkeypatch.setattr(dc.store, "held_bytes", lambda tier: 1 << 40)
        engine.note_unused(*KEY)
        for _ in range(MAX_TRIES - 1):
            assert engine.close_empty_pools(set()) == [] and KEY in engine.closer.candidates
        assert engine.close_empty_pools(set()) == [] and not engine.closer.candidates
        monkeypatch.undo()
        store(dc, 0)
        assert dc.lookup(list(range(41))).cached_tokens == 40
        engine.check_invariants()


def test_a_close_that_fails_leaves_the_pool_open(tmp_path, monkeypatch, caplog):
    from prefixd.storage.errors import StorageError

    with Engine(str(tmp_path / "state"), config(str(tmp_path / "shm"))) as engine:
        dc = engine.pool("a", LAYOUT)

        def fail():
            raise StorageError("punch failed")

        monkeypatch.setattr(dc.upkeep, "force_release", fail)
        engine.note_unused(*KEY)
        with caplog.at_level("ERROR", logger="prefixd.engine.engine"):
            assert engine.close_empty_pools(set()) == []
        assert "closing an empty pool failed" in caplog.text
        assert [k for k, _ in engine.pool_items()] == [KEY] and not engine.closer.candidates
        monkeypatch.undo()
        store(dc, 0)
        engine.check_invariants()


def test_a_closed_pools_counters_are_kept_and_carried_on_when_it_opens_again(tmp_path):
    """Exported counters never go down: a closed pool's ``CacheStats`` stay in
    ``closed_stats`` (the metrics render them) and the reopened pool starts from them."""
    with Engine(str(tmp_path / "state"), config(str(tmp_path / "shm"))) as engine:
        dc = engine.pool("a", LAYOUT)
        for i in range(3):
            dc.release(dc.open(list(range(i, i + 41))).id)  # opens, nothing committed
        engine.note_unused(*KEY)
        assert engine.close_empty_pools(set()) == [KEY]
        assert engine.closer.closed_stats[KEY].opens == 3
        dc = engine.pool("a", LAYOUT)
        assert KEY not in engine.closer.closed_stats and dc.cache.stats.opens == 3
        dc.release(dc.open(list(range(41))).id)
        assert dc.cache.stats.opens == 4 and dc.cache.stats.requested_tokens == 4 * 41


def test_a_pool_held_only_by_recovered_sequences_is_closed_once_they_expire(tmp_path):
    """A start finds a sequence (nothing committed) waiting for its client: the pool is not
    empty then; once the tick expires it unclaimed, the pool is a candidate again, though no
    session used it, and closes."""
    import dataclasses

    state, shm = str(tmp_path / "state"), str(tmp_path / "shm")
    cfg = dataclasses.replace(config(shm), reclaim_grace_s=0.0)
    with Engine(state, cfg) as engine:
        engine.pool("a", LAYOUT).open(list(range(41)), session_id=5)  # never released
    with Engine(state, cfg) as engine:  # the grace is 0: the next tick expires it
        dc = engine.pool("a", LAYOUT)
        assert dc.recovered and engine.close_empty_pools(set()) == []
        assert not engine.closer.candidates
        engine.tick()
        assert not dc.recovered
        assert engine.close_empty_pools(set()) == [KEY] and engine.pools() == []
