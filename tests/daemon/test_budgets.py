"""Byte budgets on real daemon processes: the bytes the daemon's files take (``st_blocks`` of
every file under the state directory and the shm directory, measured here, never read from the
daemon) stay within ``[engine.budget]`` whatever layouts clients attach; a huge Attach is
refused while another tenant keeps committing; a tenant's ``reserved`` bytes keep its hot
prefixes while another tenant hammers; Status, Stats and the metrics show the budgets."""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import tempfile
import threading
import time

import grpc
import numpy as np
import pytest

from prefixd.api import prefixd_pb2 as pb
from prefixd.client.ctl_render import status_text
from tests.daemon.harness import DaemonProcess, start_daemon
from tests.requires import missing

MiB = 1 << 20

BUDGET_CONFIG = """
[engine]
sync = "commit"
shm_dir = "{shm}"

[engine.budget]
device = "32MiB"
host = "64MiB"
disk = "256MiB"

[[engine.tenants]]
name = "alpha"
salt = "alpha"
{alpha_quota}

[[engine.tenants]]
name = "beta"
salt = "beta"

[daemon]
lease_s = {lease_s}
"""


def config(alpha_quota: str = "") -> str:
    return BUDGET_CONFIG.replace("{alpha_quota}", alpha_quota)


def layout(model: str, *, layers=1, heads=1, head_dim=8, block_size=4, dtype="float16") -> pb.KVLayout:
    return pb.KVLayout(model_id=model, num_layers=layers, num_kv_heads=heads, head_dim=head_dim,
                       dtype=dtype, block_size=block_size)


def block_bytes(lay: pb.KVLayout) -> int:
    item = {"float16": 2, "bfloat16": 2, "float32": 4}[lay.dtype]
    return lay.num_layers * 2 * lay.block_size * lay.num_kv_heads * lay.head_dim * item


def beta_socket(d) -> str:
    return os.path.join(os.path.dirname(d.socket), "beta.sock")


def taken(path: str) -> int:
    """What every file under ``path`` takes on its filesystem (``st_blocks``)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except FileNotFoundError:  # a file replaced while we walk (a checkpoint's temp)
                pass
    return total


def prompt(i: int, num_blocks: int, bs: int) -> bytes:
    return np.arange(10_000 * i, 10_000 * i + num_blocks * bs + 1, dtype="<i4").tobytes()


def store(stub, sid: int, tokens: bytes, durability: str = "crash") -> None:
    seq = stub.Open(pb.OpenRequest(session_id=sid, tokens=tokens)).sequence
    stub.Commit(pb.CommitRequest(session_id=sid, seq_id=seq.seq_id, durability=durability))
    stub.Release(pb.ReleaseRequest(session_id=sid, seq_id=seq.seq_id))


def attach(stub, lay: pb.KVLayout, max_model_len: int = 0) -> int:
    return stub.Attach(pb.AttachRequest(client_name="budget-test", layout=lay,
                                        max_model_len=max_model_len), timeout=60).session_id


@contextlib.contextmanager
def tmpfs_base(size: int):
    """A short base directory whose ``state`` is a tmpfs of ``size`` bytes (root only)."""
    if os.geteuid() != 0:
        missing("mounting a small tmpfs on the state directory needs root")
    base = tempfile.mkdtemp(prefix="pd-bud-", dir="/tmp")
    state = os.path.join(base, "state")
    os.makedirs(state)
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", state],
                         capture_output=True, text=True)
    if out.returncode != 0:
        missing(f"cannot mount a tmpfs here: {out.stderr.strip() or out.returncode}")
    try:
        yield base
    finally:
        if subprocess.run(["umount", state], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", state], capture_output=True)
        subprocess.run(["rm", "-rf", base], capture_output=True)


def test_status_stats_and_metrics_show_each_tiers_budget_and_bytes_by_tenant():
    with start_daemon(config(), lease_s=600.0) as d:
        stub = d.stub()
        sid = attach(stub, layout("shown"))
        for i in range(4):
            store(stub, sid, prompt(i, 8, 4))
        status = stub.Status(pb.StatusRequest())
        budgets = {b.tier: b for b in status.budgets}
        assert [b.tier for b in status.budgets] == ["device", "host", "disk"]
        assert budgets["device"].budget_bytes == 32 * MiB and budgets["disk"].budget_bytes == 256 * MiB
        assert budgets["disk"].log_reserve_bytes == 64 * MiB
        for b in status.budgets:  # alpha's pool holds its first extent in every tier
            assert 0 < b.tenant_used_bytes == b.used_bytes <= b.budget_bytes
        text = status_text(status, d.socket)  # what prefixctl status prints
        assert "  host budget   " in text and "used of 64.0 MiB" in text, text
        assert "64.0 MiB of it kept for the logs" in text, text
        values = dict(stub.Stats(pb.StatsRequest()).values)
        assert values['prefixd_budget_bytes{tier="host"}'] == 64 * MiB
        assert values['prefixd_used_bytes{tier="host"}'] == budgets["host"].used_bytes
        beta = d.stub(beta_socket(d))
        beta_values = dict(beta.Stats(pb.StatsRequest()).values)
        assert beta_values.get('prefixd_used_bytes{tier="host"}', 0) == 0  # alpha's are not beta's


def test_a_huge_attach_is_refused_while_the_other_tenant_keeps_committing():
    """Beta's layouts grow until refused (8 MiB blocks and a 4k-token max_model_len cannot fit
    a 32 MiB device budget); alpha commits all along, every commit succeeds and stays a hit;
    the files stay within the budgets; SIGTERM exits 0 (the harness checks)."""
    with tmpfs_base(384 * MiB) as base, DaemonProcess(config(), base=base, lease_s=600.0).start() as d:
        alpha, beta = d.stub(), d.stub(beta_socket(d))
        sid = attach(alpha, layout("steady"))
        stop, done, failures = threading.Event(), [], []

        def commit_loop():
            i = 0
            while not stop.is_set() or i < 20:
                try:
                    store(alpha, sid, prompt(i, 8, 4))
                    done.append(i)
                except grpc.RpcError as exc:  # noqa: PERF203 - a failure is the finding
                    failures.append((i, exc.code(), exc.details()))
                    return
                i += 1

        thread = threading.Thread(target=commit_loop)
        thread.start()
        refused = None
        try:
            for layers in (1, 4, 16, 32, 64):  # 64 KiB .. 8 MiB blocks
                lay = layout(f"huge-{layers}", layers=layers, heads=8, head_dim=128, block_size=16)
                try:
                    attach(beta, lay, max_model_len=4096)
                except grpc.RpcError as exc:
                    refused = (block_bytes(lay), exc)
                    break
        finally:
            stop.set()
            thread.join()
        assert refused is not None, "no layout was refused"
        nbytes, exc = refused
        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "[engine.budget] device" in exc.details() and "holds" in exc.details(), exc.details()
        assert nbytes <= 8 * MiB
        assert not failures, failures
        for i in done:
            assert alpha.Lookup(pb.LookupRequest(session_id=sid, tokens=prompt(i, 8, 4))).cached_tokens == 32
        assert taken(d.state_dir) <= 256 * MiB
        assert taken(d.shm_dir) <= (32 + 64) * MiB


def test_random_layouts_keep_every_file_within_the_budgets():
    """A few hundred Attach / Open / WriteKV / Commit calls of two tenants with random layouts
    (blocks of 512 B to 8 MiB); at every sample the files take no more than the budgets."""
    rng = random.Random(35)
    samples, refusals, stored = [], 0, 0
    with start_daemon(config(), lease_s=600.0) as d:  # raw stubs send no KeepAlive
        stubs = [d.stub(), d.stub(beta_socket(d))]
        sessions: list[tuple] = []
        for call in range(300):
            if not sessions or rng.random() < 0.1:
                bs = rng.choice((4, 16, 64))
                heads, head_dim = rng.choice(((1, 16), (2, 64), (8, 128)))
                layers = rng.choice((1, 2, 8, 32))
                lay = layout(f"r{call}", layers=layers, heads=heads, head_dim=head_dim, block_size=bs)
                if not 512 <= block_bytes(lay) <= 8 * MiB:
                    continue
                stub = rng.choice(stubs)
                try:
                    sessions.append((stub, attach(stub, lay, max_model_len=bs * 4), lay))
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc.details()
                    refusals += 1
            else:
                stub, sid, lay = rng.choice(sessions)
                tokens = prompt(rng.randrange(1000), rng.randrange(1, 5), lay.block_size)
                try:
                    seq = stub.Open(pb.OpenRequest(session_id=sid, tokens=tokens)).sequence
                    n, start = lay.block_size, seq.cached_tokens  # one block past the hit
                    if start + n < len(tokens) // 4:
                        shape = [lay.num_layers, 2, n, lay.num_kv_heads, lay.head_dim]
                        data = np.full(shape, call % 7, "<f2").tobytes()
                        chunk = pb.KVChunk(seq_id=seq.seq_id, start=start, num_tokens=n,
                                           shape=shape, dtype="float16", data=data)
                        stub.WriteKV(iter([pb.WriteKVRequest(session_id=sid, chunk=chunk)]), timeout=60)
                    stub.Commit(pb.CommitRequest(session_id=sid, seq_id=seq.seq_id, durability="crash"))
                    stub.Release(pb.ReleaseRequest(session_id=sid, seq_id=seq.seq_id))
                    stored += 1
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc.details()
            if call % 5 == 0:
                samples.append((taken(d.state_dir), taken(d.shm_dir)))
        samples.append((taken(d.state_dir), taken(d.shm_dir)))
    assert len(samples) >= 50 and stored >= 100, (len(samples), stored, refusals)
    worst_disk, worst_shm = max(s for s, _ in samples), max(m for _, m in samples)
    assert worst_disk <= 256 * MiB, samples
    assert worst_shm <= (32 + 64) * MiB, samples
    assert worst_shm > 32 * MiB  # the positive control: the budgets were reached, not idled under


QUOTA_CONFIG = """
[engine]
sync = "commit"
shm_dir = "{shm}"

[engine.budget]
device = "16MiB"
host = "16MiB"
disk = "80MiB"             # 64 MiB of it the log's room: 16 MiB for pools

[[engine.tenants]]
name = "alpha"
salt = "alpha"
RESERVED

[[engine.tenants]]
name = "beta"
salt = "beta"

[daemon]
lease_s = {lease_s}
"""


def test_reserved_bytes_keep_a_tenants_hot_prefixes_while_another_hammers():
    """Alpha reserves 8 MiB of each tier for 4 MiB of hot prefixes; beta commits ten times the
    48 MiB of the budgets in new prefixes, and between two of alpha's uses more than all of
    them; alpha's hot prefixes stay full hits. The control, without the reservation: beta's
    newer blocks evict them."""
    reserved = 'reserved = {{ device = "8MiB", host = "8MiB", disk = "8MiB" }}'  # a format template
    lay = layout("hot", layers=4, heads=8, head_dim=64, block_size=16)  # 128 KiB blocks
    for quota, want_all in ((reserved, True), ("", False)):
        with start_daemon(QUOTA_CONFIG.replace("RESERVED", quota), lease_s=600.0) as d:
            alpha, beta = d.stub(), d.stub(beta_socket(d))
            a_sid, b_sid = attach(alpha, lay), attach(beta, lay)
            hot = [prompt(i, 16, 16) for i in range(2)]  # 2 x 2 MiB
            for tokens in hot:
                store(alpha, a_sid, tokens)
            hits = total = 0
            for i in range(240):  # 240 x 2 MiB = 480 MiB: ten times the budgets
                store(beta, b_sid, prompt(100 + i, 16, 16))
                if i % 30 == 29:  # 60 MiB of beta's since alpha's last use: more than every tier
                    for tokens in hot:
                        total += 256
                        hits += alpha.Lookup(pb.LookupRequest(session_id=a_sid,
                                                              tokens=tokens)).cached_tokens
                        store(alpha, a_sid, tokens)  # alpha uses them again
        if want_all:
            assert hits == total, (hits, total)
        else:
            assert hits < total / 2, ("the control: without a reservation beta evicts them", hits)


@pytest.mark.parametrize("huge", [True])
def test_a_block_above_max_block_bytes_is_refused_naming_the_limit(huge):
    text = config() + "\n[daemon.limits]\nmax_block_bytes = 1048576\n"
    with start_daemon(text) as d:
        lay = layout("big-block", layers=32, heads=8, head_dim=128, block_size=16)  # 2 MiB
        with pytest.raises(grpc.RpcError) as err:
            attach(d.stub(), lay)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "[daemon.limits] max_block_bytes = 1048576" in err.value.details()


def test_a_start_on_a_full_filesystem_exits_1_with_one_line_naming_it_and_the_bytes():
    """The logs' room (64 MiB of the disk budget) is checked against the free space when the
    daemon starts: a filesystem filled by another file refuses the start in one line; once
    the file is gone the same state directory starts."""
    text = BUDGET_CONFIG.replace("{alpha_quota}", "").replace('disk = "256MiB"', 'disk = "128MiB"')
    with tmpfs_base(160 * MiB) as base:
        filler = os.path.join(base, "state", "filler")
        with open(filler, "wb") as f:
            f.write(b"\0" * (150 * MiB))
        daemon = DaemonProcess(text, base=base)
        try:
            log = daemon.start_refused()
            lines = [line for line in log.splitlines() if "not starting:" in line]
            assert len(lines) == 1 and "Traceback" not in log, log
            assert os.path.join(base, "state") in lines[0] and "the log needs" in lines[0], lines[0]
        finally:
            daemon.close()  # removes the base's files, the filler with them
        assert not os.path.exists(filler)
        with DaemonProcess(text, base=base).start():
            pass


def _fill(path: str) -> int:
    """Write ``path`` until the filesystem is full; returns the bytes written."""
    chunk, written = b"\xff" * MiB, 0
    with open(path, "wb", buffering=0) as f:
        while True:
            try:
                written += f.write(chunk)
            except OSError:
                break
        with contextlib.suppress(OSError):
            os.fsync(f.fileno())
    return written


def test_a_disk_filled_by_another_file_keeps_commits_going_and_service_comes_back():
    """Mid-run another file fills the state directory's filesystem: every commit at crash
    still succeeds (the log writes into its kept room, blocks stay in the host tier) and the
    recent ones stay hits, a checkpoint is taken in the log's room, no DATA_LOSS, one WARNING
    and a metric; once the file is removed,
    new blocks reach the disk tier again and the metric clears."""
    with tmpfs_base(320 * MiB) as base, DaemonProcess(config(), base=base, lease_s=600.0).start() as d:
        stub = d.stub()
        lay = layout("full-disk", layers=4, heads=8, head_dim=64, block_size=16)  # 128 KiB blocks
        sid = attach(stub, lay)

        def on_disk() -> float:
            values = dict(stub.Stats(pb.StatsRequest()).values)
            return values.get('prefixd_blocks{tier="disk",state="indexed"}', 0)

        done = []
        for i in range(20):
            store(stub, sid, prompt(i, 8, 16))
            done.append(i)
        filler = os.path.join(d.state_dir, "filler")
        assert _fill(filler) > 0
        for i in range(20, 120):  # 100 x 1 MiB: far past what the disk pool held free
            store(stub, sid, prompt(i, 8, 16))
            done.append(i)
        values = dict(stub.Stats(pb.StatsRequest()).values)
        assert values["prefixd_filesystem_full"] == 1
        assert values['prefixd_no_space_refusals_total{tier="disk"}'] > 0
        warnings = [line for line in d.log_text().splitlines()
                    if line.startswith("WARNING") and "the filesystem is full" in line]
        assert len(warnings) == 1, warnings  # one WARNING, not one per refused grow
        for i in done[-40:]:  # 40 MiB: what the host tier holds while the disk takes nothing
            assert stub.Lookup(pb.LookupRequest(session_id=sid, tokens=prompt(i, 8, 16))).cached_tokens == 128
        stub.Checkpoint(pb.CheckpointRequest())  # the log's kept room holds a checkpoint
        before = on_disk()
        os.unlink(filler)
        deadline, i = time.monotonic() + 60, 120
        while on_disk() <= before:  # write-through batches reach the disk on the daemon's tick
            assert time.monotonic() < deadline, "the disk tier took no new block once space came back"
            store(stub, sid, prompt(i, 8, 16))
            i += 1
        assert "DATA_LOSS" not in d.log_text()
        deadline = time.monotonic() + 30
        while dict(stub.Stats(pb.StatsRequest()).values)["prefixd_filesystem_full"]:
            assert time.monotonic() < deadline, "the metric still says the filesystem is full"
            store(stub, sid, prompt(i, 8, 16))
            i += 1
        assert "the filesystem has room again" in d.log_text()
        stub.Checkpoint(pb.CheckpointRequest())
