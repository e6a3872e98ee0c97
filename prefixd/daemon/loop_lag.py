"""The event loop's lag: how late a timer that should fire every ``period_s`` fires.

The loop owns the engine and serves every call (``server.py``), so anything that holds it (a
checkpoint's dump, making a pool's files, a stopped process) delays every client by as much.
``LoopLag`` re-arms one timer on the loop every ``period_s`` and notes how late it fired: a
loop held for ``x`` seconds shows a sample of about ``x``. The samples feed

- ``recent()``: the p99 and the max over the last ``window_s`` seconds (the ``Stats`` values
  ``prefixd_loop_lag_p99_seconds`` and ``prefixd_loop_lag_max_seconds``);
- a cumulative histogram in ``LAG_S_BOUNDS`` (``prefixd_loop_lag_seconds`` on the Prometheus
  endpoint).

NOTE: a timer sees one stall of the loop as one late firing however long the stall, so a
0.5 s stall among 2,000 samples in 10 s would not move the p99, while every call that came
during it waited. ``observe`` therefore also counts the firings the stall swallowed (as
HdrHistogram's ``recordValueWithExpectedInterval`` corrects for coordinated omission): a lag
``L`` is recorded with ``L - period``, ``L - 2 period``, ... down to one period, so the p99 is
that of the wait of a call arriving at a random time. At 5 ms the timer costs the loop 200
short callbacks a second.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import deque

from prefixd.daemon.metrics import Histogram

PERIOD_S = 0.005
WINDOW_S = 10.0
LAG_S_BOUNDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class LoopLag:
    """The lag samples of one loop.

    Invariants: ``_recent`` holds ``(time, lag)`` in time order, none older than ``window_s``
    before the newest; ``sum(_counts) == num_samples``; every lag is >= 0.
    """

    def __init__(self, period_s: float = PERIOD_S, window_s: float = WINDOW_S,
                 clock=time.monotonic) -> None:
        if not period_s > 0 or not window_s > 0:
            raise ValueError(f"period_s and window_s must be > 0, got {period_s!r}, {window_s!r}")
        self.period_s = period_s
        self.window_s = window_s
        self._clock = clock
        self._recent: deque[tuple[float, float]] = deque()
        self._counts = [0] * (len(LAG_S_BOUNDS) + 1)
        self._sum = 0.0
        self.num_samples = 0
        self._loop = None
        self._handle = None
        self._due = 0.0

    def start(self, loop) -> None:
        """Arm the timer on ``loop`` (from the loop's thread)."""
        self._loop = loop
        self._due = self._clock() + self.period_s
        self._handle = loop.call_later(self.period_s, self._fire)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _fire(self) -> None:
        now = self._clock()
        self.observe(now, max(now - self._due, 0.0))
        self._due = now + self.period_s
        self._handle = self._loop.call_later(self.period_s, self._fire)

    def observe(self, now: float, lag: float) -> None:
        """The timer due before ``now`` fired ``lag`` seconds late: that sample, and one for
        each firing the lag swallowed (see the module's NOTE; at most a window's worth)."""
        recent = self._recent
        swallowed = min(int(lag / self.period_s), int(self.window_s / self.period_s))
        for k in range(swallowed, -1, -1):
            value = lag - k * self.period_s
            if k and value <= 0:
                continue
            self._counts[bisect.bisect_left(LAG_S_BOUNDS, value)] += 1
            self._sum += value
            self.num_samples += 1
            recent.append((now - k * self.period_s, value))
        horizon = now - self.window_s
        while recent[0][0] < horizon:
            recent.popleft()

    def recent(self) -> tuple[float, float]:
        """``(p99, max)`` of the lags of the last ``window_s`` seconds (0, 0 without any)."""
        horizon = self._clock() - self.window_s
        lags = sorted(lag for t, lag in self._recent if t >= horizon)
        if not lags:
            return 0.0, 0.0
        return lags[max(math.ceil(0.99 * len(lags)) - 1, 0)], lags[-1]

    def histogram(self) -> Histogram:
        return Histogram(LAG_S_BOUNDS, tuple(self._counts), self._sum)

    def check_invariants(self) -> None:
        times = [t for t, _ in self._recent]
        assert times == sorted(times)
        assert not times or times[0] >= times[-1] - self.window_s
        assert sum(self._counts) == self.num_samples
        assert all(lag >= 0 for _, lag in self._recent)
