"""Fixtures for the power-loss suites: PowerFS instances that are always unmounted."""

from __future__ import annotations

import pytest

from tests.crash.powerfs import PowerFS, require_fuse


@pytest.fixture
def powerfs(tmp_path):
    """Factory: ``powerfs(name="fs", seed=0, mode="lose")`` -> an unmounted PowerFS under
    ``tmp_path/name``; skips the test when FUSE is unavailable; every one is closed (workload
    killed, unmounted) at teardown, whatever the test did."""
    require_fuse()
    made: list[PowerFS] = []

    def factory(name: str = "fs", **kwargs) -> PowerFS:
        fs = PowerFS(tmp_path / name, **kwargs)
        made.append(fs)
        return fs

    yield factory
    for fs in made:
        fs.close()
