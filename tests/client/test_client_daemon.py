"""The client library against a real daemon process: every method, both KV paths, refusals."""

import time

import pytest
import torch

import prefixd.client as pc
from prefixd.kernels import layer_kv, reference
from tests.daemon.harness import start_daemon

LAYOUT = pc.KVLayout("client-test", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_size=4)
LEASE_S = 4.0  # long enough that a loaded 2-core host does not starve the keep-alive past it


@pytest.fixture(scope="module")
def daemon():
    with start_daemon(lease_s=LEASE_S) as d:
        yield d


@pytest.fixture(params=[True, False], ids=["mapped", "rpc"])
def session(request, daemon):
    with pc.connect(daemon.socket, LAYOUT, name=f"test-{request.param}", mapped=request.param) as s:
        assert s.mapped is request.param
        yield s
        s.check_invariants()


def prompt(first, n):
    return list(range(first, first + n))


def kv(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn((LAYOUT.num_layers, 2, n, LAYOUT.num_kv_heads, LAYOUT.head_dim), generator=g)


def test_every_session_method_round_trips(session):
    tokens = prompt(1000 + 100 * session.mapped, 10)
    assert session.lookup(tokens) == 0
    seq = session.open(tokens)
    assert (len(seq), seq.cached_tokens, len(seq.block_table), seq.num_indexed) == (10, 0, 3, 0)
    x = kv(10, 1)
    session.write_kv(seq, 0, x)
    assert torch.equal(session.read_kv(seq, 0, 10), x)
    out = torch.empty_like(x[:, :, :7])
    assert session.read_kv(seq, 3, 7, out=out) is out and torch.equal(out, x[:, :, 3:])
    assert session.commit(seq, durability="crash") == 2 and seq.num_indexed == 2
    assert session.lookup_tiers(tokens).device_tokens == 8
    session.extend(seq, [7, 7])
    assert len(seq) == 12 and len(seq.block_table) == 3
    session.write_kv(seq, 10, kv(2, 2))
    children = session.fork(seq, 2)
    assert [len(c) for c in children] == [12, 12] and all(c.block_table == seq.block_table for c in children)
    q = torch.randn(3, 4, LAYOUT.head_dim)
    assert session.attend([seq, *children], q).shape == q.shape
    for c in children:
        session.release(c)
    session.release(seq, commit=True)
    assert seq.released and session.lookup(tokens + [7, 7]) == 12
    assert session.stats()["prefixd_sessions"] >= 1
    with pytest.raises(pc.NotFound, match="released"):
        session.extend(seq, [1])


def test_writing_a_forked_childs_partial_tail_leaves_the_parents(session):
    """Copy-on-write: the child's extend copies the shared partial block before it is written."""
    parent = session.open(prompt(2000 + 100 * session.mapped, 6))  # block 1 is partial (2 tokens)
    x = kv(6, 3)
    session.write_kv(parent, 0, x)
    child = session.fork(parent, 1)[0]
    with pytest.raises(pc.FailedPrecondition):  # still shared: refused on both paths
        session.write_kv(child, 4, kv(2, 4))
    session.extend(child, [9])
    assert child.block_table[1] != parent.block_table[1] and child.block_table[0] == parent.block_table[0]
    session.write_kv(child, 4, kv(3, 5))
    assert torch.equal(session.read_kv(parent, 0, 6), x)
    assert torch.equal(session.read_kv(child, 4, 3), kv(3, 5))


def test_writes_to_committed_blocks_are_refused_and_change_nothing(session):
    seq = session.open(prompt(3000 + 100 * session.mapped, 8))
    x = kv(8, 6)
    session.write_kv(seq, 0, x)
    session.commit(seq)
    with pytest.raises(pc.FailedPrecondition, match="committed|indexed"):
        session.write_kv(seq, 2, kv(3, 7))
    assert torch.equal(session.read_kv(seq, 0, 8), x)


def test_bad_arguments_are_refused_before_anything_is_sent(session):
    seq = session.open(prompt(4000 + 100 * session.mapped, 5))
    with pytest.raises(pc.InvalidArgument, match="past the end"):
        session.write_kv(seq, 3, kv(3, 0))
    with pytest.raises(pc.InvalidArgument, match="shape"):
        session.write_kv(seq, 0, torch.zeros(2, 2, 1, 2, 9))
    with pytest.raises(pc.InvalidArgument, match="dtype"):
        session.write_kv(seq, 0, kv(1, 0).half())
    with pytest.raises(pc.InvalidArgument, match="one query per sequence"):
        session.attend([seq], torch.zeros(2, 4, LAYOUT.head_dim))
    with pytest.raises(pc.InvalidArgument, match="dtype"):
        session.attend([seq], torch.zeros(1, 4, LAYOUT.head_dim, dtype=torch.float16))


def test_mapped_and_rpc_paths_read_and_write_identical_bytes(daemon):
    tokens = prompt(5000, 13)
    with pc.connect(daemon.socket, LAYOUT, mapped=True) as m, pc.connect(daemon.socket, LAYOUT, mapped=False) as r:
        a = m.open(tokens)
        x = kv(13, 8)
        m.write_kv(a, 0, x)
        m.commit(a)
        b = r.open(tokens + [1, 2, 3])
        assert b.cached_tokens == 12 and b.block_table[:3] == a.block_table[:3]
        assert torch.equal(r.read_kv(b, 0, 12), x[:, :, :12])
        y = kv(4, 9)
        r.write_kv(b, 12, y)
        r.commit(b)
        c = m.open(tokens + [1, 2, 3, 4])
        assert c.cached_tokens == 16
        assert torch.equal(m.read_kv(c, 0, 16), torch.cat([x[:, :, :12], y], dim=2))


def test_rpc_writes_are_chunked_under_the_message_limit(daemon):
    with pc.connect(daemon.socket, LAYOUT, mapped=False) as r:
        r.max_message_bytes = 4096 + 5 * 256  # 5 tokens of KV per WriteKV chunk: 1 block each
        seq = r.open(prompt(6000, 23))
        x = kv(23, 10)
        r.write_kv(seq, 1, x[:, :, 1:])
        assert torch.equal(r.read_kv(seq, 1, 22), x[:, :, 1:])


def _reference(kv_by_seq, q, loc=None):
    """Attention over a fresh local pool holding each sequence's KV (read back after attend)."""
    bs = LAYOUT.block_size
    width = max(-(-t.shape[2] // bs) for t in kv_by_seq)
    pool = torch.zeros((len(kv_by_seq) * width, *LAYOUT.block_shape))
    tables = torch.zeros((len(kv_by_seq), width), dtype=torch.int32)
    for i, t in enumerate(kv_by_seq):
        for tok in range(t.shape[2]):
            pool[i * width + tok // bs, :, :, tok % bs] = t[:, :, tok]
        tables[i] = torch.arange(i * width, (i + 1) * width)
    k, v = layer_kv(pool, 1)
    lens = torch.tensor([t.shape[2] for t in kv_by_seq], dtype=torch.int32)
    if loc is None:
        return reference.paged_decode_reference(q, k, v, tables, lens)
    return reference.paged_extend_reference(q, k, v, tables, lens, torch.tensor(loc, dtype=torch.int32))


def test_attend_through_both_paths_equals_the_reference(daemon):
    outs = {}
    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, 4, LAYOUT.head_dim, generator=g)
    new_k, new_v = torch.randn(2, 2, LAYOUT.head_dim, generator=g), torch.randn(2, 2, LAYOUT.head_dim, generator=g)
    q_ext = torch.randn(5, 4, LAYOUT.head_dim, generator=g)
    for mapped in (True, False):
        with pc.connect(daemon.socket, LAYOUT, mapped=mapped) as s:
            a, b = s.open(prompt(7000 + mapped, 9)), s.open(prompt(7100 + mapped, 6))
            s.write_kv(a, 0, kv(8, 12))
            s.write_kv(b, 0, kv(5, 13))
            out = s.attend([a, b], q, layer=1, new_k=new_k, new_v=new_v)
            kvs = [s.read_kv(a, 0, 9), s.read_kv(b, 0, 6)]
            assert torch.equal(kvs[0][1, 0, 8], new_k[0]) and torch.equal(kvs[1][1, 1, 5], new_v[1])
            torch.testing.assert_close(out, _reference(kvs, q))
            ext = s.attend([a, b], q_ext, layer=1, query_start_loc=[0, 3, 5])
            torch.testing.assert_close(ext, _reference(kvs, q_ext, [0, 3, 5]))
            outs[mapped] = (out, ext)
    torch.testing.assert_close(outs[True], outs[False])


def test_the_keepalive_holds_the_session_past_its_lease(daemon):
    with pc.connect(daemon.socket, LAYOUT) as s:
        seq = s.open(prompt(8000, 4))
        time.sleep(LEASE_S * 1.25)
        s.extend(seq, [1])  # NOT_FOUND here if the lease had lapsed
        assert s.recoveries == 0 and len(seq) == 5


def test_a_session_whose_keepalive_stops_ends(daemon):
    """The daemon side of the lease, seen from the client: a stopped keep-alive ends the session
    (every other call pings too, so the polling below does not hold it; the stream's end does)."""
    with pc.connect(daemon.socket, LAYOUT, reconnect=False) as s:
        deadline = time.monotonic() + LEASE_S
        while not s.attachment._keepalive.replies and time.monotonic() < deadline:
            time.sleep(0.05)  # the stream must be open before its end can end the session
        s.attachment._stop_keepalive()
        deadline = time.monotonic() + LEASE_S * 3
        with pytest.raises(pc.NotFound):
            while time.monotonic() < deadline:  # bounded: the session must end within this
                s.lookup(prompt(8100, 4))
                time.sleep(0.1)


def test_detach_releases_what_the_session_held(daemon):
    s = pc.connect(daemon.socket, LAYOUT)
    seqs = [s.open(prompt(9000 + 10 * i, 5)) for i in range(3)]
    s.release(seqs[0])
    thread = s.attachment._keepalive._thread
    assert s.close() == 2
    assert not thread.is_alive(), "the keep-alive thread ends with the session"
    assert all(q.released for q in seqs) and s.close() == 0


def test_connect_without_a_daemon_fails_at_once(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(pc.Unavailable):
        pc.connect(str(tmp_path / "none.sock"), LAYOUT)
    assert time.monotonic() - t0 < 10, "no socket: no waiting out the reconnect backoff"


def test_a_not_found_sequence_is_not_mistaken_for_a_daemon_restart(daemon):
    """Bug it guards: a NOT_FOUND for an unknown sequence made the session re-attach, and the
    re-attach dropped every sequence it held."""
    from prefixd.api import prefixd_pb2 as pb

    with pc.connect(daemon.socket, LAYOUT) as s:
        seq = s.open(prompt(9500, 5))
        session_id = s.id
        bogus = pc.Sequence(pb.SequenceReply(seq_id=987654321, num_tokens=1))
        with pytest.raises(pc.NotFound):
            s.extend(bogus, [1])
        assert s.id == session_id and s.recoveries == 0
        s.extend(seq, [1])
        assert len(seq) == 6
