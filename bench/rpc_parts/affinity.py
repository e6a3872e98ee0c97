"""Pinning a bench's server processes to CPUs (``bench/rpc.py --server-cpus``).

``preexec(cpus)`` is a ``subprocess.Popen`` ``preexec_fn`` that sets the child's CPU affinity
before it execs, as systemd's ``CPUAffinity=`` or ``taskset -c`` would: every thread the
server starts inherits it. The daemon and the floor's echo server get the same set, so the
pair compares one deployment with the same deployment.
"""

from __future__ import annotations

import argparse
import os


def parse_cpus(text: str) -> frozenset[int]:
    """``"1"`` or ``"2,3"`` as a set of CPU numbers this process may run on.

    Raises:
        argparse.ArgumentTypeError: not a comma-separated list of ints, or a CPU
        this process cannot use.
    """
    try:
        cpus = frozenset(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--server-cpus takes CPU numbers separated by commas, got {text!r}") from None
    allowed = os.sched_getaffinity(0)
    if not cpus or not cpus <= allowed:
        raise argparse.ArgumentTypeError(
            f"--server-cpus {text!r}: this process may run on CPUs {sorted(allowed)} only")
    return cpus


def preexec(cpus: frozenset[int] | None):
    """A ``preexec_fn`` pinning the child to ``cpus``; None when ``cpus`` is None."""
    if cpus is None:
        return None
    return lambda: os.sched_setaffinity(0, cpus)
