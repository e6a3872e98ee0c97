"""The publisher keeps a pool's radix tree only while the pool is open: a pool closed empty
(``Engine.close_empty_pools``) is forgotten (``KVPublishers.forget_pool``), so a daemon whose
pools close and reopen for days keeps no tree of theirs, and a reopened pool's events are read
against its new tree."""

import asyncio

from prefixd.config.kv_events_settings import KVEventsConfig
from prefixd.daemon.kv_publisher import KVPublishers
from prefixd.engine import Engine
from tests.engine.test_budgets import LAYOUT, config, store

KEY = ("a", LAYOUT)


def test_a_closed_pools_tree_is_forgotten_and_its_reopening_publishes_against_the_new_one(tmp_path):
    async def run():
        with Engine(str(tmp_path / "state"), config(str(tmp_path / "shm"))) as engine:
            pubs = KVPublishers(KVEventsConfig(endpoint=f"ipc://{tmp_path}/kv"), ["a", "b"])
            try:
                await pubs.start(engine)
                engine.set_event_listener(pubs.observe)
                trees = []
                for cycle in range(3):
                    dc = engine.pool("a", LAYOUT)
                    trees.append(dc.cache.tree)
                    store(dc, 1000 * cycle)  # its events name the open pool's tree
                    assert {v[2] for v in pubs._trees.values()} == {dc.cache.tree}
                    for tier in range(3):  # empty it (as the LRU across pools would), then close
                        engine.tier_lru.make_room_bytes("b", tier, 1 << 40)
                    closed = engine.close_empty_pools(set())
                    assert closed == [KEY]
                    pubs.forget_pool(dc.cache.tree)  # what the daemon's tick does for each
                    assert not pubs._trees and id(dc.cache.tree) not in pubs._roots
                assert len({id(t) for t in trees}) == 3  # each reopening made a new tree
                assert pubs.by_tenant["a"].pending == []  # flushed before the tree went
            finally:
                pubs.close()

    asyncio.run(run())
