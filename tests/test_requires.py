"""``tests.requires.missing``: a skip on a developer's machine, a failure under ``.ci/run``."""

import pytest

from tests.requires import ENV, missing


def test_a_missing_prerequisite_skips_where_suites_are_not_required(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="no fuse here"):
        missing("no fuse here")


def test_a_missing_prerequisite_fails_under_ci_run(monkeypatch):
    monkeypatch.setenv(ENV, "1")
    with pytest.raises(pytest.fail.Exception, match=f"no fuse here \\({ENV} is set"):
        missing("no fuse here")


def test_ci_run_sets_the_variable():
    import pathlib
    ci = (pathlib.Path(__file__).resolve().parents[1] / ".ci" / "run").read_text()
    assert f"export {ENV}=1" in ci
