"""The client library's recovery against calls on other threads, with a real daemon killed
(SIGKILL) and restarted on the same state: the races the kill -9 soak's client-library variant
(tests/crash/test_daemon_kill9.py) found, each made deterministic by holding the recovery at
one rpc."""

import threading

import torch

import prefixd.client as pc
from tests.daemon.harness import start_daemon

LAYOUT = pc.KVLayout("reconnect-race", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_size=4)


def kv(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn((LAYOUT.num_layers, 2, n, LAYOUT.num_kv_heads, LAYOUT.head_dim), generator=g)


def test_a_call_during_the_reclaim_waits_for_it_instead_of_using_the_new_session():
    """Bug: the recovery made the new session current at its Attach, before its Reclaim was
    answered and applied. An open on another thread in between went into the new session and
    the Reclaim then marked that fresh handle lost, or it was never reclaimed while the client
    waited for it (the soak's "held sequence came back lost=False reclaimed=False"); a mapped
    store could pass the lease check with a handle still holding the old daemon's block table.
    """
    with start_daemon() as d, pc.connect(d.socket, LAYOUT, name="race") as s:
        held = s.open(list(range(100, 110)))
        s.write_kv(held, 0, kv(10, 1))
        s.commit(held)
        stub, old_session = s._stub, s.id
        reclaim, open_ = stub.Reclaim, stub.Open
        in_reclaim, go, opened = threading.Event(), threading.Event(), threading.Event()
        sent = []  # (session id, sent while the Reclaim was held) of every Open

        def held_reclaim(request, **kw):
            in_reclaim.set()
            go.wait(60)
            return reclaim(request, **kw)

        def watched_open(request, **kw):
            sent.append((request.session_id, in_reclaim.is_set() and not go.is_set()))
            try:
                return open_(request, **kw)
            finally:
                opened.set()

        stub.Reclaim, stub.Open = held_reclaim, watched_open
        got = {}
        opener = threading.Thread(target=lambda: got.update(seq=s.open(list(range(300, 309)))))
        try:
            d.kill()
            d.start()
            assert in_reclaim.wait(60), "the keep-alive's recovery never reached its Reclaim"
            opener.start()
            assert opened.wait(60)
        finally:
            go.set()
        opener.join(60)
        during = [sid for sid, held_back in sent if held_back]
        assert during == [old_session], f"an open during the Reclaim went to session {during}"
        fresh = got["seq"]
        assert not fresh.lost and fresh in s.sequences and s.id != old_session
        assert held.reclaimed and len(held) == 8
        s.write_kv(fresh, 0, kv(9, 2))
        s.release(fresh, commit=True)
        s.check_invariants()
