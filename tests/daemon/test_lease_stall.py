"""A daemon that was itself stopped keeps its clients: leases are measured on the time the
daemon ran (``sessions.LeaseClock``), on a real daemon process with client-library sessions
and a holder process (``tests.daemon.lease_holders``)."""

from __future__ import annotations

import os
import random
import signal
import time

import prefixd.client as pc
from tests.daemon.gsp_workload import LAYOUT
from tests.daemon.harness import start_daemon
from tests.daemon.test_leases import CONFIG, SHORT_LEASE, SLACK_S, Spawner, status

NUM_CLIENTS = 3  # client-library sessions in this process: their pings queue during the stop
NUM_FROZEN = 2  # holders with a KeepAlive stream, stopped with the daemon and resumed after it
FROZEN_AFTER_S = 0.5  # how long after the daemon they resume (a host-wide stall ending)


def test_a_daemon_stopped_for_three_leases_keeps_its_live_clients_and_ends_a_dead_one():
    """Regression: the tick swept leases on ``time.monotonic()`` before the loop read the
    pings queued during a SIGSTOP longer than the lease, so every client's session ended at
    SIGCONT (``reason=lease expired``) and the clients reconnected with their sequences lost.
    A holder killed during the stop (one without a KeepAlive stream, whose end would tell the
daemon at once) still goes within a lease of the daemon running again."""
    with start_daemon(CONFIG, lease_s=SHORT_LEASE) as d:
        spawner = Spawner(d)
        clients = []
        try:
            rng = random.Random(7)
            layout = pc.KVLayout(**LAYOUT)
            for i in range(NUM_CLIENTS):
                clients.append(pc.connect(d.socket, layout, name=f"lib{i}", mapped=False))
            seqs = [c.open([rng.randrange(50000, 90000) for _ in range(40)]) for c in clients]
            ids = [c.id for c in clients]
            frozen = [spawner.spawn("private+keepalive", 10 + i) for i in range(NUM_FROZEN)]
            name, pid = spawner.spawn("private", 9)  # no stream: only its lease ends it
            for holder, _ in frozen + [(name, pid)]:
                spawner.ready(holder)
            live = NUM_CLIENTS + NUM_FROZEN
            assert status(d)[0] == live + 1
            stopped = [d.pid()] + [p for _, p in frozen]
            for p in stopped:
                os.kill(p, signal.SIGSTOP)
            try:
                spawner.kill(pid)  # dies while the daemon cannot notice
                time.sleep(3 * SHORT_LEASE)  # the stop itself: what the test is about
                os.kill(d.pid(), signal.SIGCONT)
                resumed = time.monotonic()
                time.sleep(FROZEN_AFTER_S)
            finally:
                for p in stopped:
                    os.kill(p, signal.SIGCONT)
            while status(d)[0] == live + 1:  # the dead holder's lease runs from SIGCONT
                assert time.monotonic() - resumed < SHORT_LEASE + SLACK_S, \
                    "a holder killed during the stop outlived its lease after SIGCONT"
                time.sleep(0.05)
            assert status(d)[0] == live, d.log()[-3000:]
            until = time.monotonic() + 2 * SHORT_LEASE  # two more leases: the live ones stay
            while time.monotonic() < until:
                assert status(d)[0] == live
                time.sleep(0.1)
            assert d.log_text().count("reason=lease expired") == 1, d.log()[-3000:]
            for client, seq, sid in zip(clients, seqs, ids):
                assert client.id == sid and client.lease_held, "the client had to attach again"
                client.extend(seq, [1, 2, 3])  # DaemonRestarted if its sequence had been lost
                assert not seq.reclaimed and seq.num_tokens == 43
        finally:
            for client in clients:
                client.close()
            spawner.close()
