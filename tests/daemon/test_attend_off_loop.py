"""Attend's kernel runs off the event loop (``PrefixCacheService.Attend`` on
``DaemonCore.compute``): while one client's kernel runs, the loop answers other calls.

Bug it guards: the servicer ran ``kv_rpc.attend`` inline, so a CPU pool's kernel (12-14 ms for
a decode step of 16 x 2k tokens; ~70 ms on a loaded host) held every other client's calls.
The servicer runs here in-process over a real engine pool, with the kernel held on a gate.
"""

import asyncio
import threading

import pytest
import torch

from prefixd.api import prefixd_pb2 as pb
from prefixd.api.tensors import from_tensor_msg, to_tensor_msg
from prefixd.daemon import kv_rpc
from prefixd.daemon.core import SERVING, DaemonCore
from prefixd.daemon.service import PrefixCacheService
from prefixd.config.daemon_settings import DaemonConfig
from prefixd.config.engine_settings import EngineConfig
from tests.daemon.kv_rpc_helpers import LAYOUT, open_seq, sessions


class _Context:
    """What a handler may ask of its gRPC context here (nothing fails in these calls)."""

    async def abort(self, code, message):
        raise AssertionError(f"the call was refused: {code} {message}")

    def add_done_callback(self, callback):
        pass  # no wire here: the call's end is the handler's return


@pytest.fixture
def served(tmp_path):
    """``(service, session, seq)``: a servicer of tenant ``t`` whose session holds one
    sequence of 9 tokens with its KV written."""
    with sessions(tmp_path) as (pool, table):
        core = DaemonCore(EngineConfig(), DaemonConfig(), str(tmp_path))
        core.sessions = table
        core.state = SERVING
        session = table.attach("t", "engine-0", LAYOUT, pool)
        seq = open_seq(session, list(range(9)))
        kv = torch.randn((LAYOUT.num_layers, 2, 9, LAYOUT.num_kv_heads, LAYOUT.head_dim),
                         generator=torch.Generator().manual_seed(3))
        pool.write_kv(seq, 0, kv.to(LAYOUT.torch_dtype()))
        try:
            yield PrefixCacheService(core, "t"), session, seq
        finally:
            core.compute.shutdown()


def _attend_request(session, seq) -> pb.AttendRequest:
    q = torch.randn((1, 4, LAYOUT.head_dim), generator=torch.Generator().manual_seed(4))
    return pb.AttendRequest(session_id=session.id, seq_ids=[seq.id], layer=0,
                            query=to_tensor_msg(q.to(LAYOUT.torch_dtype())))


def test_the_loop_answers_other_calls_while_an_attend_kernel_runs(served, monkeypatch):
    service, session, seq = served
    request = _attend_request(session, seq)
    want = from_tensor_msg(kv_rpc.attend(session, request, 1 << 20).output)
    started, gate = threading.Event(), threading.Event()
    real = kv_rpc.prepare_attend

    def held(session, request, max_bytes):
        job = real(session, request, max_bytes)
        run = job.run

        def held_run(a, b):
            started.set()
            gate.wait(10)
            return run(a, b)
        job.run = held_run
        return job

    monkeypatch.setattr(kv_rpc, "prepare_attend", held)

    async def scenario():
        loop = asyncio.get_running_loop()
        attend = asyncio.create_task(service.Attend(request, _Context()))
        assert await loop.run_in_executor(None, started.wait, 10), "the kernel never started"
        tokens = torch.arange(9, dtype=torch.int32).numpy().tobytes()
        lookup = await asyncio.wait_for(
            service.Lookup(pb.LookupRequest(session_id=session.id, tokens=tokens), _Context()), 5)
        assert lookup.cached_tokens == 0  # answered while the kernel waits on its gate
        assert not attend.done()
        gate.set()
        return await asyncio.wait_for(attend, 10)

    reply = asyncio.run(scenario())
    assert torch.equal(from_tensor_msg(reply.output), want)
    assert service.core.in_flight == 0


def test_a_refused_attend_is_refused_on_the_loop_before_any_kernel(served, monkeypatch):
    """The checks stay on the loop: a bad request never reaches the compute thread."""
    service, session, seq = served
    ran = []
    monkeypatch.setattr(service.core.compute, "submit", lambda *a, **k: ran.append(a))
    bad = pb.AttendRequest(session_id=session.id, seq_ids=[seq.id], layer=7,
                           query=_attend_request(session, seq).query)

    class Refusing(_Context):
        async def abort(self, code, message):
            raise RuntimeError(f"{code.name}: {message}")

    with pytest.raises(RuntimeError, match="INVALID_ARGUMENT: layer 7 is out of range"):
        asyncio.run(service.Attend(bad, Refusing()))
    assert not ran
