"""A pool with no session and no cached block is closed by a real daemon process: its files
are no longer open (``/proc/<pid>/fd``) or mapped (``/proc/<pid>/maps``), its shm files are
gone, its directory takes next to nothing and its budget charges are back; the next Attach of its layout opens it again. A pool
with cached blocks stays open. A kill -9 right after a close loses nothing acknowledged."""

from __future__ import annotations

import os
import time

import grpc

from prefixd.api import prefixd_pb2 as pb
from tests.daemon.harness import start_daemon
from tests.daemon.test_budgets import attach, config, layout, prompt, store, taken

MiB = 1 << 20


def open_paths(pid: int) -> set[str]:
    """Every file the process has open (fds) or mapped."""
    paths = set()
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            paths.add(os.readlink(os.path.join(fd_dir, fd)))
        except OSError:
            pass
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6:
                paths.add(parts[5].strip())
    return paths


def shm_names(shm_dir: str) -> set[str]:
    return set(os.listdir(shm_dir)) if os.path.isdir(shm_dir) else set()


def used(stub, tier: str) -> int:
    status = stub.Status(pb.StatusRequest())
    return {b.tier: b.used_bytes for b in status.budgets}[tier]


def wait_for(what, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        got = what()
        if got:
            return got
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def pool_dirs(d) -> list[str]:
    return [os.path.join(d.state_dir, "pools", "alpha", n)
            for n in os.listdir(os.path.join(d.state_dir, "pools", "alpha"))]


def test_an_empty_pool_is_closed_after_detach_and_reopened_by_the_next_attach():
    """Attach and Detach with nothing committed: the pool's log, disk file and shm files are
    no longer open or mapped, its shm files are gone, its charges back in every ledger but
    what its directory still takes (charged to its tenant on the disk ledger); a
    second Attach of the layout opens it again and serves commits."""
    with start_daemon(config(), lease_s=600.0) as d:
        stub = d.stub()
        base_shm = shm_names(d.shm_dir)
        disk_before = used(stub, "disk")
        sid = attach(stub, layout("empty"))
        seq = stub.Open(pb.OpenRequest(session_id=sid, tokens=prompt(1, 4, 4))).sequence
        pool_dir = pool_dirs(d)[0]
        new_shm = shm_names(d.shm_dir) - base_shm
        assert new_shm, "the pool has shm files while open"
        paths = open_paths(d.proc.pid)
        assert any(p.startswith(pool_dir + "/") for p in paths), "the pool's files are open"
        assert used(stub, "host") > 0 and used(stub, "disk") > disk_before
        stub.Release(pb.ReleaseRequest(session_id=sid, seq_id=seq.seq_id))  # nothing committed
        stub.Detach(pb.DetachRequest(session_id=sid))

        wait_for(lambda: "pool closed" in d.log_text())
        paths = open_paths(d.proc.pid)
        assert not [p for p in paths if p.startswith(pool_dir + "/")], "still open or mapped"
        assert not [p for p in paths if os.path.basename(p) in new_shm], "shm still mapped"
        assert not (shm_names(d.shm_dir) & new_shm), "the shm files stay"
        assert taken(pool_dir) < 1 * MiB  # the log, the manifest, the disk file's header page
        assert used(stub, "device") == used(stub, "host") == 0
        assert used(stub, "disk") == disk_before + taken(pool_dir)  # a closed pool's files
        assert not stub.Status(pb.StatusRequest()).pools

        sid = attach(stub, layout("empty"))  # opened again
        store(stub, sid, prompt(2, 4, 4))
        hit = stub.Lookup(pb.LookupRequest(session_id=sid, tokens=prompt(2, 4, 4)))
        assert hit.cached_tokens == 16


def test_a_pool_with_cached_blocks_stays_open_after_detach():
    with start_daemon(config(), lease_s=600.0) as d:
        stub = d.stub()
        sid = attach(stub, layout("kept"))
        store(stub, sid, prompt(1, 4, 4))
        stub.Detach(pb.DetachRequest(session_id=sid))
        sid2 = attach(stub, layout("other"))  # its own pool; ticks go by meanwhile
        stub.Detach(pb.DetachRequest(session_id=sid2))
        wait_for(lambda: "pool closed" in d.log_text())  # the empty one closes ...
        assert [p.model_id for p in stub.Status(pb.StatusRequest()).pools] == ["kept"]  # ... not this
        kept = [p for p in pool_dirs(d) if os.path.basename(p).startswith("kept")][0]
        assert any(p.startswith(kept + "/") for p in open_paths(d.proc.pid))
        sid = attach(stub, layout("kept"))
        assert stub.Lookup(pb.LookupRequest(session_id=sid, tokens=prompt(1, 4, 4))).cached_tokens == 16


def test_a_kill_right_after_a_close_loses_nothing_and_the_pool_reopens():
    """kill -9 as soon as the close is logged: the restart recovers every pool (the closed
    one as an empty pool, closed again), the other pool's acknowledged commits are hits, and
    the closed layout attaches and serves again."""
    with start_daemon(config(), lease_s=600.0) as d:
        stub = d.stub()
        keep = attach(stub, layout("durable"))
        for i in range(6):
            store(stub, keep, prompt(i, 4, 4))
        sid = attach(stub, layout("closing"))
        store(stub, sid, prompt(100, 0, 4))  # one token: no full block, nothing cached
        stub.Detach(pb.DetachRequest(session_id=sid))
        wait_for(lambda: "pool closed" in d.log_text())
        d.kill()
        d.restart()
        stub = d.stub()
        wait_for(lambda: d.log_text().count("pool closed") >= 2)  # found empty at start: closed again
        keep = attach(stub, layout("durable"))
        for i in range(6):
            assert stub.Lookup(pb.LookupRequest(session_id=keep, tokens=prompt(i, 4, 4))).cached_tokens == 16
        sid = attach(stub, layout("closing"))
        store(stub, sid, prompt(7, 4, 4))
        assert stub.Lookup(pb.LookupRequest(session_id=sid, tokens=prompt(7, 4, 4))).cached_tokens == 16


def test_a_pool_closed_while_empty_still_counts_toward_pools_per_tenant():
    """A closed pool keeps its files and reopens at the next Attach of its layout, so it is
    still one of the tenant's pools: with ``pools_per_tenant = 2``, one closed and one open
    pool leave no room for a third layout, and the closed layout attaches again."""
    with start_daemon(config() + "\n[daemon.limits]\npools_per_tenant = 2\n",
                      lease_s=600.0) as d:
        stub = d.stub()
        stub.Detach(pb.DetachRequest(session_id=attach(stub, layout("first"))))
        wait_for(lambda: "pool closed" in d.log_text())
        stub.Detach(pb.DetachRequest(session_id=attach(stub, layout("second"))))
        try:
            attach(stub, layout("third"))
            raise AssertionError("a third pool was made past pools_per_tenant = 2")
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
            assert "pools_per_tenant" in err.details()
        sid = attach(stub, layout("first"))  # reopened, not a new pool
        stub.Detach(pb.DetachRequest(session_id=sid))
        assert len(pool_dirs(d)) == 2
