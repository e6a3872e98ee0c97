"""The Prometheus endpoint of a live daemon, parsed with prometheus_client's own parser: the
families DESIGN.md names, the same numbers as the ``Stats`` rpc, and a Grafana dashboard whose
every query names a series the daemon exports. One daemon for the module."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from prefixd.api import prefixd_pb2 as pb
from prefixd.daemon.heap import heap_stats
from prefixd.daemon.metrics_http import scrape_unix
from tests.daemon.harness import METRICS_CONFIG, start_daemon

ROOT = pathlib.Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docs" / "grafana" / "prefixd.json"
LAYOUT = pb.KVLayout(model_id="tiny", num_layers=1, num_kv_heads=1, head_dim=8,
                     dtype="float16", block_size=16)
PROMPTS = [np.arange(i * 1000, i * 1000 + 64, dtype="<i4").tobytes() for i in range(4)]


@pytest.fixture(scope="module")
def daemon():
    """A daemon whose 8-block device pool was made to evict, demote, hit and promote. Its
    session, kept without keep-alives, serves the module's later tests: the lease outlasts
    them on a loaded host."""
    with start_daemon(METRICS_CONFIG, lease_s=60.0) as d:
        stub = d.stub()
        sid = stub.Attach(pb.AttachRequest(client_name="metrics", layout=LAYOUT)).session_id
        for _ in range(2):  # 4 prompts of 4 blocks through 8 device blocks: evictions
            for prompt in PROMPTS:
                seq = stub.Open(pb.OpenRequest(session_id=sid, tokens=prompt)).sequence
                stub.Release(pb.ReleaseRequest(session_id=sid, seq_id=seq.seq_id, commit=True))
        d.metrics_socket = f"{d.base}/m.sock"
        d.session_id = sid
        yield d


def scrape(daemon) -> dict:
    """``{sample name with labels: value}`` and the families, from one scrape."""
    text = scrape_unix(daemon.metrics_socket)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return families


def total(families, name: str, **labels) -> float:
    fam_name = re.sub(r"_(total|bucket|count|sum)$", "", name)
    fam = families[fam_name]
    return sum(s.value for s in fam.samples if s.name == name
               and all(s.labels.get(k) == v for k, v in labels.items()))


def test_scrape_has_every_family_design_names(daemon):
    fams = scrape(daemon)
    for name in ("prefixd_hit_tokens", "prefixd_requested_tokens", "prefixd_hit_blocks",
                 "prefixd_requested_blocks", "prefixd_blocks", "prefixd_refcount",
                 "prefixd_cow_blocks", "prefixd_evicted_blocks", "prefixd_demoted_blocks",
                 "prefixd_promoted_blocks", "prefixd_wal_commit_seconds",
                 "prefixd_wal_group_records", "prefixd_recovery_seconds",
                 "prefixd_recovery_records_replayed", "prefixd_rpc_seconds", "prefixd_sessions"):
        assert name in fams, f"{name} missing from the scrape"
    if heap_stats() is not None:  # glibc 2.33+: the free heap the daemon keeps shows
        assert fams["prefixd_heap_free_bytes"].samples[0].value >= 0
        assert fams["prefixd_heap_in_use_bytes"].samples[0].value > 1 << 20
    assert fams["prefixd_wal_commit_seconds"].type == "histogram"
    assert fams["prefixd_rpc_seconds"].type == "histogram"
    assert {s.labels["generation"] for s in fams["prefixd_gc_collections"].samples} == {"0", "1", "2"}


def test_the_start_up_heap_is_frozen_once_serving(daemon):
    """What was alive when serving began (imports, the recovered index) is out of the
    collector's walks (prefixd.daemon.collector): a full collection in the middle of serving
    walked ~200k objects. Fails when the daemon does not freeze: the gauge reads 0."""
    fams = scrape(daemon)
    assert fams["prefixd_gc_frozen_objects"].samples[0].value > 50_000
    tiers = {s.labels["tier"] for s in fams["prefixd_blocks"].samples}
    assert tiers == {"device", "host", "disk"}


def test_scrape_counts_what_the_workload_did(daemon):
    fams = scrape(daemon)
    assert total(fams, "prefixd_requested_tokens_total", tenant="default") == 8 * 64
    # the second round hits 3 of 4 blocks per prompt (a hit leaves the last token to compute)
    assert total(fams, "prefixd_hit_tokens_total") == 4 * 48
    assert total(fams, "prefixd_hit_blocks_total") == 4 * 3
    assert total(fams, "prefixd_evicted_blocks_total", tier="device") >= 8
    assert total(fams, "prefixd_promoted_blocks_total", tier="host") >= 8
    assert total(fams, "prefixd_wal_commit_seconds_count") >= 1
    assert total(fams, "prefixd_rpc_seconds_count", method="Open", status="OK") == 8
    assert total(fams, "prefixd_sessions", tenant="default") == 1


def test_rpc_latency_counts_refusals_by_status(daemon):
    stub = daemon.stub()

    with pytest.raises(grpc.RpcError):
        stub.Open(pb.OpenRequest(session_id=daemon.session_id, tokens=b"abc"))
    fams = scrape(daemon)
    assert total(fams, "prefixd_rpc_seconds_count", method="Open",
                 status="INVALID_ARGUMENT") == 1


def key_of(name: str, labels: dict) -> tuple:
    return name, frozenset(labels.items())


def parse_key(key: str) -> tuple:
    """``'name{a="1",b="2"}'`` (a ``Stats`` key) -> ``key_of`` form."""
    name, _, rest = key.partition("{")
    return key_of(name, dict(re.findall(r'(\w+)="([^"]*)"', rest)))


def test_stats_rpc_carries_the_scraped_numbers(daemon):
    """The ``Stats`` map and the scrape come from one builder: every pool number matches."""
    stub = daemon.stub()

    def stats() -> dict:
        return {parse_key(k): v for k, v in
                stub.Stats(pb.StatsRequest(session_id=daemon.session_id)).values.items()}

    values = stats()
    fams = scrape(daemon)
    after = stats()  # a tick's disk spill may land between the two: compare what held still
    checked = 0
    for fam in fams.values():
        if not fam.name.startswith("prefixd_") or fam.name.startswith(
                ("prefixd_rpc", "prefixd_uptime", "prefixd_metrics", "prefixd_state", "prefixd_heap",
                 "prefixd_gc", "prefixd_loop_lag")):
            continue  # these move with the calls themselves
        summed: dict[tuple, float] = {}
        for s in fam.samples:
            key = key_of(s.name, {k: v for k, v in s.labels.items()
                                  if k not in ("tenant", "model")})
            summed[key] = summed.get(key, 0.0) + s.value
        for key, value in summed.items():
            if key[0] in ("prefixd_hit_rate", "prefixd_cow_blocks_per_token"):
                continue  # ratios: the rpc recomputes them over the tenant's pools
            assert key in values, f"{key} is scraped but not in Stats"
            if after.get(key) != values[key]:
                continue
            assert values[key] == pytest.approx(value), key
            checked += 1
    assert checked > 50


def dashboard() -> dict:
    """The dashboard, checked for what Grafana's dashboard schema requires of it."""
    dash = json.loads(DASHBOARD.read_text())
    assert dash["title"] and dash["schemaVersion"] >= 36 and dash["panels"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(set(ids)) == len(ids)
    for p in dash["panels"]:
        assert {"id", "type", "title", "gridPos", "targets"} <= set(p)
        assert {"h", "w", "x", "y"} <= set(p["gridPos"]) and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        assert p["targets"] and all(t["refId"] and t["expr"] for t in p["targets"])
    return dash


def test_grafana_dashboard_queries_only_exported_series(daemon):
    """Every panel's every query names series of a live scrape (a renamed metric would leave
    a panel empty without any error in Grafana)."""
    dash = dashboard()
    fams = scrape(daemon)
    exported = {s.name for f in fams.values() for s in f.samples} | {"prefixd_up"}
    named = set()
    for p in dash["panels"]:
        for t in p["targets"]:
            named |= set(re.findall(r"\bprefixd_[a-z_]+", t["expr"]))
    missing = named - exported
    assert not missing, f"the dashboard queries series the daemon does not export: {missing}"
    assert len(named) >= 20


# -- prefixctl top, in a real terminal (tmux) against this daemon ----------------------------------

def _tmux(*args, check=True) -> subprocess.CompletedProcess:
    return subprocess.run(["tmux", "-L", TMUX_SERVER, *args], capture_output=True, text=True,
                          check=check, timeout=30)


TMUX_SERVER = f"prefixd-test-{os.getpid()}"


def _screen() -> list[str]:
    return _tmux("capture-pane", "-p", "-t", "top").stdout.splitlines()


def _wait_for(predicate, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(0.2)
    return None


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (apt-get install tmux)")
def test_prefixctl_top_draws_an_80x24_screen_refreshes_and_quits_on_q(daemon):
    """Guards against a view that does not fit 80x24, never refreshes, or ignores ``q``."""
    cmd = (f"cd {ROOT} && PYTHONPATH={ROOT} {sys.executable} -m prefixd.client.ctl "
           f"--socket {daemon.socket} top --interval 0.3")
    _tmux("new-session", "-d", "-s", "top", "-x", "80", "-y", "24", cmd)
    try:
        first = _wait_for(lambda: (s := _screen()) and any("hit rate" in x for x in s) and s)
        assert first, f"top never drew its screen: {_screen()}"
        assert len(first) <= 24 and all(len(line) <= 80 for line in first)
        text = "\n".join(first)
        for word in ("hit rate", "device", "host", "disk", "WAL commit", "sessions", "evict/s"):
            assert word in text, f"{word!r} missing from the screen:\n{text}"
        assert re.search(r"tokens\s+37\.5%", text), text  # 192 of 512 tokens hit
        rpcs_before = total(scrape(daemon), "prefixd_rpc_calls_total", method="Stats")
        assert _wait_for(lambda: total(scrape(daemon), "prefixd_rpc_calls_total",
                                       method="Stats") >= rpcs_before + 2), "top does not refresh"
        _tmux("send-keys", "-t", "top", "q")
        gone = _wait_for(lambda: _tmux("has-session", "-t", "top", check=False).returncode != 0,
                         timeout=20)
        assert gone, f"top did not quit on q: {_screen()}"
    finally:
        _tmux("kill-server", check=False)
