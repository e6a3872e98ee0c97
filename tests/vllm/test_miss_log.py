"""Misses the connector understands are said at WARNING at most once a minute per reason."""

import logging

from prefixd.client.vllm.miss_log import POOL_FULL, SOCKET_ABSENT, MissLog


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_one_warning_per_reason_per_interval_with_the_count_since(caplog):
    clock = Clock()
    misses = MissLog(60.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="prefixd.client.vllm.miss_log"):
        assert misses.record(SOCKET_ABSENT, "no /run/prefixd.sock") is True
        assert [misses.record(SOCKET_ABSENT, "again") for _ in range(99)] == [False] * 99
        assert misses.record(POOL_FULL, "8 short") is True  # another reason logs on its own
        clock.now += 59.9
        assert misses.record(SOCKET_ABSENT, "still") is False
        clock.now += 0.2
        assert misses.record(SOCKET_ABSENT, "still") is True
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert "reason=socket absent calls=1 " in lines[0]
    assert "reason=pool full calls=1 " in lines[1]
    assert "reason=socket absent calls=101 " in lines[2] and "detail=still" in lines[2]
    assert misses.reasons[SOCKET_ABSENT].total == 102
    misses.check_invariants()
