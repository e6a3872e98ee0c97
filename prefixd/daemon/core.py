"""What every socket's servicer shares: the engine, the sessions, the daemon's state.

States: ``recovering`` (the engine opens on a worker thread; only Status and health answer),
``serving``, ``stopping`` (SIGTERM/SIGINT: no new calls; in-flight ones finish). Everything
here is touched on the event-loop thread only.
"""

from __future__ import annotations

import os
import secrets
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import torch

from prefixd.config.daemon_settings import DaemonConfig
from prefixd.config.engine_settings import EngineConfig
from prefixd.daemon.event_journal import EventJournals
from prefixd.daemon.loop_lag import LoopLag
from prefixd.daemon.metrics import RpcTimes
from prefixd.daemon.offloop import OffLoop
from prefixd.daemon.sessions import SessionTable
from prefixd.daemon.status import unavailable
from prefixd.engine.progress import RecoveryProgress

RECOVERING, SERVING, STOPPING = "recovering", "serving", "stopping"


def limit_intra_op_threads() -> int:
    """Set torch's intra-op threads for the daemon's process to 1, unless ``OMP_NUM_THREADS``
    says otherwise; returns the count in force. Attend's parallelism comes from the compute
    threads instead (``attend_job``).

    NOTE: Attend's kernel runs on a compute thread, not the process's first thread, and
    libgomp (torch's OpenMP on Linux) counts a team started there on top of that first
    thread: a team as wide as the CPUs makes it "throttled", and its workers sleep on a futex
    between the kernel's many small parallel regions instead of spinning: a decode step takes
    about half as long single-threaded, or split over single-threaded compute threads, as in
    a throttled team (``docs/design.md``, "Daemon": "Attend's kernel leaves the loop").
    """
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    torch.set_num_threads(1)
    return torch.get_num_threads()


def compute_threads() -> int:
    """How many threads run Attend's kernels: one per CPU this process may use."""
    return len(os.sched_getaffinity(0))


class DaemonCore:
    """The daemon's shared state.

    Invariants: ``engine`` is None iff ``state == RECOVERING`` (or the engine failed to open,
    in which case the daemon exits); ``epoch`` never changes after construction.
    """

    def __init__(self, engine_config: EngineConfig, config: DaemonConfig, state_dir: str) -> None:
        self.engine_config = engine_config
        self.config = config
        self.state_dir = state_dir
        self.engine = None
        self.state = RECOVERING
        self.epoch = secrets.randbits(63) or 1
        self.started = time.monotonic()
        self.sessions = SessionTable(config.lease_s, config.limits)
        self.sessions.on_end = self.session_ended
        self.calls: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.rpc_times = RpcTimes()  # latency by (method, status), fed by ``rpc_call.rpc``
        self.loop_lag = LoopLag()  # how late the loop runs (``loop_lag``), started by ``server``
        self.offloop = OffLoop()  # checkpoints and new pools, beside the loop (``offloop``)
        self.metrics = None  # the Prometheus endpoint (``metrics_http.MetricsExporter``), if started
        self.in_flight = 0
        # unary calls matched and not yet finished on the wire (their status sent): a clean
        # stop waits for none before the process ends (``server.Daemon._drain``)
        self.open_calls = 0
        self.progress = RecoveryProgress()  # records replayed / to replay while recovering
        self.keepalive_tasks: set = set()  # KeepAlive handlers' tasks, cancelled at a stop
        # KV events for routers, per tenant (fed by the engine once it serves; SubscribeEvents)
        self.events = EventJournals([t.name for t in engine_config.tenants], self.epoch,
                                    config.events.ring_size, config.events.subscriber_queue)
        # the same on ZMQ in vLLM's format (``kv_publisher``), when configured; bound by ``server``
        self.kv_publishers = None
        # Attend's kernels, off the loop (``kv_rpc``'s NOTE), a batch split over the threads
        # (``attend_job``), started at the first Attend; the daemon waits for them before it
        # closes the engine (``server._shutdown``)
        self.compute_threads = compute_threads()
        self.compute = ThreadPoolExecutor(max_workers=self.compute_threads,
                                          thread_name_prefix="prefixd-attend")

    def session_ended(self, session) -> None:
        """``SessionTable.on_end``: a pool no session uses any more is a candidate to close."""
        if self.engine is not None and not any(s.pool is session.pool for s in self.sessions):
            self.engine.note_unused(session.tenant, session.layout)

    def close_empty_pools(self) -> int:
        """On the tick: close the candidate pools that hold nothing and that no session uses
        (``Engine.close_empty_pools``); returns how many closed."""
        engine = self.engine
        if engine is None or not (engine.closer.candidates or engine.tier_lru.emptied):
            return 0
        used = {(s.tenant, s.layout) for s in self.sessions}
        closing = {key: dc for key, dc in engine.pool_items()}
        closed = engine.close_empty_pools(used, self.offloop.busy)
        for key in closed:
            self.offloop.forget(closing[key])
            if self.kv_publishers is not None:  # its tree goes with it; a reopen brings a new one
                self.kv_publishers.forget_pool(closing[key].cache.tree)
        return len(closed)

    def call_closed(self, _context=None) -> None:
        """A unary call finished (its status sent): the done callback ``rpc_call.rpc`` sets."""
        self.open_calls -= 1

    def check_serving(self) -> None:
        """Raises UNAVAILABLE unless the daemon serves."""
        if self.state == SERVING:
            return
        if self.state == RECOVERING:
            raise unavailable("the daemon is recovering its cache after a restart: retry in a "
                              "moment (prefixctl status shows the progress)")
        raise unavailable("the daemon is shutting down: retry once it is back")
