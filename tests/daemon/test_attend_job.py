"""``AttendJob`` (prefixd.daemon.attend_job): a checked Attend's kernel split over sequences
gives the whole batch's output bit for bit, for decode and extend; the parts cover the batch in
order, by work; the servicer runs the parts on its compute threads."""

import asyncio

import pytest
import torch

from prefixd.api.tensors import from_tensor_msg
from prefixd.daemon import kv_rpc
from tests.daemon.kv_rpc_helpers import LAYOUT, MAX_BYTES, open_seq, sessions
from tests.daemon.test_kv_rpc_attend import Q_HEADS, attend_request, seq_ids

LENGTHS = (7, 40, 13, 4, 29, 18)


@pytest.fixture
def env(tmp_path):
    """``(pool, session)`` with random KV written for sequences of ``LENGTHS`` tokens."""
    with sessions(tmp_path) as (pool, table):
        s = table.attach("t", "engine-0", LAYOUT, pool)
        g = torch.Generator().manual_seed(5)
        for i, n in enumerate(LENGTHS):
            seq = open_seq(s, list(range(100 * i, 100 * i + n)))
            kv = torch.randn((LAYOUT.num_layers, 2, n, LAYOUT.num_kv_heads, LAYOUT.head_dim), generator=g)
            pool.write_kv(seq, 0, kv.to(LAYOUT.torch_dtype()))
        yield pool, s


def _q(rows: int) -> torch.Tensor:
    return torch.randn((rows, Q_HEADS, LAYOUT.head_dim),
                       generator=torch.Generator().manual_seed(rows)).to(LAYOUT.torch_dtype())


def _check_parts(parts, num):
    assert parts[0][0] == 0 and parts[-1][1] == num
    assert all(a < b for a, b in parts)
    assert all(b == c for (_, b), (c, _) in zip(parts, parts[1:]))


@pytest.mark.parametrize("n", [1, 2, 3, 6, 50])
def test_decode_in_parts_is_the_whole_batch_bit_for_bit(env, n):
    pool, s = env
    ids = seq_ids(pool)
    job = kv_rpc.prepare_attend(s, attend_request(s, ids, _q(len(ids))), MAX_BYTES)
    whole = from_tensor_msg(job().output)
    parts = job.parts(n)
    _check_parts(parts, len(ids))
    assert 1 <= len(parts) <= min(n, len(ids))
    out = from_tensor_msg(job.reply([job.run(a, b) for a, b in parts]).output)
    assert torch.equal(out, whole)


@pytest.mark.parametrize("n", [2, 4])
def test_extend_in_parts_is_the_whole_batch_bit_for_bit(env, n):
    pool, s = env
    ids = seq_ids(pool)
    counts = [1, 5, 3, 2, 4, 1]
    loc = [0]
    for c in counts:
        loc.append(loc[-1] + c)
    job = kv_rpc.prepare_attend(s, attend_request(s, ids, _q(loc[-1]), loc=loc), MAX_BYTES)
    whole = from_tensor_msg(job().output)
    parts = job.parts(n)
    _check_parts(parts, len(ids))
    out = from_tensor_msg(job.reply([job.run(a, b) for a, b in parts]).output)
    assert out.shape[0] == loc[-1]
    assert torch.equal(out, whole)


def test_parts_split_by_work_not_by_count(env):
    """Six sequences whose second holds a third of the tokens: two parts cut after it."""
    pool, s = env
    ids = seq_ids(pool)
    job = kv_rpc.prepare_attend(s, attend_request(s, ids, _q(len(ids))), MAX_BYTES)
    assert job.parts(2) == [(0, 3), (3, 6)]  # 60 of 111 tokens, then 51


def test_the_servicer_runs_the_parts_on_the_compute_threads(env, monkeypatch, tmp_path):
    """A CPU pool's batch reaches ``run`` once per part, each on a compute thread, and the
    reply is the whole batch's."""
    import threading

    from prefixd.api import prefixd_pb2 as pb
    from prefixd.daemon.core import SERVING, DaemonCore
    from prefixd.daemon.service import PrefixCacheService
    from prefixd.config.daemon_settings import DaemonConfig
    from prefixd.config.engine_settings import EngineConfig

    pool, s = env
    ids = seq_ids(pool)
    request = attend_request(s, ids, _q(len(ids)))
    core = DaemonCore(EngineConfig(), DaemonConfig(), str(tmp_path))
    core.state = SERVING
    core.compute_threads = 3
    service = PrefixCacheService(core, "t")
    monkeypatch.setattr(service, "_session", lambda session_id: s)
    want = from_tensor_msg(kv_rpc.attend(s, attend_request(s, ids, _q(len(ids))), MAX_BYTES).output)
    ran = []
    real = kv_rpc.prepare_attend

    def spying(session, req, max_bytes):
        job = real(session, req, max_bytes)
        run = job.run

        def spy(a, b):
            ran.append((a, b, threading.current_thread().name))
            return run(a, b)
        job.run = spy
        return job

    monkeypatch.setattr(kv_rpc, "prepare_attend", spying)

    class Context:
        async def abort(self, code, message):
            raise AssertionError(f"refused: {code} {message}")

        def add_done_callback(self, callback):
            pass  # no wire here: the call's end is the handler's return

    try:
        reply = asyncio.run(service.Attend(request, Context()))
    finally:
        core.compute.shutdown()
    assert torch.equal(from_tensor_msg(reply.output), want)
    assert sorted((a, b) for a, b, _ in ran) == [(0, 2), (2, 5), (5, 6)]  # by work: 47, 46, 18
    assert all(name.startswith("prefixd-attend") for _, _, name in ran)
    assert isinstance(reply, pb.AttendReply)
