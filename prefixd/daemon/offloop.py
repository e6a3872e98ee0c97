"""The engine's long work, done beside the event loop: checkpoints and making new pools.

The loop owns the engine and serves every call (``server.py``); anything it runs for long
delays every client by as much (``loop_lag``). Two kinds of the engine's work take long:

- **A checkpoint** (the engine's trigger, ``prefixctl checkpoint``, the stop): a 1M-block
  pool took 0.3-1.0 s to serialize and 0.3-2.2 s to write (``prefixd.engine.checkpointer``).
  ``checkpoint`` splits it: (1) on the loop, the picture's walk in slices of ~2 ms, one per
  loop turn (``prefixd.engine.picture_walk``: the runs changed meanwhile are marked), awaiting
  the disk barrier the log holds records behind, then ``begin_checkpoint``: settle the log and
  finish the picture (the marked runs again, O(marked)); (2) on the worker thread, the
  picture's bytes (``Picture.values``: GIL held in short steps); (3) on the log's committer thread, the LMDB write, awaited; (4) on the loop,
  ``end_checkpoint``. The engine serves calls between the steps: they change the tree, not
  the objects the picture holds, and their records come after the picture's lsn, so the
  checkpoint holds no effect whose record is not in the log before its lsn. At most one
  checkpoint of a pool runs at a time; the engine's trigger (``on_checkpoint_due``) starts
  one unless one runs.
- **Making a pool** (the first Attach of a layout): the manifest, the shm and disk files, the
  log (12.8 s for GBs on a loaded host). ``pool`` makes it on a thread of its own
  (``Engine.make_pool``: reads only the configuration) and adds it to the engine on the loop
  (``Engine.add_pool``); one make per (tenant, layout) at a time, every Attach of it waits for
  that one. It goes on whether or not the Attach that started it is still waiting.

Invariants: every pool of the engine has ``on_checkpoint_due`` set (``watch``); ``_making``
holds the makes in progress only; after ``drain`` nothing runs on the threads.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

from prefixd.engine.pool_dir import MANIFEST
from prefixd.storage.errors import StorageError
from prefixd.wal import WalNoSpaceError

log = logging.getLogger(__name__)

MAX_BARRIER_WAITS = 8  # awaited disk barriers before a checkpoint settles as it is (bounded)


class OffLoop:
    """The daemon's checkpoints and pool makes, off its event loop (see the module docstring).

    Used on the loop's thread only (its threads run only the parts named there).
    """

    def __init__(self) -> None:
        self._checkpointer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefixd-ckpt")
        self._maker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefixd-pool")
        self._locks: dict[int, asyncio.Lock] = {}  # by id(pool): one checkpoint at a time
        self._auto: dict[int, asyncio.Task] = {}  # checkpoints the engine's trigger started
        self._making: dict[tuple, asyncio.Task] = {}  # (tenant, layout) -> its make
        self.closing = False
        self.num_checkpoints = 0
        self.num_failed = 0

    # -- checkpoints ---------------------------------------------------------------------------

    def watch(self, dc) -> None:
        """Have pool ``dc``'s checkpoint trigger start a checkpoint here, not inline."""
        dc.on_checkpoint_due = functools.partial(self._due, dc)

    def _due(self, dc) -> None:
        key = id(dc)
        if self.closing or key in self._auto:
            return
        task = asyncio.get_running_loop().create_task(self._auto_checkpoint(dc))
        self._auto[key] = task
        task.add_done_callback(lambda _: self._auto.pop(key, None))

    async def _auto_checkpoint(self, dc) -> None:
        try:
            await self.checkpoint(dc)
        except WalNoSpaceError as exc:  # the log is intact: retried in a few seconds
            dc.upkeep.checkpoint_no_space(exc)
        except Exception as exc:  # noqa: BLE001 - the log still holds everything acknowledged
            log.error("checkpoint failed (the log keeps the records) path=%s error=%r",
                      dc.state_dir, exc)

    def busy(self, dc) -> bool:
        """Whether a checkpoint of pool ``dc`` runs or waits (it must not be closed)."""
        lock = self._locks.get(id(dc))
        return id(dc) in self._auto or (lock is not None and lock.locked())

    def forget(self, dc) -> None:
        """Pool ``dc`` was closed: drop what was kept for it."""
        self._locks.pop(id(dc), None)

    async def checkpoint(self, dc) -> int:
        """Checkpoint pool ``dc`` (after one already running ends); returns its lsn.

        Raises:
            whatever the engine's checkpoint raises (WalFailedError, StorageError).
        """
        lock = self._locks.setdefault(id(dc), asyncio.Lock())
        async with lock:
            loop = asyncio.get_running_loop()
            began = time.perf_counter()
            walk = dc.upkeep.begin_picture()
            try:
                held, longest = await self._walk(walk)
                for _ in range(MAX_BARRIER_WAITS):
                    barrier = dc.upkeep.checkpoint_barrier()
                    if barrier is None:
                        break
                    try:
                        await asyncio.wrap_future(barrier)
                    except Exception:  # noqa: BLE001 - begin_checkpoint raises it as the log's failure
                        break
                finished = time.perf_counter()
                picture = dc.upkeep.begin_checkpoint(walk)
                pictured = time.perf_counter()
                held += pictured - finished
                longest = max(longest, pictured - finished)
                index, seqs = await loop.run_in_executor(self._checkpointer, picture.values)
                made = time.perf_counter()
                await asyncio.wrap_future(dc.upkeep.submit_checkpoint(picture, index, seqs))
                dc.upkeep.end_checkpoint(picture)
            except BaseException:
                walk.close()
                self.num_failed += 1
                raise
            self.num_checkpoints += 1
            # the picture is the part on the loop: in slices (picture_ms, the loop held
            # held_ms of it in all, longest_ms at most at once)
            log.info("checkpoint taken path=%s lsn=%d runs=%d picture_ms=%.1f held_ms=%.1f "
                     "longest_ms=%.1f values_ms=%.1f write_ms=%.1f", dc.state_dir, picture.lsn,
                     len(picture.nodes), (pictured - began) * 1e3, held * 1e3, longest * 1e3,
                     (made - pictured) * 1e3, (time.perf_counter() - made) * 1e3)
            return picture.lsn

    @staticmethod
    async def _walk(walk) -> tuple[float, float]:
        """Step ``walk`` to its end, one slice per loop turn; returns the time it held the
        loop, in all and at most at once."""
        held = longest = 0.0
        while not walk.done:
            at = time.perf_counter()
            walk.step()
            took = time.perf_counter() - at
            held, longest = held + took, max(longest, took)
            await asyncio.sleep(0)
        return held, longest

    async def checkpoint_all(self, engine) -> dict:
        """Checkpoint every pool, each even if another fails; returns ``{key: lsn}``.

        Raises:
            the first pool's failure, after every pool was tried.
        """
        lsns, first = {}, None
        for key, dc in engine.pool_items():
            if dict(engine.pool_items()).get(key) is not dc:
                continue  # closed (empty) while an earlier pool's checkpoint ran
            try:
                lsns[key] = await self.checkpoint(dc)
            except WalNoSpaceError as exc:  # the log is intact; raised below all the same
                log.warning("checkpoint not taken: the filesystem is full tenant=%s model=%s "
                            "error=%s", key[0], key[1].model_id, exc)
                first = first or exc
            except Exception as exc:  # noqa: BLE001 - raised below, after the other pools
                log.error("checkpoint failed tenant=%s model=%s error=%r", key[0],
                          key[1].model_id, exc)
                first = first or exc
        if first is not None:
            raise first
        return lsns

    # -- pools ---------------------------------------------------------------------------------

    def is_making(self, tenant: str, layout) -> bool:
        return (tenant, layout) in self._making

    def making(self, tenant: str) -> int:
        """How many pools of ``tenant`` are being made."""
        return sum(1 for t, _ in self._making if t == tenant)

    async def pool(self, engine, tenant: str, layout, wait_s: float | None):
        """The pool of ``tenant`` and ``layout``, made off the loop; waits at most ``wait_s``
        (None: as long as it takes).

        The caller checks the pool does not exist and may be made before the first call for
        it. Returns None when ``wait_s`` passed first (the make goes on).

        Raises:
            StorageError: its files could not be made (its directory is removed: a pool whose
                files failed must not be opened at every later start).
            whatever ``Engine.make_pool`` raises.
        """
        key = (tenant, layout)
        task = self._making.get(key)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._make(engine, tenant, layout))
            self._making[key] = task
            task.add_done_callback(lambda t: (self._making.pop(key, None),
                                              t.cancelled() or t.exception()))
        done, _ = await asyncio.wait({task}, timeout=wait_s)
        return task.result() if done else None

    async def _make(self, engine, tenant: str, layout):
        path = engine.pool_path(tenant, layout)
        log.info("making a pool tenant=%s model=%s path=%s", tenant, layout.model_id, path)
        loop = asyncio.get_running_loop()
        closed = os.path.exists(os.path.join(path, MANIFEST))  # a pool closed empty, reopened
        try:
            dc = await loop.run_in_executor(self._maker, engine.make_pool, tenant, layout)
        except StorageError:
            if not closed:
                shutil.rmtree(path, ignore_errors=True)  # NOTE: see PrefixCacheService._pool
            raise
        engine.add_pool(tenant, layout, dc)
        self.watch(dc)
        if self.closing:
            log.info("pool made while stopping path=%s", path)
        return dc

    async def drain(self) -> None:
        """Stop starting checkpoints by trigger; wait for the running ones and the makes."""
        self.closing = True
        while self._auto or self._making:
            await asyncio.gather(*self._auto.values(), *self._making.values(),
                                 return_exceptions=True)

    def close(self) -> None:
        """After ``drain``: end the threads."""
        self._checkpointer.shutdown(wait=True)
        self._maker.shutdown(wait=True)
