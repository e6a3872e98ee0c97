"""The daemon ``bench/rpc_stages.py`` traces: ``prefixd serve`` with timestamps at each stage of
an Open and a Release (with commit), written as JSON to ``$PREFIXD_STAGES_OUT`` at exit.

Run as ``python bench/rpc_stage_probe.py serve ...`` (the arguments of ``prefixd serve``). The
probes wrap methods before the daemon starts; nothing of ``prefixd`` is changed on disk. Clock:
``time.perf_counter_ns`` (CLOCK_MONOTONIC, so the client's stamps compare with these).

Per call (``calls``): ``m`` (Open / Release), ``in`` / ``out`` (the handler, outside the
``rpc`` wrapper), ``engine_in`` / ``engine_out`` (``DurableCache.open`` / ``release``),
``flush`` (the first WAL flush the call asked for), ``resolved`` (the ticket's done-callback,
on the committer thread), ``resumed`` (the handler again, after ``durable``). Per WAL group
(``groups``): ``woken`` (the committer past its wait), ``txn_in`` / ``txn_out`` (the LMDB write
transaction, fsync included), ``records``.

NOTE: a benchmark tool, not a test: the probes cost a few microseconds each and are never
installed outside this script.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import sys
import time

clock = time.perf_counter_ns
calls: list[dict] = []
groups: list[dict] = []
_cur: dict = {}


def _wrap_handler(cls, name: str) -> None:
    inner = getattr(cls, name)

    async def handler(self, request, context):
        _cur.clear()
        t_in = clock()
        try:
            return await inner(self, request, context)
        finally:
            calls.append(dict(_cur, m=name, t_in=t_in, t_out=clock()))

    setattr(cls, name, handler)


def _wrap_engine(cls, name: str) -> None:
    inner = getattr(cls, name)

    def call(self, *args, **kwargs):
        _cur["engine_in"] = clock()
        try:
            return inner(self, *args, **kwargs)
        finally:
            _cur["engine_out"] = clock()

    setattr(cls, name, call)


def install() -> None:
    from prefixd.daemon import service
    from prefixd.engine.durable import DurableCache
    from prefixd.wal import group as wal_group
    from prefixd.wal.env import WalEnv

    for name in ("Open", "Release"):
        _wrap_handler(service.PrefixCacheService, name)
    for name in ("open", "release"):
        _wrap_engine(DurableCache, name)

    inner_durable = service.durable  # what the handlers call (imported from ack_wait)

    async def durable(ticket):
        ticket.add_done_callback(lambda _t: _cur.setdefault("resolved", clock()))
        try:
            return await inner_durable(ticket)
        finally:
            _cur["resumed"] = clock()

    service.durable = durable

    gc = wal_group.GroupCommitter
    inner_flush, inner_gather, inner_commit = gc.flush, gc._gather, gc._commit_group
    inner_flush_into = gc.flush_into

    def flush(self):
        _cur.setdefault("flush", clock())
        return inner_flush(self)

    def flush_into(self, waiters):  # how the engine asks for its commit ticket
        _cur.setdefault("flush", clock())
        return inner_flush_into(self, waiters)

    def gather(self):
        groups.append({"woken": clock()})
        return inner_gather(self)

    def commit_group(self, group, last):
        if not groups or "txn_in" in groups[-1]:  # an inline commit (no wait before it)
            groups.append({"woken": None})
        groups[-1]["records"] = len(group)
        return inner_commit(self, group, last)

    inner_write = WalEnv.write

    def write(self, fn):
        entry = groups[-1] if groups and "records" in groups[-1] and "txn_in" not in groups[-1] else {}
        entry["txn_in"] = clock()
        try:
            return inner_write(self, fn)
        finally:
            entry["txn_out"] = clock()

    gc.flush, gc.flush_into, gc._gather, gc._commit_group = flush, flush_into, gather, commit_group
    WalEnv.write = write
    atexit.register(_dump)


def _dump() -> None:
    with open(os.environ["PREFIXD_STAGES_OUT"], "w") as f:
        json.dump({"calls": calls, "groups": [g for g in groups if "txn_out" in g]}, f)


if __name__ == "__main__":
    install()
    sys.argv[0] = "prefixd.daemon.cli"
    runpy.run_module("prefixd.daemon.cli", run_name="__main__", alter_sys=True)
