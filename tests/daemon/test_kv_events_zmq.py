"""KV events on ZMQ in vLLM's wire format, against a real daemon with two tenants: vLLM's own
decoder (``msgspec.msgpack.Decoder(KVEventBatch)`` in the vLLM venv) reads the whole stream and
counts what the daemon's Stats count; a window of dropped batches comes back by replay; the
replay protocol itself (from a number, the end marker, a malformed request); two tenants'
topics carry disjoint hashes for one prompt (with the positive control: equal prefixes give
equal hashes in one tenant); a subscriber that never reads is counted, not waited for."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import time

import pytest
import zmq

import prefixd.client as pc
from tests.daemon.harness import DaemonProcess, start_daemon, two_tenant_config
from tests.daemon.kv_sub import END_SEQ, KVSub, decode
from tests.requires import missing

ROOT = pathlib.Path(__file__).resolve().parents[2]
VLLM_PYTHON = os.environ.get("PREFIXD_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
BS = 4
LAYOUT = pc.KVLayout(model_id="kv-zmq", num_layers=1, num_kv_heads=1, head_dim=8,
                     dtype="float16", block_size=BS)

# device 24 blocks: a few 9-block prompts evict, demote to host, and host to disk
CONFIG = two_tenant_config(device=24, host=48, disk=96, tables="""
[daemon.kv_events]
endpoint = "ipc://{base}/kv"
replay_endpoint = "ipc://{base}/kvr"
buffer_batches = 4096
hwm = 16
""")

# vLLM's decoder over a file of length-prefixed payloads: counts of blocks by type and medium
DECODE = r"""
import collections, json, sys
import msgspec
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
dec = msgspec.msgpack.Decoder(KVEventBatch)
data = open(sys.argv[1], "rb").read()
pos, counts, batches = 0, collections.Counter(), 0
while pos < len(data):
    n = int.from_bytes(data[pos:pos + 4], "big")
    batch = dec.decode(data[pos + 4:pos + 4 + n])
    pos += 4 + n
    batches += 1
    assert batch.data_parallel_rank is None and batch.ts > 1.6e9, batch
    for e in batch.events:
        if isinstance(e, AllBlocksCleared):
            counts["cleared"] += 1
        elif isinstance(e, BlockStored):
            assert all(0 <= h < 2 ** 64 for h in e.block_hashes), e
            assert len(e.token_ids) in (0, len(e.block_hashes) * e.block_size), e
            counts["stored/" + e.medium] += len(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            counts["removed/" + e.medium] += len(e.block_hashes)
print(json.dumps({"batches": batches, **counts}))
"""

_prompt_ids = iter(range(1, 1 << 20))


def prompt(n: int = 37) -> list[int]:
    base = next(_prompt_ids) * 10_000
    return list(range(base, base + n))


@pytest.fixture(scope="module")
def daemon():
    with start_daemon(CONFIG) as d:
        d.expect_log(r"kv events replay request refused")
        yield d


@pytest.fixture(scope="module")
def subs(daemon):
    a = KVSub(f"ipc://{daemon.base}/kv", f"ipc://{daemon.base}/kvr")
    b = KVSub(f"ipc://{daemon.base}/kv_beta", f"ipc://{daemon.base}/kvr_beta")
    yield {"alpha": a, "beta": b}
    a.close()
    b.close()


@pytest.fixture(scope="module")
def sessions(daemon):
    out = {"alpha": pc.connect(daemon.socket, LAYOUT, "zmq-alpha"),
           "beta": pc.connect(os.path.join(os.path.dirname(daemon.socket), "beta.sock"), LAYOUT,
                              "zmq-beta")}
    yield out
    for s in out.values():
        s.close()


def commit(session, tokens) -> None:
    seq = session.open(tokens)
    session.release(seq, commit=True)


def quiesce_daemon(session) -> dict:
    """Wait until the daemon sent every batch (nothing pending); returns its Stats."""
    deadline = time.monotonic() + 60
    while (stats := session.stats())["prefixd_kv_events_pending"]:
        assert time.monotonic() < deadline, "events still pending after 60 s"
        time.sleep(0.005)
    return stats


def quiesce(sub: KVSub, session) -> dict:
    """Wait until the daemon sent every batch and ``sub`` holds them all; returns the Stats."""
    stats = quiesce_daemon(session)
    n = int(stats["prefixd_kv_events_batches_total"])
    sub.wait(lambda s: len(s.batches) >= n, f"{n} batches")
    return stats


def events_of(sub: KVSub) -> list[dict]:
    with sub.lock:
        return [e for _, p in sub.batches for e in decode(p)[1]]


def test_vllm_decoder_reads_every_batch_and_counts_match_stats(sessions, subs, tmp_path):
    alpha, sub = sessions["alpha"], subs["alpha"]
    for _ in range(12):  # 108 blocks through a 24-block device: evictions down every tier
        commit(alpha, prompt())
    stats = quiesce(sub, alpha)
    with sub.lock:
        payloads = [p for _, p in sub.batches]
        seqs = [s for s, _ in sub.batches]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) and sub.lost == 0
    assert decode(payloads[0])[1] == [{"type": "AllBlocksCleared"}]
    # the check of vLLM's decoder comes last: the later tests find the same stream either way
    if not os.path.exists(VLLM_PYTHON):
        missing(f"no vLLM venv at {VLLM_PYTHON} (make vllm-venv, or set PREFIXD_VLLM_PYTHON)")
    path = tmp_path / "stream.bin"
    path.write_bytes(b"".join(len(p).to_bytes(4, "big") + p for p in payloads))
    out = subprocess.run([VLLM_PYTHON, "-c", DECODE, str(path)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    counts = json.loads(out.stdout.strip().splitlines()[-1])
    assert counts["batches"] == len(payloads) == stats["prefixd_kv_events_batches_total"]
    assert counts["cleared"] == 1
    for kind in ("stored", "removed"):
        for medium in ("GPU", "CPU", "DISK"):
            want = stats[f'prefixd_kv_events_{kind}_blocks_total{{medium="{medium}"}}']
            assert counts.get(f"{kind}/{medium}", 0) == want, (kind, medium, counts, want)
    # the stream moved blocks through every tier, and Stats agree with the cache's own counts
    for key in ("stored/GPU", "stored/CPU", "stored/DISK", "removed/GPU", "removed/CPU"):
        assert counts.get(key, 0) > 0, (key, counts)
    assert counts["stored/GPU"] >= stats["prefixd_committed_blocks_total"] > 0


def test_a_dropped_window_comes_back_by_replay(sessions, subs):
    alpha, sub = sessions["alpha"], subs["alpha"]
    quiesce(sub, alpha)
    before, received = sub.replays, sub.received
    sub.skip_live(5)
    while sub.received < received + 8:  # each commit its own batch: 5 dropped, then 3 more
        commit(alpha, prompt())
        quiesce_daemon(alpha)
    quiesce(sub, alpha)
    with sub.lock:
        seqs = [s for s, _ in sub.batches]
    assert sub.replays > before and sub.lost == 0
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))


def test_the_replay_protocol(daemon, sessions, subs):
    alpha, sub = sessions["alpha"], subs["alpha"]
    commit(alpha, prompt())
    quiesce(sub, alpha)
    with sub.lock:
        kept = list(sub.batches)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"ipc://{daemon.base}/kvr")
    try:
        start = kept[-3][0]
        sock.send_multipart((b"", start.to_bytes(8, "big")))
        got = []
        while True:
            assert sock.poll(10_000), "no answer to a replay request"
            frames = sock.recv_multipart()
            if frames[2] == END_SEQ:
                assert frames == [b"", b"", END_SEQ, b""]
                break
            assert frames[1] == b"alpha"
            got.append((int.from_bytes(frames[2], "big"), frames[3]))
        assert got == kept[-3:]
        sock.send_multipart((b"", b"\x01\x02"))  # not an 8-byte number: the end marker only
        assert sock.poll(10_000)
        assert sock.recv_multipart() == [b"", b"", END_SEQ, b""]
    finally:
        sock.close(0)


def test_tenants_topics_carry_disjoint_hashes(sessions, subs):
    shared = prompt(21)  # 5 full blocks
    longer = shared + list(range(7, 7 + 16))  # 9 full blocks, the first 5 the same
    for name in ("alpha", "beta"):
        commit(sessions[name], shared)
    commit(sessions["alpha"], longer)
    hashes = {}
    for name in ("alpha", "beta"):
        quiesce(subs[name], sessions[name])
        stored = [e for e in events_of(subs[name])
                  if e["type"] == "BlockStored" and e["token_ids"][:BS] == shared[:BS]]
        hashes[name] = stored
        assert subs[name].topics == {name.encode()}
    a_hashes = {h for e in hashes["alpha"] for h in e["block_hashes"]}
    b_hashes = {h for e in hashes["beta"] for h in e["block_hashes"]}
    assert a_hashes and b_hashes and not a_hashes & b_hashes
    # the control: in one tenant, the longer prompt's run hangs off the shared prefix's hash
    first = hashes["alpha"][0]
    assert len(first["block_hashes"]) == 5
    tails = [e for e in events_of(subs["alpha"]) if e["type"] == "BlockStored"
             and e["token_ids"][:BS] == longer[5 * BS:6 * BS]]
    assert tails and tails[0]["parent_block_hash"] == first["block_hashes"][-1]


def test_a_subscriber_that_never_reads_is_counted_not_waited_for(daemon, sessions, subs):
    alpha = sessions["alpha"]
    ctx = zmq.Context.instance()
    stuck = ctx.socket(zmq.SUB)
    stuck.setsockopt(zmq.RCVHWM, 1)
    stuck.setsockopt(zmq.RCVBUF, 4096)
    stuck.setsockopt(zmq.SUBSCRIBE, b"")
    stuck.connect(f"ipc://{daemon.base}/kv")
    try:
        time.sleep(0.3)  # the subscription reaches the publisher (ZMQ's slow joiner)
        dropped = alpha.stats()["prefixd_kv_events_dropped_batches_total"]
        deadline = time.monotonic() + 120
        while alpha.stats()["prefixd_kv_events_dropped_batches_total"] == dropped:
            assert time.monotonic() < deadline, "no batch counted dropped"
            for _ in range(20):
                commit(alpha, prompt(61))
    finally:
        stuck.close(0)
    # the reading subscriber got every batch all the same, the dropped ones by replay (a gap
    # shows at the next batch: one more)
    commit(alpha, prompt())
    quiesce(subs["alpha"], alpha)
    assert subs["alpha"].lost == 0


def test_a_pool_closed_empty_and_opened_again_publishes_its_blocks_from_the_root(daemon, sessions, subs):
    """An empty pool no session uses is closed; the next Attach opens it with a new tree, and
    the publisher serves that one (not the closed pool's): a prompt committed after the reopen
    goes out as one run from the root, and a longer one hangs off it."""
    alpha, sub = sessions["alpha"], subs["alpha"]
    layout = pc.KVLayout(model_id="kv-zmq-closing", num_layers=1, num_kv_heads=1, head_dim=8,
                         dtype="float16", block_size=BS)
    for _ in range(2):  # closed twice: nothing of a closed pool is kept, each time
        closes = daemon.log_text().count("pool closed")
        s = pc.connect(daemon.socket, layout, "zmq-closing")
        s.release(s.open(prompt()))  # nothing committed: the pool stays empty
        s.close()
        deadline = time.monotonic() + 60
        while daemon.log_text().count("pool closed") == closes:
            assert time.monotonic() < deadline, "the empty pool was not closed"
            time.sleep(0.05)
    s = pc.connect(daemon.socket, layout, "zmq-closing")
    try:
        first = prompt(21)  # 5 full blocks
        longer = first + list(range(9, 9 + 8))  # 2 more on the same prefix
        commit(s, first)
        commit(s, longer)
        quiesce(sub, alpha)
    finally:
        s.close()
    stored = [e for e in events_of(sub) if e["type"] == "BlockStored" and e["medium"] == "GPU"
              and e["token_ids"][:BS] in (first[:BS], longer[5 * BS:6 * BS])]
    assert [len(e["block_hashes"]) for e in stored] == [5, 2], stored
    assert stored[0]["parent_block_hash"] is None and stored[0]["token_ids"] == first[:5 * BS]
    assert stored[1]["parent_block_hash"] == stored[0]["block_hashes"][-1]


def test_an_endpoint_another_process_holds_stops_the_start_with_one_line():
    holder = zmq.Context.instance().socket(zmq.PUB)
    holder.setsockopt(zmq.LINGER, 0)
    port = holder.bind_to_random_port("tcp://127.0.0.1")
    daemon = DaemonProcess(f'[daemon.kv_events]\nendpoint = "tcp://127.0.0.1:{port}"\n')
    try:
        log = daemon.start_refused()
        assert f"cannot bind tcp://127.0.0.1:{port}" in log and "Traceback" not in log, log
    finally:
        daemon.close()
        holder.close(0)
