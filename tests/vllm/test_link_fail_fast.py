"""The connector's daemon link over a real daemon process (main venv, no vLLM): nothing on
vLLM's engine thread waits longer than the request deadline, whether the daemon is absent,
hung (SIGSTOP) or killed, and hits come back once it answers.

The bound is the deadline plus ``MARGIN_S`` (tests/client/test_fail_fast.py says why).
"""

import logging
import os
import signal
import time

from prefixd.api.layout import KVLayout
from prefixd.client.breaker import DEFAULT_REQUEST_TIMEOUT_MS
from prefixd.client.vllm.daemon_link import DaemonLink
from prefixd.client.vllm.scheduler import SchedulerSide
from tests.daemon.harness import start_daemon

BS = 4
LAYOUT = KVLayout("link-ff", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32", block_size=BS)
DEADLINE_MS = DEFAULT_REQUEST_TIMEOUT_MS  # the default: a healthy loaded daemon must not trip it
MARGIN_S = 0.75
BOUND_S = DEADLINE_MS / 1000 + MARGIN_S
SMALL_POOL = """
[engine]
shm_dir = "{shm}"

[engine.blocks]
device = 16
host = 16
disk = 0

[daemon]
lease_s = {lease_s}
"""


def timed(fn):
    t0 = time.monotonic()
    out = fn()
    return time.monotonic() - t0, out


def admit(side, req_id, prompt):
    n = side.num_new_matched_tokens(req_id, prompt, 0)
    side.after_alloc(req_id, prompt, n)
    return n


def commit_prompt(side, prompt):
    """One request whose prompt the scheduler commits (the worker's saves reported)."""
    from prefixd.client.vllm.metadata import SaveReport

    admit(side, "warm", prompt)
    side.build_plan([("warm", list(range(len(prompt) // BS + 1)), 0)], [], {"warm": len(prompt)})
    side.on_report(SaveReport({"warm": {0: len(prompt) // BS}}))
    side.finished("warm")
    assert side.stats.committed == 1


def test_absent_socket_costs_the_first_call_at_most_the_deadline_and_warns_once(caplog, tmp_path):
    link = DaemonLink(str(tmp_path / "none.sock"), LAYOUT, "absent", mapped=False, timeout_s=5, retry_s=0.2,
                      request_timeout_ms=DEADLINE_MS)
    with caplog.at_level(logging.WARNING, logger="prefixd.client.vllm"):
        took = [timed(lambda: link.call("open", lambda s: s.open([1] * 8), "miss")) for _ in range(20)]
    assert all(out == "miss" for _, out in took)
    assert max(t for t, _ in took) <= BOUND_S, took
    lines = [r.getMessage() for r in caplog.records if "reason=socket absent" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    link.close()
    link.check_invariants()


def test_hung_then_killed_daemon_costs_each_request_at_most_the_deadline():
    prompt = list(range(300, 300 + 3 * BS + 1))
    with start_daemon(lease_s=60.0) as d:
        link = DaemonLink(d.socket, LAYOUT, "sched", mapped=False, timeout_s=10, retry_s=0.2,
                          request_timeout_ms=DEADLINE_MS)
        assert link.start(30.0)
        side = SchedulerSide(link, BS, "crash")
        commit_prompt(side, prompt)
        assert admit(side, "hit", prompt) == 3 * BS
        side.finished("hit")

        os.kill(d.pid(), signal.SIGSTOP)
        try:
            took = []
            for i in range(15):
                took.append(timed(lambda: admit(side, f"hung{i}", prompt)))
                side.finished(f"hung{i}")
                time.sleep(0.2)
        finally:
            os.kill(d.pid(), signal.SIGCONT)
        assert all(n == 0 for _, n in took), "a hung daemon is a miss"
        assert max(t for t, _ in took) <= BOUND_S, took
        assert link.session.breaker.stats.trips >= 1 and link.stats.skipped >= 10

        t0 = time.monotonic()
        while admit(side, "back", prompt) != 3 * BS:  # poll: the probe closes the breaker
            side.finished("back")
            assert time.monotonic() - t0 < 2.0, "hits back within 2 s of SIGCONT"
            time.sleep(0.01)
        side.finished("back")

        d.kill()
        took = []
        for i in range(10):
            took.append(timed(lambda: admit(side, f"dead{i}", prompt)))
            side.finished(f"dead{i}")
            time.sleep(0.2)
        assert all(n == 0 for _, n in took) and max(t for t, _ in took) <= BOUND_S, took
        d.start()
        t0 = time.monotonic()
        while admit(side, "again", prompt) != 3 * BS:  # the probe re-attached in the background
            side.finished("again")
            assert time.monotonic() - t0 < 5.0, "hits back after the restart"
            time.sleep(0.01)
        side.finished("again")
        side.check_invariants()
        side.shutdown()


def test_a_pool_too_small_for_max_model_len_is_said_once_and_every_call_misses_at_once(caplog):
    """The daemon refuses the Attach (RESOURCE_EXHAUSTED naming the key); the connector says
    so at WARNING once (not per request) and answers every request as a miss without waiting."""
    with start_daemon(SMALL_POOL) as d:
        link = DaemonLink(d.socket, LAYOUT, "small", mapped=False, timeout_s=10, retry_s=0.2,
                          request_timeout_ms=DEADLINE_MS, max_model_len=4096)
        with caplog.at_level(logging.WARNING, logger="prefixd.client.vllm"):
            link.start()
            t0 = time.monotonic()
            while not link.stats.connect_failures:
                assert time.monotonic() - t0 < 60
                time.sleep(0.01)
            took = [timed(lambda: link.call("open", lambda s: s.open([1] * 8), "miss")) for _ in range(20)]
        assert all(out == "miss" for _, out in took) and max(t for t, _ in took) <= BOUND_S, took
        lines = [r.getMessage() for r in caplog.records if "reason=pool too small" in r.getMessage()]
        assert len(lines) == 1, [r.getMessage() for r in caplog.records]
        assert "[engine.blocks] device" in lines[0] and "max_model_len=4096" in lines[0]
        assert link.session is None
        link.close()
        link.check_invariants()
