"""The durable cache: restart recovery, reclaim, checkpoints, free-before-reuse, refusals."""

import os

import pytest

from tests.engine.factory import cache_factory
from prefixd.engine import DurabilityError
from prefixd.cache.node import DISK, HOST
from prefixd.api.tiers import Tier
from prefixd.wal import EnvAlreadyOpenError, StateMismatchError
from tests.cache.helpers import StoreTokens, tiny_layout

BS = 2
LAYOUT = tiny_layout(BS)


@pytest.fixture
def make(tmp_path):
    """``make(**kw) -> DurableCache`` over one state dir; closes what is left open."""
    with cache_factory(tmp_path, LAYOUT, (8, 8, 32)) as make:
        yield make


def _serve(dc, tokens, durability="crash"):
    """Open, write KV, commit at ``durability``, release; like an engine would."""
    pool = StoreTokens(dc.store, BS)
    seq = dc.open(tokens)
    pool.write(seq.block_table, tokens, seq.cached_tokens)
    dc.commit(seq.id, durability).result()
    dc.release(seq.id)
    return seq


def _check_hit(dc, tokens):
    """Reopen ``tokens``: every whole block but the last token's is a hit with the right bytes."""
    seq = dc.open(tokens)
    want = (len(tokens) - 1) // BS * BS
    assert seq.cached_tokens == want, (seq.cached_tokens, want)
    StoreTokens(dc.store, BS).check(seq.block_table[: want // BS], tokens[:want])
    dc.release(seq.id)


def test_committed_prefixes_are_hits_with_the_same_bytes_after_a_restart(make):
    dc = make()
    prompts = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 7, 7, 7], [9, 9, 9, 9, 9]]
    for p in prompts:
        _serve(dc, p)
    dc.close()
    dc = make()
    assert dc.recovery["records_replayed"] > 0
    for p in prompts:
        _check_hit(dc, p)
    dc.check_invariants()


def test_a_restart_without_the_host_pool_serves_from_disk(make, tmp_path):
    dc = make()
    _serve(dc, [5, 6, 7, 8, 1], durability="power")
    dc.close()
    for name in os.listdir(tmp_path / "shm"):
        os.unlink(tmp_path / "shm" / name)  # as after a reboot
    dc = make()
    assert dc.recovery["keep_host"] is False
    assert dc.lookup([5, 6, 7, 8, 1]).disk_tokens == 4
    _check_hit(dc, [5, 6, 7, 8, 1])
    assert dc.cache.stats.hit_tokens_by_tier[DISK] == 4


def test_power_commits_reach_disk_and_crash_commits_reach_host(make):
    dc = make(sizes=(8, 8, 32))
    _serve(dc, [1, 1, 1, 1, 0], durability="crash")
    node = next(dc.cache.tree.nodes())
    assert node.slots[HOST] is not None
    _serve(dc, [2, 2, 2, 2, 0], durability="power")
    node2 = [n for n in dc.cache.tree.nodes() if n is not node][0]
    assert node2.slots[DISK] is not None


def test_recovered_sequences_are_cut_to_their_committed_blocks_and_reclaimed(make):
    dc = make()
    pool = StoreTokens(dc.store, BS)
    tokens = [3, 3, 4, 4, 5, 5, 6]
    seq = dc.open(tokens, session_id=7)
    pool.write(seq.block_table, tokens, 0)
    dc.commit(seq.id).result()
    dc.extend(seq.id, [8, 8, 8])  # uncommitted: does not survive
    dc.close()
    dc = make()
    assert list(dc.recovered) == [seq.id]
    assert dc.recovered[seq.id].num_tokens == 6
    got = dc.reclaim(7)
    assert len(got) == 1 and got[0].old_id == seq.id and got[0].num_tokens == 6
    new = got[0].seq
    pool = StoreTokens(dc.store, BS)
    pool.check(new.block_table, tokens[:6])
    assert not dc.recovered
    dc.check_invariants()
    dc.release(new.id)
    dc.close()
    dc = make()
    assert not dc.recovered, "a reclaimed sequence must not come back again"


def test_a_reclaimed_sequence_belongs_to_the_session_that_reclaimed_it(make):
    """Bug: ``reclaim(old)`` logged the reopened sequence under ``old`` again, so after a
    second restart ``reclaim(new)`` (the session that reclaimed it) found nothing and only the
    long-gone session's id did."""
    dc = make()
    tokens = [3, 3, 4, 4, 5, 5, 6]
    seq = dc.open(tokens, session_id=7)
    dc.commit(seq.id).result()
    dc.close()
    dc = make()
    got = dc.reclaim(7, 8)
    assert len(got) == 1 and got[0].seq is not None
    dc.flush().result()
    dc.close()
    dc = make()
    assert dc.reclaim(7) == []
    again = dc.reclaim(8, 9)
    assert len(again) == 1 and again[0].num_tokens == 6
    dc.check_invariants()
    dc.close()


def test_a_reclaimed_sequence_keeps_its_id_across_restarts(make):
    """A Reclaim cut by a restart after its records were durable leaves the sequence under the
    session that reclaimed it, which the client never adopted; the client reclaims that
    session too, and can match what comes back to its handle only by the id it holds."""
    dc = make()
    tokens = [3, 3, 4, 4, 5, 5, 6]
    seq = dc.open(tokens, session_id=7)
    dc.commit(seq.id).result()
    dc.close()
    dc = make()
    (got,) = dc.reclaim(7, 8)
    assert got.old_id == got.seq.id == seq.id and got.num_tokens == 6
    other = dc.open([9, 9, 1], session_id=8)
    assert other.id > seq.id  # an id is never handed out twice
    with pytest.raises(ValueError):
        dc.cache.open([1, 1, 2], seq_id=other.id)  # live
    with pytest.raises(ValueError):
        dc.cache.open([1, 1, 2], seq_id=other.id + 10)  # never handed out
    dc.check_invariants()
    dc.flush().result()
    dc.close()
    dc = make()
    assert dc.recovered[seq.id].session_id == 8 and dc.recovered[seq.id].num_tokens == 6
    again = {r.old_id: r for r in dc.reclaim(8, 9)}
    assert again[seq.id].seq.id == seq.id and again[seq.id].num_tokens == 6
    dc.check_invariants()
    dc.close()


def test_unclaimed_recovered_sequences_are_released_after_the_grace_period(make):
    dc = make()
    seq = dc.open([1, 2, 3, 4, 5], session_id=3)
    dc.commit(seq.id).result()
    dc.close()
    dc = make(reclaim_grace_s=0.0)
    assert dc.recovered
    dc.tick()
    assert not dc.recovered
    assert dc.lookup([1, 2, 3, 4, 5]).cached_tokens == 4  # blocks stay cached
    dc.check_invariants()
    dc.close()
    dc = make()
    assert not dc.recovered


def test_checkpoint_then_tail_replay_rebuilds_the_same_index(make):
    dc = make(checkpoint_records=10**9)
    prompts = [[i % 3, 1, 2, i, i, 4, 5] for i in range(6)]
    for p in prompts[:3]:
        _serve(dc, p)
    dc.checkpoint()
    for p in prompts[3:]:
        _serve(dc, p)
    matched = lambda found: found.cached_tokens + found.unverified_tokens  # noqa: E731 (disk: unchecked)
    before = {tuple(p): matched(dc.lookup(p)) for p in prompts}
    dc.close()
    dc = make()
    after = {tuple(p): matched(dc.lookup(p)) for p in prompts}
    assert after == before
    for p in prompts:
        _check_hit(dc, p)
    dc.check_invariants()


def test_evicted_lower_tier_slots_wait_for_the_log_before_reuse(make):
    dc = make(sizes=(4, 2, 4), write_policy="write_back")
    _serve(dc, [1, 2, 3, 4, 5], durability="index")
    dc.cache.evict(4)          # device -> host
    dc.cache.evict(2, HOST)    # host -> disk: host slots quarantined
    assert dc.cache.allocators[HOST].num_deferred == 2
    dc.flush().result()
    dc.upkeep.release_durable()
    assert dc.cache.allocators[HOST].num_deferred == 0
    dc.check_invariants()


def test_a_commit_that_cannot_be_made_durable_says_so(make):
    dc = make(sizes=(8, 1, 0))
    seq = dc.open([1, 2, 3, 4, 5])
    with pytest.raises(DurabilityError, match="no room in the host tier"):
        dc.commit(seq.id, "crash").result()


def test_eager_verify_cuts_a_corrupt_disk_block_at_recovery(make):
    dc = make()
    _serve(dc, [1, 2, 3, 4, 5, 6, 7], durability="power")
    node = next(n for n in dc.cache.tree.nodes() if n.slots[DISK] is not None)
    pool = dc.store.pool(Tier.DISK)
    bad_slot = node.slots[DISK][1]
    path = pool.path
    dc.close()
    with open(path, "r+b") as f:
        f.seek(pool.offset(bad_slot))
        f.write(b"\xff" * 8)
    dc = make(verify="eager")
    assert dc.recovery["verified_blocks"] >= 3
    assert dc.cache.stats.corrupt_blocks == 1
    # host copy (same boot) still serves all three blocks; disk lost the 2nd and 3rd
    assert dc.lookup([1, 2, 3, 4, 5, 6, 7]).cached_tokens == 6
    dc.check_invariants()


def test_a_state_dir_with_another_layout_is_refused(make):
    make().close()
    other = tiny_layout(4)
    with pytest.raises(StateMismatchError):
        make(layout=other)


def test_a_second_cache_on_the_same_state_dir_is_refused(make):
    make()
    with pytest.raises(EnvAlreadyOpenError):
        make()


def test_eviction_order_survives_a_restart(make):
    """Regression guard: recovery must restore last-access order, not insertion order."""
    dc = make(sizes=(8, 8, 32))
    for first in (10, 20, 30):
        _serve(dc, [first, 1, 2, 3, 0], durability="index")
    seq = dc.open([10, 1, 2, 3, 0])  # 10 is now the most recent; 20 the least
    dc.release(seq.id)
    dc.commit(dc.open([40, 1, 2, 3, 0]).id, "crash").result()  # make the log durable
    dc.close()
    dc = make(sizes=(8, 8, 32))
    dc.expire_recovered()
    host = dc.cache.tree.queues[HOST]
    order = []
    while (node := host.pop()) is not None:
        order.append(int.from_bytes(node.tokens[:4], "little") if node.parent.parent is None else None)
    firsts = [f for f in order if f is not None]
    assert firsts.index(20) < firsts.index(30) < firsts.index(10), firsts


def test_a_failed_disk_write_poisons_the_log_and_a_restart_recovers(make, monkeypatch):
    """Regression: a pwritev error during a spill left drained events unlogged and the log
    open for later acknowledgements."""
    import prefixd.storage.pools as pools
    from prefixd.wal import WalFailedError

    dc = make(spill_blocks=10**9)
    _serve(dc, [1, 2, 3, 4, 5], durability="crash")
    real = pools.os.pwritev

    def broken(*args, **kwargs):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(pools.os, "pwritev", broken)
    dc.spill()  # the write is queued behind the caller: its failure reaches the tickets
    with pytest.raises(WalFailedError):
        dc.flush().result()
    monkeypatch.setattr(pools.os, "pwritev", real)
    with pytest.raises(WalFailedError):
        _serve(dc, [7, 7, 7, 7, 7], durability="crash")
    dc.close()
    dc = make()
    _check_hit(dc, [1, 2, 3, 4, 5])
    assert dc.lookup([7, 7, 7, 7, 7]).cached_tokens == 0


def test_a_durable_cache_without_a_lower_tier_is_refused_clearly(make):
    with pytest.raises(ValueError, match="needs a host or a disk tier"):
        make(sizes=(8, 0, 0))
    with pytest.raises(ValueError, match="device >= 1"):
        make(sizes=(0, 8, 8))


def test_power_durability_without_a_disk_tier_says_so(make):
    dc = make(sizes=(8, 8, 0))
    seq = dc.open([1, 2, 3, 4, 5])
    with pytest.raises(DurabilityError, match="needs a disk tier"):
        dc.commit(seq.id, "power").result()
    dc.commit(seq.id, "crash").result()  # the host tier serves crash durability
    dc.release(seq.id)
    dc.check_invariants()


def test_a_disk_pool_without_its_index_is_refused_but_our_own_half_start_is_redone(make, tmp_path):
    """Guards against a lost data.mdb silently starting a new cache beside the old disk pool
    (unseen, never freed), and against refusing a first start that crashed before its first
    checkpoint (its pool has this directory's own name)."""
    from prefixd.engine.errors import IndexLostError
    from prefixd.wal import Wal

    state = tmp_path / "state"
    wal = Wal(str(state), layouts=LAYOUT.to_bytes())  # a first start that got this far
    own = f"prefixd-{wal.root_seed[:6].hex()}-{LAYOUT.digest()[:6].hex()}.disk.pool"
    wal.close()
    (state / own).write_bytes(b"half-made pool")
    dc = make()  # redone: our own name
    _serve(dc, [1, 2, 3, 4, 5], durability="power")
    dc.close()
    other = state / "prefixd-000000000000-111111111111.disk.pool"
    other.write_bytes(b"x" * 4096)
    for f in (state / "wal").iterdir():  # the index is lost
        f.unlink()
    with pytest.raises(IndexLostError, match="prefixd-000000000000-111111111111.disk.pool"):
        make()
    assert other.read_bytes() == b"x" * 4096
