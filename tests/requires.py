"""Suites whose prerequisites CI provides: a missing one skips on a developer's machine and
fails under ``.ci/run``, which sets ``PREFIXD_REQUIRE_SUITES=1`` (a skip there would turn the
suite's green into a claim nobody checked).

    from tests.requires import missing
    if reason_fuse_is_unavailable:
        missing(f"powerfs unavailable: {reason}")   # skip, or fail under .ci/run
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

ENV = "PREFIXD_REQUIRE_SUITES"


def required() -> bool:
    """Whether a missing prerequisite fails the test (``.ci/run``) instead of skipping it."""
    return os.environ.get(ENV, "") not in ("", "0")


def missing(reason: str) -> NoReturn:
    """Skip with ``reason``; fail with it where the suites are required."""
    if required():
        pytest.fail(f"{reason} ({ENV} is set: .ci/run provides this suite's prerequisites, "
                    f"so a skip here would hide a broken setup)", pytrace=False)
    pytest.skip(reason)
