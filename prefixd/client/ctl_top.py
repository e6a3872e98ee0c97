"""``prefixctl top``: a live view of one daemon (its socket's tenant), fit for 80x24.

Every ``--interval`` seconds it asks ``Status`` and ``Stats`` (the numbers of the metrics
endpoint, ``prefixd.daemon.metrics``) and draws hit rate, tier occupancy, evictions and
promotions per second, WAL commit latency and sessions; rates and latency quantiles are over
the last interval (the difference of two ``Stats`` replies). ``q`` quits.

``render`` is a pure function of two samples (tested without a terminal); ``run`` is the
curses loop around it.
"""

from __future__ import annotations

import curses
import re
import time
from typing import NamedTuple

from prefixd.api import prefixd_pb2 as pb

WIDTH, HEIGHT = 80, 24
TIERS = ("device", "host", "disk")
_KEY = re.compile(r'^(\w+)(?:\{(.*)\})?$')
_LABEL = re.compile(r'(\w+)="([^"]*)"')


class Sample(NamedTuple):
    """One poll: when (monotonic s), the Status reply, the Stats values by (name, labels)."""

    t: float
    status: pb.StatusReply
    values: dict


def parse_values(values) -> dict:
    """``{'name{a="1"}': v}`` -> ``{(name, frozenset({('a', '1')})): v}``."""
    out = {}
    for key, value in values.items():
        m = _KEY.match(key)
        if m:
            out[(m.group(1), frozenset(_LABEL.findall(m.group(2) or "")))] = value
    return out


def _get(values: dict, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in values.items() if n == name and want <= ls)


def _short(n: float) -> str:
    """``12.5M``, ``2.3G``: bytes in binary units, one letter (the screen is 80 wide)."""
    for unit, shift in (("T", 40), ("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f}{unit}"
    return f"{int(n)}B"


def _rate(now: Sample, before: Sample | None, name: str, **labels) -> float | None:
    if before is None or now.t <= before.t:
        return None
    return max(_get(now.values, name, **labels) - _get(before.values, name, **labels), 0.0) / (
        now.t - before.t)


def _quantile(now: Sample, before: Sample | None, name: str, q: float) -> float | None:
    """The q-quantile of a histogram over the interval (a bucket's upper bound), or None."""
    buckets = {}
    for (n, ls), v in now.values.items():
        if n == f"{name}_bucket":
            le = dict(ls)["le"]
            old = 0.0
            if before is not None:
                old = before.values.get((n, ls), 0.0)
            buckets[le] = buckets.get(le, 0.0) + v - old
    if not buckets:
        return None
    ordered = sorted(buckets.items(), key=lambda kv: float(kv[0]))
    total = ordered[-1][1]
    if total <= 0:
        return None
    for le, count in ordered:
        if count >= q * total:
            return float(le)
    return None


def _pct(x: float | None) -> str:
    return "   -  " if x is None else f"{100 * x:5.1f}%"


def _num(x: float | None, fmt: str = "{:9.1f}") -> str:
    return fmt.format(x) if x is not None else fmt.format(float("nan")).replace("nan", "  -")


def _ms(x: float | None) -> str:
    if x is None:
        return "    -"
    if x == float("inf"):
        return "  >2.5s"
    return f"<={x * 1e3:g} ms"


def _uptime(s: float) -> str:
    s = int(s)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def render(now: Sample, before: Sample | None) -> list[str]:
    """The screen: at most ``HEIGHT`` lines of at most ``WIDTH`` characters."""
    st, v = now.status, now.values
    lines = [f"prefixd top  pid {st.pid}  {st.state}  up {_uptime(st.uptime_s)}  tenant "
             f"{st.tenant}   (q quits)", ""]
    req, hit = _get(v, "prefixd_requested_tokens_total"), _get(v, "prefixd_hit_tokens_total")
    rb, hb = _get(v, "prefixd_requested_blocks_total"), _get(v, "prefixd_hit_blocks_total")
    d_req = _rate(now, before, "prefixd_requested_tokens_total")
    d_hit = _rate(now, before, "prefixd_hit_tokens_total")
    lines.append(f"hit rate   tokens {_pct(hit / req if req else None)}   blocks "
                 f"{_pct(hb / rb if rb else None)}   last interval "
                 f"{_pct(d_hit / d_req if d_req else None)}")
    lines.append(f"sessions {int(_get(v, 'prefixd_sessions')):<6d} rpc/s "
                 f"{_num(_rate(now, before, 'prefixd_rpc_calls_total'), '{:8.1f}')}   errors/s "
                 f"{_num(_rate(now, before, 'prefixd_rpc_errors_total'), '{:6.1f}')}   "
                 f"opens/s {_num(_rate(now, before, 'prefixd_opens_total'), '{:7.1f}')}")
    lines.append("")
    lines.append(f"{'tier':<8}{'indexed':>10}{'private':>9}{'capacity':>10}{'occupancy':>11}"
                 f"{'evict/s':>10}{'promote/s':>11}")
    for tier in TIERS:
        cap = _get(v, "prefixd_capacity_blocks", tier=tier)
        if not cap:
            continue
        indexed = _get(v, "prefixd_blocks", tier=tier, state="indexed")
        private = _get(v, "prefixd_blocks", tier=tier, state="private")
        lines.append(f"{tier:<8}{int(indexed):>10d}{int(private):>9d}{int(cap):>10d}"
                     f"{_pct((indexed + private) / cap):>11}"
                     f"{_num(_rate(now, before, 'prefixd_evicted_blocks_total', tier=tier), '{:10.1f}')}"
                     f"{_num(_rate(now, before, 'prefixd_promoted_blocks_total', tier=tier), '{:11.1f}')}")
    budgets = [f"{tier} {_short(_get(v, 'prefixd_used_bytes', tier=tier))}/"
               f"{_short(_get(v, 'prefixd_budget_bytes', tier=tier))}" for tier in TIERS
               if _get(v, "prefixd_budget_bytes", tier=tier)]
    if budgets:  # the tenant's bytes of each tier's budget
        lines.append("budget used  " + "  ".join(budgets))
    lines.append("")
    groups = _rate(now, before, "prefixd_wal_commit_seconds_count")
    recs = _rate(now, before, "prefixd_wal_group_records_sum")
    lines.append(f"WAL commit  p50 {_ms(_quantile(now, before, 'prefixd_wal_commit_seconds', 0.5))}"
                 f"  p99 {_ms(_quantile(now, before, 'prefixd_wal_commit_seconds', 0.99))}"
                 f"  groups/s {_num(groups, '{:.1f}')}"
                 f"  records/group {_num(recs / groups if groups else None, '{:.1f}')}")
    lines.append(f"references {int(_get(v, 'prefixd_refcount')):<9d} sequences "
                 f"{int(_get(v, 'prefixd_sequences')):<7d} pinned device blocks "
                 f"{int(_get(v, 'prefixd_pinned_device_blocks'))}")
    lines.append(f"recovery   {_get(v, 'prefixd_recovery_seconds'):.2f} s, "
                 f"{int(_get(v, 'prefixd_recovery_records_replayed'))} records replayed")
    return [line[:WIDTH] for line in lines[:HEIGHT]]


def poll(daemon) -> Sample:
    """One sample (``daemon``: ``ctl.Connection``; its failures raise ``CtlExit``)."""
    status = daemon.status()
    values = {}
    if status.state == "serving":
        values = parse_values(daemon.call("Stats", pb.StatsRequest()).values)
    return Sample(time.monotonic(), status, values)


def run(daemon, interval: float) -> int:
    """The curses loop; returns when ``q`` is pressed (0)."""
    return curses.wrapper(_loop, daemon, interval)


def _loop(screen, daemon, interval: float) -> int:
    curses.curs_set(0)
    screen.timeout(int(interval * 1000))
    before = None
    while True:
        now = poll(daemon)
        screen.erase()
        rows, cols = screen.getmaxyx()
        for y, line in enumerate(render(now, before)[:rows]):
            screen.addnstr(y, 0, line, max(cols - 1, 1))
        screen.refresh()
        before = now
        deadline = time.monotonic() + interval
        while True:
            key = screen.getch()
            if key in (ord("q"), ord("Q")):
                return 0
            if time.monotonic() >= deadline:
                break
