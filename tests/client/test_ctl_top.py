"""``prefixctl top``'s screen as a pure function of two ``Stats`` samples (the terminal run
is in tests/daemon/test_metrics.py, in tmux against a live daemon)."""

from __future__ import annotations

from prefixd.api import prefixd_pb2 as pb
from prefixd.client.ctl_top import HEIGHT, WIDTH, Sample, parse_values, render


def sample(t: float, **over) -> Sample:
    values = {
        "prefixd_requested_tokens_total": 1000.0, "prefixd_hit_tokens_total": 250.0,
        "prefixd_requested_blocks_total": 60.0, "prefixd_hit_blocks_total": 15.0,
        'prefixd_blocks{tier="device",state="indexed"}': 100.0,
        'prefixd_blocks{tier="device",state="private"}': 28.0,
        'prefixd_capacity_blocks{tier="device"}': 256.0,
        'prefixd_capacity_blocks{tier="disk"}': 4096.0,
        'prefixd_evicted_blocks_total{tier="device"}': 40.0,
        'prefixd_wal_commit_seconds_bucket{le="0.001"}': 8.0,
        'prefixd_wal_commit_seconds_bucket{le="0.0025"}': 10.0,
        'prefixd_wal_commit_seconds_bucket{le="+Inf"}': 10.0,
        "prefixd_wal_commit_seconds_count": 10.0, "prefixd_sessions": 3.0,
    } | over
    status = pb.StatusReply(state="serving", pid=42, uptime_s=3725.0, tenant="default")
    return Sample(t, status, parse_values(values))


def test_top_screen_fits_80x24_and_shows_hit_rate_tiers_and_wal():
    screen = render(sample(1.0), None)
    assert len(screen) <= HEIGHT and all(len(line) <= WIDTH for line in screen)
    text = "\n".join(screen)
    assert "tokens  25.0%" in text and "blocks  25.0%" in text
    assert "up 1:02:05" in text and "sessions 3" in text
    device = next(line for line in screen if line.startswith("device"))
    assert device.split()[1:4] == ["100", "28", "256"] and "50.0%" in device
    assert not any(line.startswith("host") for line in screen), "a tier without capacity is shown"


def test_top_rates_and_latency_are_over_the_last_interval():
    """Evictions/s and the WAL p99 come from the difference of two samples, not the totals."""
    before = sample(1.0)
    now = sample(3.0, **{'prefixd_evicted_blocks_total{tier="device"}': 60.0,
                         'prefixd_wal_commit_seconds_bucket{le="0.001"}': 8.0,
                         'prefixd_wal_commit_seconds_bucket{le="0.0025"}': 20.0,
                         'prefixd_wal_commit_seconds_bucket{le="+Inf"}': 20.0,
                         "prefixd_wal_commit_seconds_count": 20.0})
    screen = render(now, before)
    device = next(line for line in screen if line.startswith("device"))
    assert device.split()[5] == "10.0"  # (60 - 40) blocks over 2 s
    wal = next(line for line in screen if line.startswith("WAL commit"))
    assert "p50 <=2.5 ms" in wal and "groups/s 5.0" in wal  # all 10 new commits were > 1 ms
