"""Commits that never block the serving thread: tickets, shared fsyncs, the record order
behind disk barriers, and quarantined slots released by the durable watermark."""

import threading

import pytest

from prefixd.cache.node import DISK, HOST
from tests.engine.factory import cache_factory
from prefixd.storage.pools import DiskPool
from prefixd.wal import Kind
from prefixd.wal.env import WalEnv
from tests.cache.helpers import StoreTokens, tiny_layout

BS = 2
LAYOUT = tiny_layout(BS)
RETURNS_WITHIN_S = 10.0  # a call that has not returned by then is waiting for the stalled I/O


@pytest.fixture
def make(tmp_path):
    with cache_factory(tmp_path, LAYOUT, (32, 16, 64), reclaim_grace_s=0.0) as make:
        yield make


class Stall:
    """Holds every call of ``cls.name`` (WAL write txns, disk fdatasyncs) until ``go()``."""

    def __init__(self, monkeypatch, cls, name: str) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        real = getattr(cls, name)

        def held(obj, *args, **kwargs):
            self.entered.set()
            self.gate.wait()
            return real(obj, *args, **kwargs)

        monkeypatch.setattr(cls, name, held)

    def go(self) -> None:
        self.gate.set()


def _returns(fn, *args, **kwargs):
    """Run ``fn`` on a helper thread; its result if it returned within RETURNS_WITHIN_S, else
    fail (it waited for the stalled I/O: the bug these tests look for)."""
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("r", fn(*args, **kwargs)), daemon=True)
    thread.start()
    thread.join(RETURNS_WITHIN_S)
    assert "r" in out, f"{getattr(fn, '__name__', fn)} waited for a stalled fsync instead of returning a ticket"
    return out["r"]


def _open_written(dc, tokens):
    seq = dc.open(tokens)
    StoreTokens(dc.store, BS).write(seq.block_table, tokens, seq.cached_tokens)
    return seq


def test_a_commit_returns_a_ticket_without_waiting_for_the_log_fsync(make, monkeypatch):
    """Regression: ``commit`` blocked its caller until the WAL group was fsynced, so a daemon
    on one thread fsynced once per client commit."""
    dc = make()
    stall = Stall(monkeypatch, WalEnv, "write")
    try:
        seq = _open_written(dc, [1, 2, 3, 4, 5])
        ticket = _returns(dc.commit, seq.id, "crash")
        assert not ticket.done()
        released = _returns(dc.release, seq.id)
        assert released.done() and released.result() is None
    finally:
        stall.go()
    assert ticket.result(timeout=30) == 2
    assert dc.commit(_open_written(dc, [7, 7, 7]).id, "index").done()


def test_concurrent_commits_share_one_log_fsync(make, monkeypatch):
    """Sixteen sequences committing while one group is in flight ride in the next group: at
    most two fsyncs for all of them (the old blocking commit paid one each)."""
    dc = make(sizes=(64, 64, 128))
    seqs = [_open_written(dc, [100 + i, 1, 2, 3, 4]) for i in range(16)]
    dc.flush().result()
    before = dc.wal.stats().syncs
    stall = Stall(monkeypatch, WalEnv, "write")
    try:
        tickets = [_returns(dc.commit, s.id, "crash") for s in seqs]
        assert not any(t.done() for t in tickets)
    finally:
        stall.go()
    assert [t.result(timeout=30) for t in tickets] == [2] * 16
    assert dc.wal.stats().syncs - before <= 2


def test_a_disk_move_and_every_later_record_wait_for_the_disk_fdatasync(make, monkeypatch):
    """Data before metadata, off the calling thread: a ``power`` commit returns at once; its
    BLOCK_MOVE to disk, and records made after it (another sequence's), reach the log only
    after the disk pool's fdatasync, and in the order the cache made them."""
    dc = make()
    seq = _open_written(dc, [1, 2, 3, 4, 5])
    dc.flush().result()
    appended = dc.wal.stats().next_lsn
    stall = Stall(monkeypatch, DiskPool, "sync")
    try:
        ticket = _returns(dc.commit, seq.id, "power")
        assert stall.entered.wait(10) and not ticket.done()
        held_from = dc.wal.stats().next_lsn  # the commit's records before its disk move went in
        other = _open_written(dc, [9, 9, 9])
        dc.release(other.id)
        assert dc.wal.stats().next_lsn == held_from, "a record overtook a disk move waiting for its fdatasync"
    finally:
        stall.go()
    assert ticket.result(timeout=30) == 2
    dc.flush().result()
    kinds = [(r.kind, r.fields) for r in dc.wal.replay(appended - 1)]
    move = next(i for i, (k, f) in enumerate(kinds) if k == Kind.BLOCK_MOVE and f[0] == DISK)
    opened = next(i for i, (k, f) in enumerate(kinds) if k == Kind.OPEN and f[0] == other.id)
    assert move < opened, kinds


def test_quarantined_slots_come_back_only_once_their_drop_is_durable(make, monkeypatch):
    """Free before reuse by watermark: host slots freed by an eviction stay quarantined while
    the log that drops them is stalled, whatever the engine does meanwhile, and are
    allocatable once it is durable (``tick`` or the next call notices)."""
    dc = make(sizes=(8, 4, 64), write_policy="write_back")
    seq = _open_written(dc, [1, 2, 3, 4, 5])
    dc.commit(seq.id, "crash").result()
    dc.release(seq.id)
    dc.flush().result()
    host = dc.cache.allocators[HOST]
    stall = Stall(monkeypatch, WalEnv, "write")
    try:
        dc.cache.evict(2, HOST)  # host -> disk: the host slots are quarantined
        _returns(dc.tick)
        assert host.num_deferred == 2
        _returns(lambda: dc.release(_open_written(dc, [5, 5, 5]).id))
        assert host.num_deferred == 2, "quarantined slots came back before their drop was durable"
    finally:
        stall.go()
    dc.flush().result()
    dc.tick()
    assert host.num_deferred == 0
    dc.check_invariants()


def test_a_tier_short_only_of_quarantined_slots_forces_the_log(make):
    """``Upkeep.force_release`` stays for a shortage made only of quarantined slots: the commit
    still finds room (the old behaviour), and later ones keep headroom."""
    dc = make(sizes=(16, 4, 64))
    for i in range(6):
        seq = _open_written(dc, [10 * i + 1, 2, 3, 4, 5])
        dc.commit(seq.id, "crash").result()
        dc.release(seq.id)
    dc.check_invariants()
    assert dc.cache.allocators[HOST].num_used <= 4


def test_headroom_stays_a_few_batches_of_a_big_tier():
    """Regression: each forced reclaim doubled the evict-ahead headroom up to an eighth of the
    tier, so a busy 1M-block disk tier kept 131k blocks empty for good (bench/recovery.py's
    build never reached its 1M blocks). The cap is a few spill batches."""
    from prefixd.engine.quarantine import MAX_HEADROOM_BATCHES, Quarantine
    from prefixd.storage.slots import SlotAllocator

    class Cache:
        allocators = [SlotAllocator(64), SlotAllocator(8192), SlotAllocator(1_000_000)]

    q = Quarantine(Cache(), order=None, first_headroom=256)
    for _ in range(40):
        q.after_force()
    host_cap, disk_cap = 8192 // 8, 256 * MAX_HEADROOM_BATCHES
    assert q.headroom == [host_cap, disk_cap]
    assert disk_cap <= 1_000_000 // 100, "headroom must stay a small share of a big tier"


def test_headroom_is_capped_in_bytes():
    """Every pool's file is as large as its tier's budget: an eighth of it per pool kept
    empty an eighth of the whole budget for each pool (bench/budget.py: shared/static 1.21);
    the cap is ``HEADROOM_BYTES`` of the pool's blocks."""
    from prefixd.engine.quarantine import HEADROOM_BYTES, Quarantine
    from prefixd.storage.slots import SlotAllocator

    class Cache:
        allocators = [SlotAllocator(64), SlotAllocator(1 << 20), SlotAllocator(1 << 20)]

    q = Quarantine(Cache(), order=None, first_headroom=256, block_bytes=4096)
    for _ in range(40):
        q.after_force()
    assert q.headroom == [HEADROOM_BYTES // 4096] * 2
    big = Quarantine(Cache(), order=None, first_headroom=256, block_bytes=8 << 20)
    big.after_force()
    assert big.headroom == [1, 1]  # a block more than the cap: one


def test_tick_drops_the_marks_of_durable_records(make):
    """Bug (found by the daemon fuzz soak): every logged step left a (position, lsn) mark that
    only the quarantine ever drained, so open/release traffic grew the engine's memory without
    bound (about 1 MB per 4,000 cycles). ``tick`` folds the durable ones away."""
    dc = make()
    for i in range(300):
        seq = dc.open([i, i + 1, i + 2])
        dc.release(seq.id)
    dc.flush().result()
    dc.tick()
    assert dc._order.num_marks <= 1
    dc.close()



@pytest.mark.parametrize("restorer", ["release", "tick"])
def test_open_leaves_the_headroom_to_the_next_call_or_tick(make, restorer):
    """An ``open`` does not evict ahead (a whole run cascading down a tier, on the time to first
    token); the next other call (here ``release``) or the ``tick`` restores the headroom."""
    dc = make(sizes=(64, 32, 128))  # headroom cap: an eighth of the host tier, 4 slots
    host = dc.cache.allocators[HOST]
    for i in range(4):  # host full of committed runs (8 blocks each)
        seq = _open_written(dc, [100 * i + t for t in range(17)])
        dc.commit(seq.id, "index").result()
        dc.release(seq.id)
    dc.flush().result()
    dc.tick()
    quarantine = dc.upkeep.quarantine
    quarantine.headroom[quarantine.tiers.index(HOST)] = 4  # as forced releases would leave it
    assert host.num_free + host.num_deferred < 4, "the test needs a host tier below its headroom"
    seq = dc.open([7, 7, 7])
    assert host.num_free + host.num_deferred < 4, "open evicted ahead on the request's path"
    if restorer == "release":
        dc.release(seq.id)
    else:
        dc.tick()
    assert host.num_free + host.num_deferred >= 4, f"{restorer} did not restore the headroom"
    dc.check_invariants()


def test_a_committing_release_logs_once_and_its_ticket_covers_the_release(make, monkeypatch):
    """One submission for the commit's records and the release's, under one ticket: the
    release no longer logs again after the WAL was asked for the group (the serving thread
    held the GIL the committer waited for). Once the ticket resolves, every record of the
    release is durable too."""
    dc = make()
    seq = _open_written(dc, [1, 2, 3, 4, 5, 6])
    submits = []
    real = dc._order.submit
    monkeypatch.setattr(dc._order, "submit", lambda events, *a, **kw: submits.append(len(events)) or real(events, *a, **kw))
    ticket = dc.release(seq.id, commit=True, durability="crash")
    last = dc._order.position
    assert len(submits) == 1, f"a committing release submitted {len(submits)} batches: {submits}"
    ticket.result(timeout=30)
    assert dc._order.durable_position() >= last
    with pytest.raises(Exception, match=str(seq.id)):
        dc.sequence(seq.id)
    dc.check_invariants()
