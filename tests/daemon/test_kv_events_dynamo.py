"""NVIDIA Dynamo's KV router index, fed from the daemon's ZMQ KV events, agrees with the daemon.

Four client processes (``tests.daemon.gsp_load``, through ``prefixd.client``) send gsp
requests to a daemon whose tiers are small enough that blocks are evicted, demoted and promoted.
A subscriber (``tests.daemon.kv_sub``) turns every batch into Dynamo ``RadixTree`` events for
one worker (``DynamoView``: block_hash = the published hash, tokens_hash =
``compute_block_hash_for_seq`` of the block's token ids, parent = the published parent). With
the clients stopped (quiesced), ``find_matches`` of 500 prompts, seen and unseen, equals the
daemon's own ``Lookup`` in blocks (every tier); then the clients run again, the daemon is
``kill -9``ed midway and restarted, and 500 more prompts agree with the restarted daemon (its
stream: ``AllBlocksCleared``, the recovered index, live events; the subscriber never
restarts). So does a tree per medium (``MediumViews``: every store carries its parent and token
ids). A control view that ignores ``BlockRemoved`` disagrees somewhere: the check can fail.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time


import prefixd.client as pc
from tests.daemon.gsp_workload import BS, LAYOUT, systems
from tests.daemon.harness import start_daemon
from tests.daemon.json_lines import LineTail
from tests.daemon.kv_sub import KVSub, decode
from tests.requires import missing

try:
    import dynamo._core as dynamo
except ImportError:  # the test extras not installed: the test says so (tests.requires)
    dynamo = None

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = 7
CLIENTS = 4
PROMPTS = 500  # per check: before and after the restart

CONFIG = """
[engine]
sync = "commit"
shm_dir = "{shm}"

[engine.blocks]
device = 64
host = 64
disk = 96

[daemon]
lease_s = {lease_s}

[daemon.kv_events]
endpoint = "ipc://{base}/kv"
replay_endpoint = "ipc://{base}/kvr"
buffer_batches = 200000
"""


class RouterIndex:
    """Dynamo's ``RadixTree``, fed router events (JSON, numbered in the order they are applied)
    for any of its workers; ``problems`` lists every event the tree refused."""

    def __init__(self) -> None:
        self.tree = dynamo.RadixTree()
        self.problems: list[str] = []
        self.event_id = 0

    def apply(self, worker: int, data: dict) -> None:
        self.event_id += 1
        body = json.dumps({"event_id": self.event_id, "data": data, "dp_rank": 0}).encode()
        try:
            self.tree.apply_event(worker, body)
        except Exception as exc:  # noqa: BLE001 - listed, the test fails on it
            self.problems.append(f"{exc}: {body[:300]!r}")

    def clear(self, worker: int) -> None:
        self.tree.clear_all_blocks(worker)

    def scores(self, tokens) -> dict:
        """``(worker, dp_rank) -> blocks matched`` of ``tokens``."""
        return self.tree.find_matches(dynamo.compute_block_hash_for_seq(tokens, BS)).scores


class DynamoView:
    """Dynamo's ``RadixTree`` for one worker, fed batch by batch. A block is in the tree while
    some medium holds it (``where``): a copy into another tier adds a medium, a removal takes
    one away, and the block leaves the tree with its last. ``problems`` lists what a router
    could not apply (a store of an unknown block without token ids, a removal of one it never
    saw, an event Dynamo refused: the index's own list). ``apply_removals=False``: the control
    that ignores them."""

    def __init__(self, apply_removals: bool = True) -> None:
        self.index = RouterIndex()
        self.where: dict[int, set[str]] = {}
        self.apply_removals = apply_removals
        self.problems = self.index.problems
        self.run_batches = 0  # batches since the last AllBlocksCleared (it included)

    def batch(self, seq: int, payload: bytes) -> None:
        self.run_batches += 1
        for e in decode(payload)[1]:
            kind = e["type"]
            if kind == "AllBlocksCleared":
                self.index.clear(WORKER)
                self.where.clear()
                self.run_batches = 1
            elif kind == "BlockStored":
                self._stored(e)
            elif kind == "BlockRemoved" and self.apply_removals:
                self._removed(e)

    def _stored(self, e) -> None:
        hashes, medium = e["block_hashes"], e["medium"]
        if not e["token_ids"]:
            self.problems.append(f"a store without token ids: {e}")
        known = 0
        while known < len(hashes) and hashes[known] in self.where:
            known += 1  # a run's known blocks come first: every tier holds prefixes
        if known < len(hashes):
            if not e["token_ids"]:
                self.problems.append(f"a store of unknown blocks without token ids: {e}")
                return
            tokens_hashes = dynamo.compute_block_hash_for_seq(e["token_ids"], e["block_size"])
            parent = hashes[known - 1] if known else e["parent_block_hash"]
            self.index.apply(WORKER, {"stored": {"parent_hash": parent, "blocks": [
                {"block_hash": h, "tokens_hash": t}
                for h, t in zip(hashes[known:], tokens_hashes[known:])]}})
        for h in hashes:
            self.where.setdefault(h, set()).add(medium)

    def _removed(self, e) -> None:
        gone = []
        for h in e["block_hashes"]:
            media = self.where.get(h)
            if media is None or e["medium"] not in media:
                self.problems.append(f"a removal of a block not stored on {e['medium']}: {h}")
                continue
            media.discard(e["medium"])
            if not media:
                del self.where[h]
                gone.append(h)
        if gone:
            self.index.apply(WORKER, {"removed": {"block_hashes": gone[::-1]}})

    def matches(self, tokens) -> int:
        return self.index.scores(tokens).get((WORKER, 0), 0)


class MediumViews:
    """A Dynamo ``RadixTree`` worker per medium, each fed that medium's events as they come
    (every tier holds root-anchored prefixes, and every store carries its parent and token
    ids): the deepest match over the media is the match over the union."""

    WORKERS = {"GPU": 1, "CPU": 2, "DISK": 3}

    def __init__(self) -> None:
        self.index = RouterIndex()
        self.problems = self.index.problems

    def batch(self, seq: int, payload: bytes) -> None:
        for e in decode(payload)[1]:
            if e["type"] == "AllBlocksCleared":
                for w in self.WORKERS.values():
                    self.index.clear(w)
                continue
            w = self.WORKERS[e["medium"]]
            if e["type"] == "BlockStored":
                data = {"stored": {"parent_hash": e["parent_block_hash"], "blocks": [
                    {"block_hash": h, "tokens_hash": t} for h, t in zip(
                        e["block_hashes"],
                        dynamo.compute_block_hash_for_seq(e["token_ids"], e["block_size"]))]}}
            else:
                data = {"removed": {"block_hashes": e["block_hashes"][::-1]}}
            self.index.apply(w, data)

    def matches(self, tokens) -> int:
        scores = self.index.scores(tokens)
        return max((scores.get((w, 0), 0) for w in self.WORKERS.values()), default=0)


class Load:
    """``CLIENTS`` gsp clients through the client library, until ``stop``."""

    def __init__(self, socket: str, out: str, seed: int) -> None:
        self.out = out
        os.makedirs(out, exist_ok=True)
        self.parent = subprocess.Popen(
            [sys.executable, "-m", "tests.daemon.gsp_load", socket, out, str(CLIENTS),
             str(seed), "0.01", str(CLIENTS)], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.pids = [int(self.parent.stdout.readline()) for _ in range(CLIENTS)]
        self.tails = [LineTail(os.path.join(out, f"acks-{i}")) for i in range(CLIENTS)]

    @property
    def acks(self) -> list[dict]:
        return [a for tail in self.tails for a in tail.read()]

    def wait_acks(self, n: int, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if len(self.acks) >= n:
                return
            for i, pid in enumerate(self.pids):
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    err = open(os.path.join(self.out, f"stderr-{i}")).read()[-3000:]
                    raise AssertionError(f"load client {i} exited:\n{err}") from None
            assert time.monotonic() < deadline, f"{len(self.acks)} of {n} acks"
            time.sleep(0.05)

    def stop(self) -> None:
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.parent.stdin.close()
        self.parent.wait(30)


def prompts(acks: list[dict], n: int, rng: random.Random) -> list[list[int]]:
    """``n`` prompts: half seen (acknowledged, whole or cut), half unseen (a seen prompt's
    prefix with a new tail, a system prompt with a new question, random tokens)."""
    seen = [a["tokens"] for a in acks]
    out = []
    for i in range(n):
        base = rng.choice(seen)
        kind = i % 4
        if kind == 0:
            out.append(base)
        elif kind == 1:
            out.append(base[:rng.randrange(1, len(base) + 1)])
        elif kind == 2:
            cut = rng.randrange(len(base) + 1)
            out.append(base[:cut] + [rng.randrange(50000) for _ in range(rng.randint(1, 40))])
        else:
            out.append(rng.choice(systems())[:rng.randint(1, 80)]
                       + [rng.randrange(50000) for _ in range(rng.randint(0, 40))])
    return out


def revisit(session, acks: list[dict], n: int) -> None:
    """Open (and release) ``n`` of the oldest acknowledged prompts: their demoted blocks are
    promoted back to the device, evicting others."""
    for a in acks[:n]:
        for _ in range(3):
            try:
                session.release(session.open(a["tokens"]))
                break
            except pc.DaemonRestarted:  # the library attached again to the restarted daemon
                continue


def check(session, sub: KVSub, views, acks, seed: int) -> dict:
    """Quiesce, then compare ``find_matches`` with ``Lookup`` for ``PROMPTS`` prompts."""
    view, control, media = views
    deadline = time.monotonic() + 60
    while True:  # nothing pending: every batch sent
        try:
            stats = session.stats()
        except pc.DaemonRestarted:  # the library attached again to the restarted daemon
            continue
        if not stats["prefixd_kv_events_pending"]:
            break
        assert time.monotonic() < deadline, "events still pending after 60 s"
        time.sleep(0.005)
    n = int(stats["prefixd_kv_events_batches_total"])
    sub.wait(lambda s: view.run_batches >= n, f"{n} batches of this daemon run", timeout=120)
    assert view.run_batches == n and sub.lost == 0, (view.run_batches, n, sub.lost)
    rng = random.Random(seed)
    wrong, control_wrong, hits = [], 0, 0
    for tokens in prompts(acks, PROMPTS, rng):
        r = session.lookup_tiers(tokens)
        want = (r.device_tokens + r.host_tokens + r.disk_tokens) // BS
        with sub.lock:
            got, other, per_medium = (view.matches(tokens), control.matches(tokens),
                                      media.matches(tokens))
        hits += want > 0
        if got != want or per_medium != want:
            wrong.append((len(tokens), want, got, per_medium))
        control_wrong += other != want
    assert not view.problems and not media.problems, (view.problems + media.problems)[:5]
    assert not wrong, (f"{len(wrong)} of {PROMPTS} prompts differ (tokens, Lookup, Dynamo union, "
                       f"Dynamo per medium): {wrong[:10]}")
    assert hits > PROMPTS // 4, hits
    return {"control_wrong": control_wrong, "hits": hits}


def test_dynamo_radix_tree_agrees_with_lookup_across_a_kill9(tmp_path):
    if dynamo is None:
        missing("ai-dynamo-runtime is not installed (pip install -e '.[router]')")
    views = (DynamoView(), DynamoView(apply_removals=False), MediumViews())

    def on_batch(seq, payload):
        for v in views:
            v.batch(seq, payload)

    with start_daemon(CONFIG) as d:
        sub = KVSub(f"ipc://{d.base}/kv", f"ipc://{d.base}/kvr", on_batch=on_batch)
        session = pc.connect(d.socket, pc.KVLayout(**LAYOUT), "dynamo-check")
        try:
            load = Load(d.socket, str(tmp_path / "a"), seed=1)
            try:
                load.wait_acks(150)
            finally:
                load.stop()
            revisit(session, load.acks, 40)
            before = check(session, sub, views, load.acks, seed=11)
            stats = session.stats()
            for key in ('prefixd_kv_events_removed_blocks_total{medium="GPU"}',
                        'prefixd_kv_events_removed_blocks_total{medium="CPU"}',
                        'prefixd_kv_events_removed_blocks_total{medium="DISK"}',
                        'prefixd_kv_events_stored_blocks_total{medium="DISK"}'):
                assert stats[key] > 0, (key, stats)  # evicted, demoted, forgotten
            assert sum(v for k, v in stats.items()
                       if k.startswith("prefixd_promoted_blocks_total")) > 0  # and promoted
            acks = load.acks
            load = Load(d.socket, str(tmp_path / "b"), seed=2)
            try:
                load.wait_acks(60)
                d.kill()
                d.start()
                load.wait_acks(120)
            finally:
                load.stop()
            revisit(session, load.acks, 40)
            after = check(session, sub, views, acks + load.acks, seed=12)
            assert before["control_wrong"] + after["control_wrong"] > 0, (before, after)
            assert sub.replays >= 2  # the first connection and the restart's jump
            print("dynamo check", before, after, "batches", len(sub.batches))
        finally:
            session.close()
            sub.close()
