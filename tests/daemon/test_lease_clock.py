"""The lease clock (``sessions.LeaseClock``) and the lease sweep on it, with a fake wall clock:
a stall of the loop is not charged to any lease; a client silent while the loop runs is."""

from __future__ import annotations

import pytest

from prefixd.api.layout import KVLayout
from prefixd.daemon.sessions import LeaseClock, SessionTable

LAYOUT = KVLayout("clock", 1, 1, 4, "float32", 4)


class Wall:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def run(table: SessionTable, wall: Wall, seconds: float, period: float = 0.1) -> int:
    """Tick every ``period`` for ``seconds``; returns how many sessions expired."""
    ended = 0
    for _ in range(round(seconds / period)):
        wall.t += period
        ended += table.tick()
    return ended


def test_the_clock_counts_running_time_and_at_most_one_step_per_stalled_tick():
    wall = Wall()
    clock = LeaseClock(0.25, wall)
    wall.t += 0.1
    assert clock.advance() == 0.0 and clock.now() == pytest.approx(0.1)
    wall.t += 6.0  # stopped: SIGSTOP, swap
    assert clock.advance() == pytest.approx(5.75)
    assert clock.now() == pytest.approx(0.35) and clock.stalled_s == pytest.approx(5.75)
    wall.t -= 1.0  # a clock never steps back; a reading that does counts nothing
    clock.advance()
    assert clock.now() == pytest.approx(0.35)
    with pytest.raises(ValueError, match="max_step_s"):
        LeaseClock(0)


def test_a_stall_longer_than_the_lease_expires_no_one_and_the_queued_pings_keep_them():
    """Regression: the sweep measured leases on ``time.monotonic()``, so the first tick after a
    stop longer than the lease ended every session before their queued pings were read."""
    wall = Wall()
    table = SessionTable(2.0, clock=LeaseClock(0.25, wall))
    held = [table.attach("t", f"c{i}", LAYOUT, pool=None) for i in range(3)]
    assert run(table, wall, 1.0) == 0
    wall.t += 6.0  # stopped for 3 leases
    assert table.tick() == 0
    for s in held:  # the pings queued during the stop, read after the tick that noticed it
        table.ping(s)
    assert run(table, wall, 1.5) == 0 and len(table) == 3


def test_a_client_silent_while_the_daemon_runs_expires_within_the_lease_and_a_tick():
    wall = Wall()
    table = SessionTable(2.0, clock=LeaseClock(0.25, wall))
    alive, dead = table.attach("t", "alive", LAYOUT, None), table.attach("t", "dead", LAYOUT, None)
    wall.t += 6.0
    table.tick()  # the dead one died during the stall: its lease starts counting now
    ran, ended = 0.0, 0
    while not ended:
        table.ping(alive)
        wall.t += 0.1
        ran += 0.1
        ended = table.tick()
        assert ran < 2.5, "a silent client outlived its lease on running time"
    assert ran > 2.0 - 0.25 - 1e-9, f"expired after {ran} s of running time: before its lease"
    assert [s.name for s in table] == ["alive"] and table.expired_total == 1
