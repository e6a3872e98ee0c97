"""The daemon's torch intra-op threads (``core.limit_intra_op_threads``): one, and
``OMP_NUM_THREADS`` when the operator set it; Attend's compute threads, one per CPU. Each case runs
in a fresh interpreter: the setting is process-wide."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROBE = ("import os, torch; from prefixd.daemon.core import limit_intra_op_threads as f; "
         "n = f(); print(n, torch.get_num_threads(), len(os.sched_getaffinity(0)))")


def _probe(**env) -> tuple[int, int, int]:
    clean = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True,
                         env=dict(clean, PYTHONPATH=ROOT, **env), timeout=120, check=True)
    returned, in_force, cpus = map(int, out.stdout.split())
    return returned, in_force, cpus


def test_one_intra_op_thread():
    returned, in_force, _ = _probe()
    assert returned == in_force == 1


def test_omp_num_threads_is_left_to_the_operator():
    returned, in_force, _ = _probe(OMP_NUM_THREADS="2")
    assert returned == in_force == 2


def test_the_daemon_logs_the_count_it_set():
    from tests.daemon.harness import DaemonProcess
    d = DaemonProcess()
    d.env.pop("OMP_NUM_THREADS", None)
    with d.start():
        log = d.log()
    assert "torch intra-op threads=1" in log, log[-2000:]


def test_one_compute_thread_per_cpu():
    from prefixd.daemon.core import compute_threads
    assert compute_threads() == len(os.sched_getaffinity(0))
