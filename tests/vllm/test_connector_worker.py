"""The connector's worker side against a real daemon (main venv: tensors shaped like vLLM's
CPU_ATTN ones, no vLLM): saves into the mapped pool, loads back, and a daemon kill -9 in
between turns copies into misses until both sessions are on the new daemon."""

import time

import pytest
import torch

from prefixd.api.layout import KVLayout
from prefixd.client import connect
from prefixd.client.vllm.daemon_link import DaemonLink
from prefixd.client.vllm.metadata import StepPlan, Transfer
from prefixd.client.vllm.worker import WorkerSide
from tests.daemon.harness import start_daemon

L, H, D, BS, B = 2, 2, 16, 32, 8
LAYOUT = KVLayout("connector-worker", L, H, D, "bfloat16", BS)
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
LEASE_S = 3.0


def _tensors(seed=None):
    if seed is None:
        return {n: torch.zeros(B, H, BS, 2 * D, dtype=torch.bfloat16) for n in NAMES}
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(B, H, BS, 2 * D, generator=g).to(torch.bfloat16) for n in NAMES}


def _worker(socket, tensors):
    link = DaemonLink(socket, LAYOUT, "test-worker", mapped=True, timeout_s=5, retry_s=0.2)
    w = WorkerSide(link, NAMES, num_kv_heads=H, head_dim=D, block_size=BS)
    assert w.register(tensors, {n: "CPU_ATTN" for n in NAMES})
    return w


@pytest.fixture(scope="module")
def daemon():
    with start_daemon(lease_s=LEASE_S) as d:
        yield d



def _compute_and_save(scheduler, worker, req_id, prompt, block_ids=(4, 5, 6, 7)) -> None:
    """One request that misses: the scheduler plans it, the worker saves its full blocks, and
    the report reaches the scheduler (which commits the prompt)."""
    assert scheduler.num_new_matched_tokens(req_id, prompt, 0) == 0
    scheduler.after_alloc(req_id, prompt, 0)
    plan = scheduler.build_plan([(req_id, list(block_ids), 0)], [], {req_id: len(prompt)})
    worker.load(plan)
    worker.save(plan)
    scheduler.on_report(worker.take_report())

def test_saved_blocks_load_back_into_other_blocks(daemon):
    tokens = list(range(1000, 1000 + 2 * BS + 3))
    src, dst = _tensors(1), _tensors()
    with connect(daemon.socket, LAYOUT, mapped=False) as s:
        seq = s.open(tokens)
        w = _worker(daemon.socket, src)
        w.save(StepPlan(epoch=s.epoch, saves=[Transfer("r", (6, 3), tuple(seq.block_table[:2]))]))
        assert w.take_report().saved == {"r": {0: 2}}
        s.release(seq, commit=True)
        seq2 = s.open(tokens)
        assert seq2.cached_tokens == 2 * BS
        w2 = _worker(daemon.socket, dst)
        w2.load(StepPlan(epoch=s.epoch, loads=[Transfer("q", (0, 1), tuple(seq2.block_table[:2]))]))
        assert w2.take_load_errors() == set()
        for n in NAMES:
            assert torch.equal(dst[n][0], src[n][6]) and torch.equal(dst[n][1], src[n][3])
            assert dst[n][2:].eq(0).all()
        w.check_invariants()
        w.close()
        w2.close()


def test_two_connectors_share_a_prompt_while_the_first_still_decodes(daemon):
    """Both halves over the real daemon: vLLM A computes a prompt, its saves commit it at once;
    vLLM B (its own sessions) asks while A's request is still running and loads A's blocks."""
    from prefixd.client.vllm.scheduler import SchedulerSide

    def scheduler(name):
        return SchedulerSide(DaemonLink(daemon.socket, LAYOUT, name, mapped=False, timeout_s=5, retry_s=0.2),
                             BS, "crash")

    prompt = list(range(9000, 9000 + 3 * BS + 7))
    src, dst = _tensors(3), _tensors()
    a, wa = scheduler("vllm-a"), _worker(daemon.socket, src)
    _compute_and_save(a, wa, "a1", prompt)
    b, wb = scheduler("vllm-b"), _worker(daemon.socket, dst)
    assert b.num_new_matched_tokens("b1", prompt, 0) == 3 * BS
    b.after_alloc("b1", prompt, 3 * BS)
    plan = b.build_plan([("b1", [0, 1, 2, 3], 0)], [], {"b1": 7})
    wb.load(plan)
    assert wb.take_load_errors() == set() and plan.saves == []
    for n in NAMES:
        assert torch.equal(dst[n][0:3], src[n][4:7])
    for side, req in ((a, "a1"), (b, "b1")):
        side.finished(req)
        side.check_invariants()
        side.shutdown()
    assert (a.stats.committed, b.stats.hit_tokens) == (1, 3 * BS)
    wa.close()
    wb.close()


def test_copies_under_a_dead_daemons_epoch_are_misses_until_both_sessions_recover(daemon):
    """Regression: the worker makes no daemon call of its own, so after a daemon restart its
    session stayed on the dead lease (the library's background reconnect gave up within the
    connector's short backoff) and every later copy was a miss; a lost lease now makes the
    worker call the daemon, which recovers the session."""
    tokens = list(range(5000, 5000 + 2 * BS + 1))
    src = _tensors(2)
    with connect(daemon.socket, LAYOUT, mapped=False) as s:
        w = _worker(daemon.socket, src)
        seq = s.open(tokens)
        old_epoch, old_slot = s.epoch, seq.block_table[0]  # a background recovery may clear the handle
        daemon.kill()
        daemon.restart()
        # the old epoch's slots are never copied through, whatever the sessions know yet
        w.save(StepPlan(epoch=old_epoch, saves=[Transfer("r", (0,), (old_slot,))]))
        w.load(StepPlan(epoch=old_epoch, loads=[Transfer("r", (1,), (old_slot,))]))
        assert w.take_report().failed == {"r"}
        assert w.take_load_errors() == {1}
        s.lookup(tokens)  # the scheduler's session recovers on its next call
        assert s.epoch != old_epoch
        seq = s.open(tokens)
        deadline = time.monotonic() + 30
        while True:  # the worker's link skips calls for retry_s after the failures above
            w.save(StepPlan(epoch=s.epoch, saves=[Transfer("r", (0, 1), tuple(seq.block_table[:2]))]))
            report = w.take_report()
            if report.saved == {"r": {0: 2}} or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert report.saved == {"r": {0: 2}}
        s.release(seq, commit=True)
        assert s.open(tokens).cached_tokens == 2 * BS
        w.close()


def test_an_idle_connector_hits_on_its_first_request_after_a_daemon_restart(daemon):
    """An idle vLLM across a daemon kill -9 and restart (issue 14 follow-up: a vLLM that sat
    idle did not show its sessions on the new daemon, and its next request was suspected to
    miss). Neither half calls the daemon while idle, so each sits on its dead session (the
    library's background reconnect gives up within the connector's 0.3 s backoff) while the
    daemon is down and then up, each longer than a lease and its keep-alive interval. The first
    request after must be a whole external hit loaded byte for byte, with no outage counted:
    its first call re-attaches each half."""
    from prefixd.client.vllm.scheduler import SchedulerSide

    prompt = list(range(7000, 7000 + 3 * BS + 7))
    src = _tensors(4)
    a = SchedulerSide(DaemonLink(daemon.socket, LAYOUT, "idle-scheduler", mapped=False, timeout_s=5, retry_s=2.0),
                      BS, "crash")
    w = _worker(daemon.socket, src)
    _compute_and_save(a, w, "r1", prompt)
    a.finished("r1")
    assert a.stats.committed == 1
    old_epoch, saved = a.link.epoch(), {n: src[n][4:7].clone() for n in NAMES}
    daemon.kill()
    time.sleep(LEASE_S + 0.5)  # down past the lease
    daemon.start()
    time.sleep(LEASE_S + LEASE_S / 3 + 0.5)  # idle past a lease and a keep-alive interval

    assert a.num_new_matched_tokens("r2", prompt, 0) == 3 * BS
    a.after_alloc("r2", prompt, 3 * BS)
    plan = a.build_plan([("r2", [0, 1, 2, 3], 0)], [], {"r2": 7})
    w.load(plan)
    assert w.take_load_errors() == set() and plan.loads and plan.saves == []
    for n in NAMES:
        assert torch.equal(src[n][0:3], saved[n])
    a.finished("r2")
    assert a.link.epoch() == w.link.epoch() != old_epoch
    for link in (a.link, w.link):
        assert (link.stats.outages, link.stats.skipped, link.stats.failed) == (0, 0, 0), link.stats
        assert link.session.recoveries == 1
    a.check_invariants()
    w.check_invariants()
    a.shutdown()
    w.close()
