"""The connector's scheduler side and its daemon link over a fake session (main venv, no vLLM,
no daemon): what it promises vLLM, what it plans for the worker, when it commits."""

import logging
import time

import pytest

from prefixd.client.errors import ResourceExhausted, Unavailable
from prefixd.client.handles import LookupResult
from prefixd.client.vllm.daemon_link import DaemonLink
from prefixd.client.vllm.metadata import SaveReport
from prefixd.client.vllm.scheduler import SchedulerSide

BS = 4


class FakeSeq:
    def __init__(self, cached_tokens, block_table):
        self.cached_tokens = cached_tokens
        self.block_table = block_table
        self.released = False


class FakeSession:
    """Holds ``cached`` blocks of every prompt; slots from 100 on; records releases."""

    def __init__(self, cached_blocks=0, open_cached_blocks=None, epoch=1):
        self.cached_blocks = cached_blocks
        self.open_cached_blocks = cached_blocks if open_cached_blocks is None else open_cached_blocks
        self.epoch = epoch
        self.down = False
        self.released = []
        self.committed = []
        self.next_slot = 100
        self.closed = False

    def _check(self):
        if self.down:
            raise Unavailable("daemon down")

    def lookup_tiers(self, tokens):
        self._check()
        n = min(self.cached_blocks * BS, len(tokens) // BS * BS)
        return LookupResult(n, n, 0, 0, 0)

    def open(self, tokens):
        self._check()
        blocks = -(-len(tokens) // BS)
        table = list(range(self.next_slot, self.next_slot + blocks))
        self.next_slot += blocks
        cached = min(self.open_cached_blocks, (len(tokens) - 1) // BS) * BS
        return FakeSeq(cached, table)

    def release(self, seq, commit=False, durability="crash"):
        self._check()
        seq.released = True
        self.released.append((seq, commit, durability))

    def commit(self, seq, durability="crash"):
        self._check()
        self.committed.append((seq, durability))
        return 1

    def close(self):
        self.closed = True


def _side(session, durability="crash", retry_s=60.0):
    link = DaemonLink("/nonexistent", None, "test", mapped=False, timeout_s=1, retry_s=retry_s,
                      connector=lambda *a, **k: session)
    return SchedulerSide(link, BS, durability)


def _admit(side, req_id, prompt, num_computed=0):
    n = side.num_new_matched_tokens(req_id, prompt, num_computed)
    side.after_alloc(req_id, prompt, n)
    return n


def test_hit_is_whole_blocks_and_never_the_last_token():
    """vLLM must compute the prompt's last token, so a prompt of exactly 3 cached blocks
    gets 2 blocks from prefixd; and only what vLLM does not hold itself is counted."""
    side = _side(FakeSession(cached_blocks=3))
    assert side.num_new_matched_tokens("a", list(range(3 * BS)), 0) == 2 * BS
    assert side.num_new_matched_tokens("b", list(range(3 * BS + 1)), 0) == 3 * BS
    assert side.num_new_matched_tokens("c", list(range(3 * BS + 1)), BS) == 2 * BS
    assert side.num_new_matched_tokens("d", list(range(3 * BS + 1)), 3 * BS) == 0


def test_plan_loads_the_hit_then_saves_the_new_full_blocks():
    session = FakeSession(cached_blocks=2)
    side = _side(session)
    prompt = list(range(4 * BS + 2))
    assert _admit(side, "r", prompt) == 2 * BS
    plan = side.build_plan([("r", [7, 8, 9, 10, 11], 2 * BS)], [], {"r": BS + 1})
    assert [(t.block_ids, t.slots) for t in plan.loads] == [((7, 8), (100, 101))]
    assert [(t.block_ids, t.slots) for t in plan.saves] == [((9,), (102,))]  # block 3: next chunk
    plan = side.build_plan([], [("r", None, False, 3 * BS + 1)], {"r": BS + 1})
    assert plan.loads == []
    assert [(t.block_ids, t.slots) for t in plan.saves] == [((10,), (103,))]
    side.on_report(SaveReport({"r": {0: 2}}))
    assert [d for _, d in session.committed] == ["crash"]  # shareable before the request ends
    side.finished("r")
    assert [c for _, c, _ in session.released] == [False]
    assert side.stats.committed == 1
    side.check_invariants()


def test_the_hit_is_the_opens_pin_one_rpc_per_request():
    """TTFT (issue 14): a Lookup then an Open were two rpcs on every external hit's time to first
    token; the open's pin answers ``num_new_matched_tokens``, made once however often vLLM asks
    (a request it cannot schedule yet is asked again), and ``after_alloc`` opens nothing more."""
    session = FakeSession(cached_blocks=3)
    calls = []
    real_open = session.open
    session.open = lambda tokens: calls.append("open") or real_open(tokens)
    session.lookup_tiers = lambda tokens: calls.append("lookup")
    side = _side(session)
    prompt = list(range(4 * BS))
    assert side.num_new_matched_tokens("r", prompt, 0) == 3 * BS
    assert side.num_new_matched_tokens("r", prompt, 0) == 3 * BS  # not scheduled yet: asked again
    side.after_alloc("r", prompt, 3 * BS)
    assert calls == ["open"]
    plan = side.build_plan([("r", [5, 6, 7, 8], 0)], [], {"r": 4 * BS})
    assert [(t.block_ids, t.slots) for t in plan.loads] == [((5, 6, 7), (100, 101, 102))]
    side.check_invariants()


def test_a_request_matched_but_never_scheduled_releases_its_pin():
    """The open made for ``num_new_matched_tokens`` holds a pin: vLLM's finish of a request it
    never scheduled (aborted while waiting) must release it."""
    session = FakeSession(cached_blocks=2)
    side = _side(session)
    assert side.num_new_matched_tokens("r", list(range(3 * BS)), 0) == 2 * BS
    side.finished("r")
    assert [c for _, c, _ in session.released] == [False]
    side.check_invariants()


def test_a_pin_from_an_older_daemon_epoch_promises_nothing_and_fails_its_loads():
    """The daemon restarted between the open and vLLM's next call: the old pin promises no
    tokens, and blocks promised before the restart go to the worker as failed loads (vLLM
    recomputes them), never as copies from slots the new daemon may have given away."""
    session = FakeSession(cached_blocks=3)
    side = _side(session)
    prompt = list(range(4 * BS))
    assert side.num_new_matched_tokens("r", prompt, 0) == 3 * BS
    side.after_alloc("r", prompt, 3 * BS)
    session.epoch = 2
    assert side.num_new_matched_tokens("r2", prompt, 0) == 3 * BS  # a new open: new epoch
    plan = side.build_plan([("r", [5, 6, 7, 8], 0)], [], {"r": 4 * BS})
    assert plan.loads == [] or all(t.req_id != "r" for t in plan.loads)
    assert plan.failed_block_ids == {5, 6, 7}
    side.check_invariants()


def test_finish_before_the_last_save_report_commits_when_it_arrives():
    """vLLM frees a finished request before it hands over that step's worker output: the
    release waits for the report instead of dropping the commit."""
    session = FakeSession()
    side = _side(session)
    _admit(side, "r", list(range(2 * BS + 1)))
    plan = side.build_plan([("r", [1, 2, 3], 0)], [], {"r": 2 * BS + 1})
    assert len(plan.saves) == 1
    side.finished("r")
    assert session.released == []
    side.check_invariants()
    side.on_report(SaveReport({"r": {0: 2}}))
    assert [c for _, c, _ in session.released] == [True]


def test_a_prompt_not_fully_saved_is_released_without_commit():
    """An aborted prefill (or a failed save) must not index blocks nobody wrote."""
    session = FakeSession()
    side = _side(session)
    _admit(side, "a", list(range(3 * BS)))
    side.build_plan([("a", [1, 2, 3], 0)], [], {"a": BS})
    side.on_report(SaveReport({"a": {0: 1}}))
    side.finished("a")
    _admit(side, "b", list(range(2 * BS)))
    side.build_plan([("b", [4, 5], 0)], [], {"b": 2 * BS})
    side.on_report(SaveReport({}, {"b"}))
    side.finished("b")
    assert [c for _, c, _ in session.released] == [False, False]
    assert side.stats.uncommitted == 2


def test_a_daemon_that_is_down_is_a_miss_logged_once(caplog):
    session = FakeSession(cached_blocks=2)
    session.down = True
    side = _side(session)
    with caplog.at_level(logging.WARNING, logger="prefixd.client.vllm"):
        assert _admit(side, "r", list(range(3 * BS))) == 0
        assert _admit(side, "s", list(range(3 * BS))) == 0
        plan = side.build_plan([("r", [1, 2, 3], 0), ("s", [4, 5, 6], 0)], [], {"r": 3 * BS, "s": 3 * BS})
        side.finished("r")
    assert plan.empty()
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "unreachable" in caplog.records[0].message
    assert side.link.stats.outages == 1 and side.link.stats.failed >= 2  # one outage, both opens missed
    side.check_invariants()


def test_requests_opened_before_a_daemon_restart_neither_copy_nor_commit():
    """Slots handed out by the old daemon may belong to another client after its restart."""
    session = FakeSession(cached_blocks=1)
    side = _side(session)
    _admit(side, "r", list(range(3 * BS)))
    session.epoch = 2
    plan = side.build_plan([("r", [1, 2, 3], BS)], [], {"r": 2 * BS})
    assert plan.loads == [] and plan.saves == [] and plan.failed_block_ids == {1}
    side.finished("r")
    assert [c for _, c, _ in session.released] == [False]


def test_pool_full_is_a_miss_not_an_error():
    session = FakeSession(cached_blocks=1)

    def refuse(tokens):
        raise ResourceExhausted("pool full")

    session.open = refuse
    side = _side(session)
    assert _admit(side, "r", list(range(3 * BS))) == 0  # the refused open promised nothing
    plan = side.build_plan([("r", [1, 2, 3], 0)], [], {"r": 3 * BS})
    assert plan.empty()
    side.finished("r")
    assert side.link.stats.outages == 0


def test_shutdown_releases_what_is_held_and_detaches():
    session = FakeSession()
    side = _side(session)
    _admit(side, "r", list(range(2 * BS)))
    side.shutdown()
    assert len(session.released) == 1 and session.closed


@pytest.mark.parametrize("extra, match", [
    ({}, "prefixd.socket"),
    ({"prefixd.socket": "/s", "prefixd.durability": "disk"}, "durability"),
    ({"prefixd.socket": "/s", "prefixd.sokcet": "/t"}, "unknown"),
    ({"prefixd.socket": "/s", "prefixd.request_timeout_ms": 0}, "request_timeout_ms"),
])
def test_options_refuse_what_would_pass_silently(extra, match):
    from prefixd.client.vllm.options import ConnectorOptions

    with pytest.raises(ValueError, match=match):
        ConnectorOptions.from_extra_config(extra)


def test_a_release_the_daemon_missed_is_retried_when_it_answers():
    """A request finished during an outage must not keep its pin once the daemon is back."""
    session = FakeSession()
    side = _side(session, retry_s=0.01)
    _admit(side, "r", list(range(2 * BS)))
    session.down = True
    side.finished("r")
    assert session.released == []
    session.down = False
    time.sleep(0.02)  # the retry window passed
    side.build_plan([], [], {})
    assert [c for _, c, _ in session.released] == [False]
    side.build_plan([], [], {})
    assert len(session.released) == 1
    side.check_invariants()


def test_a_prompt_shorter_than_a_block_costs_no_daemon_call():
    session = FakeSession()
    side = _side(session)
    _admit(side, "r", list(range(BS - 1)))
    assert side.build_plan([("r", [1], 0)], [], {"r": BS - 1}).empty()
    side.finished("r")
    assert side.link.stats.calls == 0 and session.released == []


def test_a_prompt_is_committed_once_saved_not_when_the_request_ends():
    """Another vLLM sending the same prompt while this one decodes must hit it: the report
    that completes the prompt's saves commits it; the release at the end does not again."""
    session = FakeSession()
    side = _side(session, durability="power")
    _admit(side, "r", list(range(2 * BS + 1)))
    side.build_plan([("r", [1, 2, 3], 0)], [], {"r": 2 * BS + 1})
    side.on_report(SaveReport({"r": {0: 2}}))
    assert [d for _, d in session.committed] == ["power"] and session.released == []
    side.build_plan([], [("r", [4], False, 2 * BS + 1)], {"r": 1})  # decoding
    side.on_report(SaveReport())
    side.finished("r")
    assert len(session.committed) == 1 and [c for _, c, _ in session.released] == [False]


def test_options_take_the_request_deadline_in_ms():
    from prefixd.client.breaker import DEFAULT_REQUEST_TIMEOUT_MS
    from prefixd.client.vllm.options import ConnectorOptions

    assert ConnectorOptions.from_extra_config({"prefixd.socket": "/s"}).request_timeout_ms == DEFAULT_REQUEST_TIMEOUT_MS
    opts = ConnectorOptions.from_extra_config({"prefixd.socket": "/s", "prefixd.request_timeout_ms": "250"})
    assert opts.request_timeout_ms == 250.0
