"""The client library's recovery against calls on other threads, with a real daemon killed
(SIGKILL) and restarted on the same state: the races the kill -9 soak's client-library variant
(tests/crash/test_daemon_kill9.py) found, each made deterministic by holding the recovery at
one rpc or by restarting the daemon at one point of a call."""

import threading

import pytest
import torch

import prefixd.client as pc
from tests.daemon.harness import start_daemon

LAYOUT = pc.KVLayout("reconnect-race", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_size=4)
PATIENT = pc.Backoff(total_s=300.0)  # the background recovery outlasts a slow restart of a loaded host


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
    with start_daemon() as d, pc.connect(d.socket, LAYOUT, name="race", backoff=PATIENT) as s:
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
            assert in_reclaim.wait(300), "the keep-alive's recovery never reached its Reclaim"
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


def test_a_mapped_store_checks_its_handle_again_after_a_recovery_on_another_thread():
    """Bug: a mapped store checked its handle, then the lease; a recovery that ended on the
    keep-alive's thread between the two (the daemon died and came back) left the lease held
    and the handle cut back to its committed blocks, and the store went on through the new
    block table with the range checked against the old length. It must raise DaemonRestarted.
    """
    with start_daemon() as d, pc.connect(d.socket, LAYOUT, name="race", mapped=True, backoff=PATIENT) as s:
        seq = s.open(list(range(100, 110)))
        s.write_kv(seq, 0, kv(10, 1))
        s.commit(seq)
        check_range = s._check_range

        def restart_between_the_checks(*args):
            check_range(*args)  # the handle's checks passed: now the daemon dies and comes back
            del s._check_range
            d.kill()
            d.start()
            for _ in range(3000):
                if s.recoveries and s.lease_held:
                    break
                threading.Event().wait(0.1)
            assert s.recoveries == 1 and seq.reclaimed and len(seq) == 8

        s._check_range = restart_between_the_checks
        with pytest.raises(pc.DaemonRestarted):
            s.write_kv(seq, 8, kv(2, 2))
        s.extend(seq, [108, 109])
        s.write_kv(seq, 8, kv(2, 2))
        assert torch.equal(s.read_kv(seq, 0, 10)[:, :, :8], kv(10, 1)[:, :, :8])
        s.check_invariants()
