"""Fixtures for the WAL tests: temporary state directories, Wal factories, child processes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import lmdb
import pytest

from prefixd.wal import Wal

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def state_dir(tmp_path):
    return str(tmp_path / "state")


@pytest.fixture
def open_wal(state_dir):
    """Factory: ``open_wal(**kwargs)`` opens a Wal on the test's state dir; all close at teardown."""
    opened: list[Wal] = []

    def factory(path: str | None = None, **kwargs) -> Wal:
        kwargs.setdefault("layouts", b"layout-v1")
        wal = Wal(path or state_dir, **kwargs)
        opened.append(wal)
        return wal

    yield factory
    for wal in opened:
        wal.close()


def run_child(code: str, crash: str = "", timeout: float = 30) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with the repo importable and PREFIXD_CRASH=crash."""
    env = dict(os.environ, PYTHONPATH=REPO, PREFIXD_CRASH=crash)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                          text=True, timeout=timeout)


def raw_env(state_dir: str) -> lmdb.Environment:
    """The environment opened directly (no Wal), for tests that damage or inspect it."""
    return lmdb.open(os.path.join(state_dir, "wal"), max_dbs=8, map_size=1 << 30)
