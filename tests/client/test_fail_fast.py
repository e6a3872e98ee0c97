"""Fail fast with a real daemon process: a hung (SIGSTOP) or dead (SIGKILL) daemon costs a
client at most the request-path deadline per call, and hits come back soon after it answers.

The bound on one call is ``request_timeout_ms`` plus ``MARGIN_S``: gRPC enforces the deadline
on its own timer thread, and on a 2-core host shared by several test runs a thread that is
due to run may wait for the CPU for a few hundred milliseconds (the bench measures the same
path without a margin: ``bench/faults.py``).
"""

import os
import signal
import time

import pytest

import prefixd.client as pc
from prefixd.client.breaker import DEFAULT_REQUEST_TIMEOUT_MS
from prefixd.client.breaker import DaemonNotAnswering
from tests.daemon.harness import start_daemon

LAYOUT = pc.KVLayout("fail-fast-test", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_size=4)
DEADLINE_MS = DEFAULT_REQUEST_TIMEOUT_MS  # the default: a healthy loaded daemon must not trip it
MARGIN_S = 0.75
PROMPT = list(range(100, 124))


def timed(fn):
    t0 = time.monotonic()
    try:
        result, error = fn(), None
    except (pc.Unavailable, pc.DeadlineExceeded, pc.NotFound) as exc:
        result, error = None, exc
    return time.monotonic() - t0, result, error


def warm(session):
    """Commit PROMPT so that a lookup of it is a hit."""
    seq = session.open(PROMPT)
    session.release(seq, commit=True)
    assert session.lookup(PROMPT) == len(PROMPT) - len(PROMPT) % LAYOUT.block_size


def issue_until(session, stop, period_s=0.2):
    """Lookups every ``period_s`` until ``stop()``; returns [(seconds, cached or None, error)]."""
    calls = []
    while not stop():
        calls.append(timed(lambda: session.lookup(PROMPT)))
        time.sleep(period_s)
    return calls


def poll_hit(session, bound_s):
    """Seconds until a lookup hits again (polling), or None past ``bound_s``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < bound_s:
        took, cached, _ = timed(lambda: session.lookup(PROMPT))
        assert took <= DEADLINE_MS / 1000 + MARGIN_S, took
        if cached:
            return time.monotonic() - t0
        time.sleep(0.01)
    return None


def test_hung_daemon_costs_one_deadline_per_call_and_hits_return_after_sigcont():
    """A SIGSTOPped daemon: every call answers within the request deadline (the first one by
    missing it, the rest refused at once by the open breaker), and a hit comes back within
    2 s of SIGCONT."""
    with start_daemon(lease_s=120.0) as d, pc.connect(d.socket, LAYOUT, name="ff", mapped=False,
                                                       request_timeout_ms=DEADLINE_MS) as s:
        warm(s)
        os.kill(d.pid(), signal.SIGSTOP)
        try:
            t_end = time.monotonic() + 30.0
            calls = issue_until(s, lambda: time.monotonic() >= t_end)
        finally:
            os.kill(d.pid(), signal.SIGCONT)
        t_cont = time.monotonic()
        back = poll_hit(s, 30.0)
        worst = max(c[0] for c in calls)
        assert worst <= DEADLINE_MS / 1000 + MARGIN_S, worst
        assert all(c[1] is None for c in calls), "no answer from a stopped daemon"
        assert isinstance(calls[0][2], pc.DeadlineExceeded)
        refused = sum(isinstance(c[2], DaemonNotAnswering) for c in calls)
        assert refused >= len(calls) - 3, "the breaker refuses after the first miss"
        assert back is not None and time.monotonic() - t_cont - 0 <= 30.0
        assert back <= 2.0, f"hits came back {back:.2f} s after SIGCONT"
        assert s.breaker.stats.trips >= 1 and not s.breaker.open
        s.check_invariants()


def test_killed_daemon_costs_no_more_and_the_session_recovers_after_restart():
    """A SIGKILLed daemon: every call answers within the request deadline while it is down,
    and after the restart (same state) the session re-attaches in the background and a
    committed prompt hits within 2 s of the daemon serving."""
    with start_daemon(lease_s=10.0) as d, pc.connect(d.socket, LAYOUT, name="ff", mapped=False,
                                                      request_timeout_ms=DEADLINE_MS) as s:
        warm(s)
        held = s.open(PROMPT)  # committed, and held across the crash
        s.commit(held)
        old_id = s.id
        d.kill()
        t_end = time.monotonic() + 5.0
        calls = issue_until(s, lambda: time.monotonic() >= t_end)
        d.start()
        back = poll_hit(s, 30.0)
        worst = max(c[0] for c in calls)
        assert worst <= DEADLINE_MS / 1000 + MARGIN_S, worst
        assert all(isinstance(c[2], pc.Unavailable) for c in calls)
        assert back is not None and back <= 2.0, back
        assert s.id != old_id and s.recoveries == 1
        # the probe reclaimed the held sequence off the caller's thread; its handle says so once
        assert held.reclaimed and held.num_tokens == len(PROMPT)
        with pytest.raises(pc.DaemonRestarted):
            s.extend(held, [7])
        s.extend(held, [7])
        assert len(held) == len(PROMPT) + 1
        s.check_invariants()


def test_without_request_timeout_there_is_no_breaker():
    """The default keeps the waiting semantics (session.py): no breaker, one deadline."""
    with start_daemon() as d, pc.connect(d.socket, LAYOUT, name="plain", mapped=False) as s:
        assert s.breaker is None
        assert s._timeout == s._bulk_timeout == 60.0


def test_bad_request_timeout_is_refused():
    with start_daemon() as d:
        with pytest.raises(pc.InvalidArgument, match="request_timeout_ms"):
            pc.connect(d.socket, LAYOUT, request_timeout_ms=0)
