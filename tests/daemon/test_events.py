"""KV events for routers against a real daemon (``SubscribeEvents``): stored
events of a commit with the right chained hashes and tiers, removed events on eviction, a
replay-from after a disconnect that misses and repeats nothing, ``cleared`` for a number older
than the ring, tenant isolation (with a positive control), a slow subscriber cut off with
RESOURCE_EXHAUSTED while the daemon stays healthy, the client library's iterator and
``prefixctl events``, the session check, and the stream's end at SIGTERM (last: it stops the
module's daemon)."""

from __future__ import annotations

import json
import os
import threading
import time

import grpc
import numpy as np
import pytest
import xxhash

import prefixd.client as pc
from prefixd.api import prefixd_pb2 as pb
from prefixd.client import ctl, kv_events
from tests.daemon.harness import start_daemon, two_tenant_config

BS = 4
LAYOUT = pb.KVLayout(model_id="events-test", num_layers=1, num_kv_heads=1, head_dim=8,
                     dtype="float16", block_size=BS)
RING = 256
QUEUE = 64

# a device pool of 24 blocks: three 9-block prompts evict; alpha's socket is s.sock, beta's
# beta.sock beside it
CONFIG = two_tenant_config(device=24, host=512, disk=1024, tables=f"""
[daemon.events]
ring_size = {RING}
subscriber_queue = {QUEUE}
""")

_prompt_ids = iter(range(1, 1 << 20))


def new_prompt(num_tokens: int = 37) -> bytes:
    """Token ids no other prompt of this module starts with."""
    base = next(_prompt_ids) * 10_000
    return np.arange(base, base + num_tokens, dtype="<i4").tobytes()


@pytest.fixture(scope="module")
def daemon():
    # a lease no test here outlasts: each attaches, then waits for the stream to settle
    # (seconds on a loaded host) without keep-alives; leases have tests of their own
    with start_daemon(CONFIG, lease_s=60.0) as d:
        yield d


@pytest.fixture(scope="module")
def alpha(daemon):
    return daemon.stub(daemon.socket)


@pytest.fixture(scope="module")
def beta(daemon):
    return daemon.stub(os.path.join(os.path.dirname(daemon.socket), "beta.sock"))


def attach(stub) -> pb.AttachReply:
    return stub.Attach(pb.AttachRequest(client_name="events-test", layout=LAYOUT))


def commit(stub, sid: int, prompt: bytes) -> None:
    seq = stub.Open(pb.OpenRequest(session_id=sid, tokens=prompt)).sequence
    stub.Commit(pb.CommitRequest(session_id=sid, seq_id=seq.seq_id))
    stub.Release(pb.ReleaseRequest(session_id=sid, seq_id=seq.seq_id))


def head(stub) -> int:
    """The tenant's newest event number (numbers are 1..emitted)."""
    return int(dict(stub.Stats(pb.StatsRequest()).values)["prefixd_events_emitted_total"])


def settled_head(stub, quiet_s: float = 0.5, timeout_s: float = 30.0) -> int:
    """``head`` once no event came for ``quiet_s`` (five of the daemon's ticks, which spill
    to disk and demote after the commits stop, each with events). A test that takes its
    first number from it sees its own events first, not the tail of the test before."""
    deadline = time.monotonic() + timeout_s
    last, since = head(stub), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = head(stub)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return now
    raise AssertionError(f"events still coming after {timeout_s} s (head {last})")


def read_until(stub, from_number: int, epoch: int, done, session_id: int = 0) -> list:
    """Events from ``from_number`` until ``done(events)``; the stream is then cancelled."""
    got = []
    for event in kv_events.subscribe(stub, session_id, from_number, epoch, timeout=60):
        got.append(event)
        if done(got):
            return got
    raise AssertionError(f"stream ended early after {got}")


def chained(parent: bytes, tokens: bytes) -> list[bytes]:
    """The block hashes of DESIGN.md "Blocks and their identity", computed here."""
    out = []
    for start in range(0, len(tokens) - len(tokens) % (4 * BS), 4 * BS):
        parent = xxhash.xxh3_128_digest(parent + tokens[start:start + 4 * BS])
        out.append(parent)
    return out


def has(kind: str, tier: str, hashes):
    hashes = tuple(hashes)
    return lambda got: any(e.kind == kind and e.tier == tier and e.block_hashes == hashes
                           for e in got)


def test_commit_publishes_stored_events_with_chained_hashes_per_tier(alpha):
    reply = attach(alpha)
    sid, start = reply.session_id, settled_head(alpha)
    prompt = new_prompt(37)  # 9 full blocks
    commit(alpha, sid, prompt)
    got = read_until(alpha, start, reply.epoch, lambda g: any(e.tier == "disk" for e in g))
    assert [e.sequence_number for e in got] == list(range(start + 1, start + 1 + len(got)))
    assert all(e.epoch == reply.epoch and e.model_id == "events-test" and e.block_size == BS
               for e in got)
    device = got[0]
    assert (device.kind, device.tier) == ("stored", "device")
    assert device.token_ids == tuple(np.frombuffer(prompt, "<i4")[:36].tolist())
    hashes = chained(device.parent_block_hash, prompt[:36 * 4])
    assert list(device.block_hashes) == hashes
    # write-through: the same blocks land in host and disk
    assert {(e.kind, e.tier) for e in got} == {("stored", "device"), ("stored", "host"),
                                               ("stored", "disk")}
    assert all(list(e.block_hashes) == hashes for e in got)
    # a commit extending the prompt chains on its last block
    longer = prompt[:36 * 4] + new_prompt(9)
    commit(alpha, sid, longer)
    more = read_until(alpha, got[-1].sequence_number, reply.epoch,
                      lambda g: any(e.tier == "device" for e in g))
    stored = [e for e in more if e.tier == "device"][0]
    assert stored.parent_block_hash == hashes[-1]
    assert list(stored.block_hashes) == chained(hashes[-1], longer[36 * 4:])


def test_eviction_publishes_removed_device_events(alpha):
    reply = attach(alpha)
    sid, start = reply.session_id, settled_head(alpha)
    prompts = [new_prompt(37) for _ in range(4)]  # 36 blocks through a 24-block device pool
    for p in prompts:
        commit(alpha, sid, p)
    newest = head(alpha)
    everything = read_until(alpha, 0, reply.epoch, lambda g: g[-1].sequence_number == newest)
    assert everything[0].sequence_number == 1  # the ring still holds this module's first
    got = [e for e in everything if e.sequence_number > start]
    removed = [e for e in got if e.kind == "removed"]
    assert removed, "a full device pool evicted nothing"
    assert {e.tier for e in removed} == {"device"}  # host and disk have room
    on_device: set[bytes] = set()  # replaying the stream: every removal names a stored block
    for e in everything:
        if e.tier == "device":
            if e.kind == "stored":
                on_device.update(e.block_hashes)
            else:
                assert set(e.block_hashes) <= on_device, e
                on_device.difference_update(e.block_hashes)
    assert len(on_device) <= 24
    first = set(got[0].block_hashes)  # least recently used: this test's first prompt left
    assert got[0].kind == "stored" and first & {h for e in removed for h in e.block_hashes}


def test_replay_after_a_disconnect_misses_nothing_and_repeats_nothing(daemon, alpha):
    """A router reads part of the stream, disconnects while blocks keep changing, and
    resubscribes from the last number it got (client library): together its two streams are
    exactly what a subscriber that never left received."""
    reply = attach(alpha)
    sid, start = reply.session_id, settled_head(alpha)
    with pc.connect(daemon.socket, pc.KVLayout(**_layout()), mapped=False) as session:
        steady = session.subscribe_events(start, reply.epoch)
        commit(alpha, sid, new_prompt(37))
        first = []
        for event in session.subscribe_events(start, reply.epoch):
            first.append(event)
            if event.tier == "host":
                break  # disconnects (the iterator cancels its stream)
        for _ in range(3):
            commit(alpha, sid, new_prompt(37))
        end = head(alpha)
        last = first[-1]
        second = []
        for event in session.subscribe_events(last.sequence_number, last.epoch):
            second.append(event)
            if event.sequence_number >= end:
                break
        whole = []
        for event in steady:
            whole.append(event)
            if event.sequence_number >= end:
                break
        steady.close()
    assert all(isinstance(e, pc.KVEvent) for e in first + second)
    assert "cleared" not in {e.kind for e in second}
    assert first + second == whole
    assert [e.sequence_number for e in whole] == list(range(start + 1, end + 1))


def test_a_number_older_than_the_ring_begins_with_cleared(alpha):
    reply = attach(alpha)
    sid, start = reply.session_id, settled_head(alpha)
    while head(alpha) < start + RING + 10:
        commit(alpha, sid, new_prompt(9))
    newest = settled_head(alpha)
    oldest = newest - RING + 1
    got = read_until(alpha, start, reply.epoch, lambda g: g[-1].sequence_number == newest)
    assert got[0].kind == "cleared" and got[0].sequence_number == oldest - 1
    assert got[0].epoch == reply.epoch and got[0].block_hashes == ()
    assert [e.sequence_number for e in got[1:]] == list(range(oldest, newest + 1))
    # another daemon start's epoch: cleared too; the positive control: a held number is not
    assert read_until(alpha, newest - 3, reply.epoch + 1, lambda g: True)[0].kind == "cleared"
    control = read_until(alpha, newest - 3, reply.epoch, lambda g: len(g) == 3)
    assert [e.sequence_number for e in control] == [newest - 2, newest - 1, newest]
    assert "cleared" not in {e.kind for e in control}


def test_tenants_never_see_each_others_events(alpha, beta):
    """The same prompt committed on alpha then on beta: beta's stream, opened before both,
    holds beta's commit and nothing of alpha's; alpha's stream (the positive control) holds
    alpha's. Numbers are per tenant."""
    a, b = attach(alpha), attach(beta)
    a_start, b_start = settled_head(alpha), settled_head(beta)
    prompt = new_prompt(37)
    commit(alpha, a.session_id, prompt)
    commit(beta, b.session_id, prompt)
    a_got = read_until(alpha, a_start, a.epoch, has_tier("host"))
    b_got = read_until(beta, b_start, b.epoch, has_tier("host"))
    a_hashes = {h for e in a_got if e.kind == "stored" for h in e.block_hashes}
    b_hashes = {h for e in b_got for h in e.block_hashes}
    assert len(a_hashes) == 9 and len(b_hashes) == 9
    assert {e.kind for e in b_got} == {"stored"}  # beta's device pool evicted none of alpha's
    assert not a_hashes & b_hashes
    assert b_got[0].sequence_number == b_start + 1
    assert chained(b_got[0].parent_block_hash, prompt[:144]) == list(b_got[0].block_hashes)
    # a session of another tenant is NOT_FOUND on this socket, like an unknown one
    with pytest.raises(pc.NotFound):
        read_until(beta, 0, 0, lambda g: True, session_id=a.session_id)


def test_a_slow_subscriber_is_cut_off_and_the_daemon_stays_healthy(daemon, alpha):
    """A router that stops reading: its stream ends RESOURCE_EXHAUSTED once it lags
    ``subscriber_queue`` events (gRPC's own buffers full), the daemon keeps serving, and the
    router resumes from its last number with nothing missed."""
    reply = attach(alpha)
    sid, start = reply.session_id, settled_head(alpha)
    channel = grpc.insecure_channel("unix:" + daemon.socket, options=[("grpc.http2.bdp_probe", 0)])
    slow = kv_events.subscribe(pb_stub(channel), 0, start, reply.epoch, timeout=120)
    commit(alpha, sid, new_prompt(9))
    first = next(slow)  # the stream is live
    overflows = stat(alpha, "prefixd_event_overflows_total")
    # events of 22 blocks (~400 bytes of hashes, as many of tokens); it took 52 commits here
    for _ in range(1000):
        if stat(alpha, "prefixd_event_overflows_total") > overflows:
            break
        commit(alpha, sid, new_prompt(89))
    assert stat(alpha, "prefixd_event_overflows_total") == overflows + 1
    received = [first]
    with pytest.raises(pc.ResourceExhausted, match="subscribe again with from_sequence_number"):
        for event in slow:
            received.append(event)
    channel.close()
    assert [e.sequence_number for e in received] == list(range(start + 1, start + 1 + len(received)))
    # healthy: serves, commits, and a resume from the last number misses nothing
    assert alpha.Status(pb.StatusRequest()).state == "serving"
    commit(alpha, sid, new_prompt(9))
    newest = settled_head(alpha)
    last = received[-1].sequence_number
    resumed = read_until(alpha, last, reply.epoch, lambda g: g[-1].sequence_number == newest)
    if resumed[0].kind == "cleared":  # the ring moved past it: a documented gap, numbered
        assert resumed[0].sequence_number == newest - RING
        resumed = resumed[1:]
    assert [e.sequence_number for e in resumed] == list(range(resumed[0].sequence_number,
                                                              newest + 1))
    assert stat(alpha, "prefixd_event_subscribers") == 0


def test_prefixctl_events_prints_one_event_per_line(daemon, alpha, capsys):
    reply = attach(alpha)
    start = settled_head(alpha)
    commit(alpha, reply.session_id, new_prompt(9))
    rc = ctl.main(["--socket", daemon.socket, "--timeout", "2", "events", "--from", str(start),
                   "--epoch", str(reply.epoch), "--json"])
    assert rc == ctl.EXIT_OK
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[0]["sequence_number"] == start + 1 and lines[0]["kind"] == "stored"
    assert lines[0]["tier"] == "device" and len(lines[0]["block_hashes"]) == 2
    assert [doc["sequence_number"] for doc in lines] == list(range(start + 1, start + 1 + len(lines)))


def test_a_stream_naming_a_session_ends_with_it(alpha):
    """A subscription made with a session id (the client library's) is checked like every
    rpc's and ends NOT_FOUND once that session ends; one without (0) is the socket's."""
    reply = attach(alpha)
    start = settled_head(alpha)
    mine = kv_events.subscribe(alpha, reply.session_id, start, reply.epoch, timeout=60)
    anyone = kv_events.subscribe(alpha, 0, start, reply.epoch, timeout=60)
    commit(alpha, reply.session_id, new_prompt(9))
    assert next(mine).sequence_number == start + 1 == next(anyone).sequence_number
    alpha.Detach(pb.DetachRequest(session_id=reply.session_id))
    with pytest.raises(pc.NotFound, match="ended"):
        for _ in mine:
            pass
    other = attach(alpha)
    commit(alpha, other.session_id, new_prompt(9))
    assert next(anyone).sequence_number == start + 2  # the socket's stream goes on
    anyone.close()


def test_sigterm_ends_the_stream_unavailable(daemon, alpha):
    """Last in the module: it stops the daemon. A live stream ends UNAVAILABLE, naming where
    to resume, and the daemon exits 0 (the stream does not hold the drain)."""
    reply = attach(alpha)
    start = settled_head(alpha)
    outcome = {}
    ready = threading.Event()

    def reader():
        try:
            for event in kv_events.subscribe(alpha, 0, start, reply.epoch, timeout=120):
                outcome.setdefault("events", []).append(event)
                ready.set()
        except pc.PrefixdError as exc:
            outcome["error"] = exc
        ready.set()

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    commit(alpha, reply.session_id, new_prompt(9))
    assert ready.wait(60)
    assert daemon.stop() == 0
    thread.join(60)
    assert isinstance(outcome.get("error"), pc.Unavailable), outcome
    assert "shutting down" in str(outcome["error"])
    assert outcome["events"][0].sequence_number == start + 1


# -- helpers ----------------------------------------------------------------------------------------


def has_tier(tier: str):
    return lambda got: any(e.tier == tier for e in got)


def stat(stub, key: str) -> float:
    return dict(stub.Stats(pb.StatsRequest()).values).get(key, 0.0)


def pb_stub(channel):
    from prefixd.api import prefixd_pb2_grpc as pb_grpc

    return pb_grpc.PrefixCacheStub(channel)


def _layout() -> dict:
    return dict(model_id=LAYOUT.model_id, num_layers=LAYOUT.num_layers,
                num_kv_heads=LAYOUT.num_kv_heads, head_dim=LAYOUT.head_dim, dtype=LAYOUT.dtype,
                block_size=LAYOUT.block_size)
