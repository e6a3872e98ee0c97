"""Reconnect and reclaim after the daemon is killed with SIGKILL and restarted on the same state."""

import os
import time

import pytest
import torch

import prefixd.client as pc
from tests.daemon.harness import start_daemon

SOAK_CYCLES = int(os.environ.get("PREFIXD_SOAK_CYCLES", "20"))
LAYOUT = pc.KVLayout("reconnect-test", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_size=4)


def kv(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn((LAYOUT.num_layers, 2, n, LAYOUT.num_kv_heads, LAYOUT.head_dim), generator=g)


def test_after_kill9_sessions_reattach_and_reclaim_what_was_committed():
    """Sessions meet the same restart three ways: the mapped one through its keep-alive
    thread (recovers in the background), the rpc one through a call (its keep-alive's report
    is switched off, so the failed call itself recovers), one whose backoff gives up while
    the daemon is down and recovers at its next call, and one whose first access after the
    restart is a mapped store (no rpc at all)."""
    committed, uncommitted, other = list(range(100, 110)), list(range(200, 206)), list(range(300, 309))
    x, y = kv(10, 1), kv(9, 2)
    with start_daemon() as d, pc.connect(d.socket, LAYOUT, name="m", mapped=True) as m, \
            pc.connect(d.socket, LAYOUT, name="r", mapped=False) as r, \
            pc.connect(d.socket, LAYOUT, name="u", backoff=pc.Backoff(total_s=0.3)) as u, \
            pc.connect(d.socket, LAYOUT, name="w", mapped=True) as w:
        a = m.open(committed)
        m.write_kv(a, 0, x)
        m.commit(a, durability="crash")
        b = m.open(uncommitted)
        c = r.open(other)
        r.write_kv(c, 0, y)
        r.commit(c)
        e = w.open(list(range(400, 410)))
        w.write_kv(e, 0, kv(10, 3))
        w.commit(e)
        old_ids = m.id, r.id
        r.attachment._keepalive._on_lost = lambda error: None
        w.attachment._keepalive._on_lost = lambda error: None
        d.kill()
        with pytest.raises(pc.Unavailable, match="did not come back"):
            u.lookup(committed)  # a bounded backoff gives up while no daemon runs
        d.start(wait=False)

        # The call meets the restart: it recovers, then raises because extend is not idempotent.
        with pytest.raises(pc.DaemonRestarted) as err:
            r.extend(c, [5])
        assert err.value.reclaimed == [c] and len(c) == 8 and c.previous_num_tokens == 9
        r.extend(c, [5])  # told once: the redo proceeds
        assert len(c) == 9 and r.recoveries == 1 and r.id != old_ids[1]
        assert torch.equal(r.read_kv(c, 0, 8), y[:, :, :8]), "committed KV survives byte for byte"

        # The keep-alive recovered the other session; an idempotent call just works.
        assert m.lookup(committed) == 8
        assert m.id != old_ids[0] and m.recoveries == 1
        with pytest.raises(pc.DaemonRestarted) as err:
            m.read_kv(a, 0, 8)
        assert a in err.value.reclaimed
        assert a.reclaimed and len(a) == 8 and a.previous_num_tokens == 10 and a.num_indexed == 2
        assert torch.equal(m.read_kv(a, 0, 8), x[:, :, :8])
        m.extend(a, committed[8:])
        m.write_kv(a, 8, x[:, :, 8:])
        assert torch.equal(m.read_kv(a, 0, 10), x)
        with pytest.raises(pc.DaemonRestarted):
            m.extend(b, [1])
        assert b.lost
        with pytest.raises(pc.NotFound, match="open the prompt again"):
            m.extend(b, [1])
        assert u.lookup(committed) == 8, "the session that gave up recovers at its next call"

        # A mapped store never talks to the daemon: the broken keep-alive must stop it, or it
        # lands through the old block table in slots the new daemon may have handed out.
        assert w.attachment._keepalive.lost is not None and w.recoveries == 0
        with pytest.raises(pc.DaemonRestarted):
            w.write_kv(e, 8, kv(2, 4))
        assert len(e) == 8 and w.recoveries == 1
        for s in (m, r, u, w):
            s.check_invariants()


def test_idle_sessions_answer_their_next_call_after_a_restart_longer_than_the_lease():
    """Idle sessions across a daemon kill -9 and restart, down and then idle past the lease
    (issue 14 follow-up: an idle vLLM's sessions did not show on the new daemon). With the
    default backoff the keep-alive's recovery re-attaches once the daemon serves and holds the
    new lease while idle; one whose bounded backoff gave up while the daemon was down stays on
    the dead session until its next call, which re-attaches and answers as if nothing happened,
    and its mapped read of the committed prefix gives the bytes written before the kill."""
    lease_s = 1.0
    prompt, x = list(range(500, 510)), kv(10, 5)
    with start_daemon(lease_s=lease_s) as d, pc.connect(d.socket, LAYOUT, name="idle") as s, \
            pc.connect(d.socket, LAYOUT, name="gave-up", mapped=True, backoff=pc.Backoff(total_s=0.3)) as u:
        seq = s.open(prompt)
        s.write_kv(seq, 0, x)
        s.release(seq, commit=True)
        ids = s.id, u.id
        d.kill()
        time.sleep(lease_s + 0.5)  # down past the lease
        d.start()
        deadline = time.monotonic() + 60
        while not s.lease_held and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(lease_s + 0.5)  # idle past a lease and its keep-alive interval on the new daemon
        assert s.lease_held and s.recoveries == 1 and s.id != ids[0], "the keep-alive's recovery re-attached"
        assert not u.lease_held and u.recoveries == 0 and u.id == ids[1], "the bounded backoff gave up"
        assert u.lookup(prompt) == 8 and s.lookup(prompt) == 8
        assert (u.recoveries, s.recoveries) == (1, 1) and u.id != ids[1] and u.lease_held
        seq = u.open(prompt)
        assert seq.cached_tokens == 8 and torch.equal(u.read_kv(seq, 0, 8), x[:, :, :8])
        for c in (s, u):
            c.check_invariants()


@pytest.mark.soak
def test_repeated_kill9_cycles_keep_every_committed_prefix():
    """Each cycle commits one more block of a growing prompt, kills the daemon mid-way through
    writing the next, restarts it; the reclaimed handle always holds every committed block
    with its bytes."""
    cycles = SOAK_CYCLES
    bs = LAYOUT.block_size
    tokens = list(range(1000, 1000 + bs * (cycles + 2)))
    x = kv(len(tokens), 5)
    with start_daemon() as d, pc.connect(d.socket, LAYOUT, name="soak") as s:
        seq = s.open(tokens[:bs])
        s.write_kv(seq, 0, x[:, :, :bs])
        s.commit(seq)
        for cycle in range(1, cycles + 1):
            committed = cycle * bs
            s.extend(seq, tokens[committed:committed + bs])
            s.write_kv(seq, committed, x[:, :, committed:committed + bs])
            s.commit(seq)
            s.extend(seq, tokens[committed + bs:committed + bs + 2])  # uncommitted when killed
            d.kill()
            d.start()
            with pytest.raises(pc.DaemonRestarted):
                s.read_kv(seq, 0, 1)
            assert len(seq) == committed + bs and seq.previous_num_tokens == committed + bs + 2
            assert torch.equal(s.read_kv(seq, 0, len(seq)), x[:, :, :len(seq)])
        assert s.recoveries == cycles
