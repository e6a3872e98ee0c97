"""The circuit breaker on its own: trips, refuses, probes with backoff, closes on an answer."""

import threading

import pytest

from prefixd.client.breaker import Breaker, DaemonNotAnswering, ProbeSchedule
from prefixd.client.errors import DeadlineExceeded, Unavailable


class Prober:
    """A probe whose answer the test sets; counts the probes."""

    def __init__(self):
        self.answer = False
        self.calls = 0
        self.called = threading.Event()

    def __call__(self):
        self.calls += 1
        self.called.set()
        return self.answer


def wait_for(cond, timeout=30.0):
    deadline = threading.Event()
    t = threading.Timer(timeout, deadline.set)
    t.start()
    try:
        while not cond():
            if deadline.wait(0.005):
                return False
        return True
    finally:
        t.cancel()


def test_closed_breaker_allows_every_call_and_starts_no_probe():
    probe = Prober()
    b = Breaker(probe, name="t")
    assert all(b.allow() for _ in range(100))
    assert b.stats.refused == 0 and probe.calls == 0 and not b.open
    b.check_invariants()


def test_trip_refuses_at_once_and_the_error_is_an_unavailable():
    probe = Prober()
    b = Breaker(probe, name="t", schedule=ProbeSchedule(initial_s=10.0, max_s=10.0))
    assert b.trip(DeadlineExceeded("late")) is True
    assert b.trip(DeadlineExceeded("late again")) is False  # one outage, one trip
    assert not b.allow() and not b.allow()
    assert b.stats.trips == 1 and b.stats.refused == 2
    err = b.error("lookup")
    assert isinstance(err, DaemonNotAnswering) and isinstance(err, Unavailable)
    assert "lookup" in err.message and "late again" in err.message
    b.check_invariants()
    b.stop()


def test_probe_closes_it_once_the_daemon_answers():
    probe = Prober()
    b = Breaker(probe, name="t", schedule=ProbeSchedule(initial_s=0.001, max_s=0.01))
    b.trip(Unavailable("down"))
    assert wait_for(lambda: probe.calls >= 3)
    assert b.open and not b.allow()
    probe.answer = True
    assert b.wait_closed(30.0)
    assert b.allow() and not b.open
    assert b.stats.answered == 1 and b.stats.probes >= 4
    b.check_invariants()
    # a second outage trips it again and a new probe closes it
    b.trip(Unavailable("down again"))
    assert b.wait_closed(30.0) and b.stats.trips == 2 and b.stats.answered == 2
    b.check_invariants()


def test_probe_backs_off_to_its_ceiling():
    sched = ProbeSchedule(initial_s=0.05, max_s=0.4, multiplier=2.0)
    waits, w = [], sched.initial_s
    for _ in range(6):
        waits.append(w)
        w = sched.next_wait(w)
    assert waits == [0.05, 0.1, 0.2, 0.4, 0.4, 0.4]


def test_a_probe_that_raises_counts_as_unanswered():
    calls = []

    def probe():
        calls.append(1)
        if len(calls) < 3:
            raise RuntimeError("connection reset")
        return True

    b = Breaker(probe, name="t", schedule=ProbeSchedule(initial_s=0.001, max_s=0.002))
    b.trip(Unavailable("down"))
    assert b.wait_closed(30.0) and len(calls) == 3
    b.check_invariants()


def test_stop_ends_the_probe_and_no_trip_starts_another():
    probe = Prober()
    b = Breaker(probe, name="t", schedule=ProbeSchedule(initial_s=0.001, max_s=0.002))
    b.trip(Unavailable("down"))
    assert probe.called.wait(30.0)
    b.stop()
    n = probe.calls
    assert b._thread is None or not b._thread.is_alive()
    assert b.trip(Unavailable("again")) is False
    assert probe.calls == n and b.open  # refused as before: the session is closing
    b.check_invariants()


@pytest.mark.parametrize("bad", [dict(initial_s=0), dict(initial_s=1.0, max_s=0.5), dict(multiplier=0.5)])
def test_bad_probe_schedule_is_refused(bad):
    with pytest.raises(ValueError, match="probe schedule"):
        ProbeSchedule(**bad)
