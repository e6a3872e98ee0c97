"""Malformed WriteKV chunks and Attend requests, straight into kv_rpc: every one is answered
with a status a person can act on (never another exception), and none changes a shared block."""

import asyncio

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from prefixd.api import prefixd_pb2 as pb
from prefixd.daemon import kv_rpc
from prefixd.daemon.status import RpcFailure
from tests.daemon.kv_rpc_helpers import LAYOUT, MAX_BYTES, kv_for, open_seq, request, sessions

DTYPES = ["float32", "float16", "bfloat16", "float8_e4m3fn", "int8", ""]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A session holding: a sequence with committed blocks, a forked pair sharing a tail, and a
    fresh private one."""
    with sessions(tmp_path_factory.mktemp("fuzz")) as (pool, table):
        s = table.attach("t", "fuzz", LAYOUT, pool)
        committed = open_seq(s, list(range(10)))
        pool.write_kv(committed, 0, kv_for(0, 10))
        pool.commit(committed.id, "index").result()
        parent = open_seq(s, list(range(100, 107)))
        (child,) = pool.fork(parent.id, 1)
        s.track(child.id, len(child.block_table))
        fresh = open_seq(s, list(range(200, 213)))
        yield pool, table, s, [committed.id, parent.id, child.id, fresh.id, 9999]


def shared_bytes(pool):
    """The bytes of every block some sequence may not write (indexed or a shared tail)."""
    slots = set(pool.cache.shared_tails())
    for seq in pool.cache.sequences():
        slots.update(seq.block_table[:seq.num_indexed])
    tensor = pool.store.pool(0).tensor
    return {slot: tensor[slot].clone() for slot in sorted(slots)}


def answered(call) -> None:
    try:
        call()
    except RpcFailure:
        pass


def check_unchanged(pool, before) -> None:
    after = shared_bytes(pool)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    pool.check_invariants()


@settings(max_examples=75, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(which=st.integers(0, 4), start=st.integers(0, 16), n=st.integers(0, 16),
       shape_delta=st.sampled_from([None, (2, 1), (0, 1), (4, -1)]),
       dtype=st.sampled_from(DTYPES), cut=st.integers(-3, 3))
def test_any_writekv_chunk_is_written_or_refused_with_a_status(env, which, start, n, shape_delta,
                                                                dtype, cut):
    pool, table, s, ids = env
    req = request(s, ids[which], start, kv_for(start, n))
    if shape_delta is not None:
        dim, delta = shape_delta
        req.chunk.shape[dim] = max(0, req.chunk.shape[dim] + delta)
    if dtype != "float32":
        req.chunk.dtype = dtype
    if cut:
        data = req.chunk.data
        req.chunk.data = data[:len(data) + cut] if cut < 0 else data + b"\0" * cut
    before = shared_bytes(pool)

    async def stream():
        yield req

    answered(lambda: asyncio.run(kv_rpc.write_kv(s, stream(), MAX_BYTES)))
    check_unchanged(pool, before)
    table.check_invariants()


@settings(max_examples=75, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(picks=st.lists(st.integers(0, 4), min_size=0, max_size=4), layer=st.integers(0, 3),
       rows=st.integers(0, 6), heads=st.integers(0, 5), dim=st.sampled_from([4, 3, 0]),
       dtype=st.sampled_from(DTYPES), loc=st.none() | st.lists(st.integers(0, 8), max_size=5),
       with_kv=st.booleans(), kv_rows=st.integers(0, 6),
       scale=st.sampled_from([0.0, 0.5, -1.0, float("inf"), float("nan")]))
def test_any_attend_request_is_answered_or_refused_with_a_status(env, picks, layer, rows, heads,
                                                                   dim, dtype, loc, with_kv,
                                                                   kv_rows, scale):
    pool, table, s, ids = env
    q = torch.randn((rows, heads, dim))
    req = pb.AttendRequest(session_id=s.id, seq_ids=[ids[i] for i in picks], layer=layer,
                           scale=scale)
    req.query.shape[:] = list(q.shape)
    req.query.dtype = dtype
    req.query.data = q.numpy().tobytes()
    if loc is not None:
        req.query_start_loc.extend(loc)
    if with_kv:
        kv = torch.randn((kv_rows, 2, 4))
        for field in (req.new_k, req.new_v):
            field.shape[:] = list(kv.shape)
            field.dtype = "float32"
            field.data = kv.numpy().tobytes()
    before = shared_bytes(pool)
    answered(lambda: kv_rpc.attend(s, req, MAX_BYTES))
    check_unchanged(pool, before)
