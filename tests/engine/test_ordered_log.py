"""``OrderedLog`` encodes records when it appends them, which can be long after the events were
made and on another thread (the disk sync thread, behind a barrier). These tests hold the engine
to what that relies on: an event never changes once made, so the log gets the records the
operations made, byte for byte."""

import random
import threading

import pytest

from prefixd.cache import events as ev
from prefixd.cache.node import DISK, HOST
from prefixd.engine import ordered_log as olog
from prefixd.engine import records
from prefixd.wal import WalFailedError
from prefixd.wal.group import GroupCommitter
from tests.cache.helpers import StoreTokens, tiny_layout
from tests.engine.factory import cache_factory

BS = 2
LAYOUT = tiny_layout(BS)
H1, H2 = b"\x01" * 16, b"\x02" * 16


class Recorder:
    """What every ``submit`` would have logged had it encoded at once, and what the WAL got."""

    def __init__(self, monkeypatch) -> None:
        self.eager: list[bytes] = []
        self.appended: list[bytes] = []
        self.held_at_submit = 0
        real_submit, real_append = olog.OrderedLog.submit, GroupCommitter.append_values

        def submit(log, events, session_id=0, barrier=None, at=0):
            self.eager += records.encode_events(events, session_id)
            if log.num_held or barrier is not None:
                self.held_at_submit += 1
            return real_submit(log, events, session_id, barrier, at)

        def append_values(committer, values):
            self.appended += list(values)
            return real_append(committer, values)

        monkeypatch.setattr(olog.OrderedLog, "submit", submit)
        # the Wal binds its committer's method when it opens: patched before any Wal is made
        monkeypatch.setattr(GroupCommitter, "append_values", append_values)


def _workload(dc, seed: int, steps: int = 120) -> None:
    """Opens, extends, forks, commits (crash and power) and releases over a small vocabulary,
    on tiers small enough that runs are evicted, written through to disk and promoted."""
    rng = random.Random(seed)
    store = StoreTokens(dc.store, BS)
    live = []
    for step in range(steps):
        op = rng.random()
        if (op < 0.45 and len(live) < 3) or not live:
            tokens = [rng.randrange(4) for _ in range(rng.randrange(4, 24))]
            seq = dc.open(tokens, session_id=rng.randrange(1, 4))
            store.write(seq.block_table, tokens, seq.cached_tokens)
            live.append((seq.id, tokens))
        elif op < 0.6 and all(len(t) < 28 for _, t in live):
            seq_id, tokens = live[rng.randrange(len(live))]
            more = [rng.randrange(4) for _ in range(rng.randrange(1, 6))]
            start = len(tokens)
            dc.extend(seq_id, more)
            tokens += more
            store.write(dc.sequence(seq_id).block_table, tokens, start)
        elif op < 0.65 and len(live) < 3:
            seq_id, tokens = live[rng.randrange(len(live))]
            for child in dc.fork(seq_id, 2):
                live.append((child.id, list(tokens)))
        elif op >= 0.65:
            seq_id, _ = live.pop(rng.randrange(len(live)))
            dc.release(seq_id, commit=True, durability="power" if op > 0.9 else "crash")
        if step % 10 == 0:
            dc.tick()
        dc.check_invariants()
    for seq_id, _ in live:
        dc.release(seq_id, commit=True)
    dc.flush().result(timeout=30)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_log_gets_exactly_the_records_the_operations_made(tmp_path, monkeypatch, seed):
    rec = Recorder(monkeypatch)
    with cache_factory(tmp_path, LAYOUT, (64, 24, 80), reclaim_grace_s=0.0, sync="commit",
                       spill_blocks=4) as make:
        dc = make()
        appended0 = len(rec.appended)  # recovery's own records (RECOVER) come before
        _workload(dc, seed)
        assert rec.held_at_submit > 0, "no submission was held behind a barrier: the test saw only eager appends"
        assert rec.appended[appended0:] == rec.eager


def test_a_payload_changed_in_place_after_its_event_is_caught(tmp_path, monkeypatch):
    """The planted bug the test above looks for: a tiering step that edits a run's slot list
    in place after its event was made (here: every disk move's slots, once logged, reversed)."""
    rec = Recorder(monkeypatch)
    real = olog.OrderedLog.submit

    def submit(log, events, session_id=0, barrier=None, at=0):
        pos = real(log, events, session_id, barrier, at)
        for e in events:
            if type(e) is ev.BlocksMoved and e.tier in (HOST, DISK) and len(e.slots) > 1:
                e.slots.reverse()
        return pos

    monkeypatch.setattr(olog.OrderedLog, "submit", submit)
    with cache_factory(tmp_path, LAYOUT, (64, 24, 80), reclaim_grace_s=0.0, spill_blocks=4) as make:
        dc = make()
        appended0 = len(rec.appended)
        _workload(dc, 0)
        assert rec.appended[appended0:] != rec.eager


class _FakeWal:
    def __init__(self) -> None:
        self.values: list[bytes] = []
        self.failed = None

    def append_values(self, values):
        self.values += values
        return len(self.values)

    def flush_into(self, waiters):
        for fut, value in waiters:
            fut.set_result(value)

    def fail(self, cause):
        self.failed = WalFailedError(f"failed: {cause!r}", "/nowhere")
        return self.failed


def test_held_events_are_encoded_by_the_thread_that_resolves_the_barrier():
    from concurrent.futures import Future

    wal = _FakeWal()
    log = olog.OrderedLog(wal)
    log.submit([ev.SeqReleased(1)])
    barrier: Future = Future()
    moved = ev.BlocksMoved(DISK, [H1, H2], [5, 6], [7, 8])
    log.submit([ev.SeqReleased(2), moved], 0, barrier, 1)
    log.submit([ev.SeqOpened(3, 4, 0, b"", b"")], session_id=9)
    assert wal.values == [records.encode_event(ev.SeqReleased(1)), records.encode_event(ev.SeqReleased(2))]
    assert log.num_held == 2
    encoders = []
    real = olog.encode_events
    olog.encode_events = lambda events, sid=0: encoders.append(threading.current_thread().name) or real(events, sid)
    try:
        resolver = threading.Thread(target=barrier.set_result, args=(None,), name="disk-sync")
        resolver.start()
        resolver.join()
    finally:
        olog.encode_events = real
    assert encoders == ["disk-sync", "disk-sync"]
    assert wal.values[2:] == [records.encode_event(moved), records.encode_event(ev.SeqOpened(3, 4, 0, b"", b""), 9)]
    log.check_invariants()


def test_an_event_without_a_record_fails_the_log_and_every_ticket():
    wal = _FakeWal()
    log = olog.OrderedLog(wal)
    pos = log.submit([ev.SeqReleased(1)])
    ticket = log.ticket(pos, "done")
    assert ticket.result(timeout=1) == "done"
    with pytest.raises(WalFailedError):
        log.submit([("not", "an", "event")])
    assert log.failure is wal.failed
    with pytest.raises(WalFailedError):
        log.submit([ev.SeqReleased(2)])
    assert isinstance(log.ticket(pos, None).exception(timeout=1), WalFailedError)
