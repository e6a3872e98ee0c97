"""Docstrings and comments in ``prefixd/`` say what the code does and why, in the present tense:
no work-item numbers, no dates, no citations of benchmark runs. History lives in git, the
numbers that decided something in ``docs/design.md`` and the runs of record in ``docs/bench/``.

The check reads every line of every module (a work-item number or a date has no business in
code either), so a rewording that keeps the history in a comment fails here too."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "prefixd"

FORBIDDEN = {
    "a work item": re.compile(r"\bissues? #?\d+", re.I),
    "a date": re.compile(r"\b20\d\d-\d\d-\d\d\b"),
    "a run number": re.compile(r"\bruns? (of record|\d+)\b", re.I),
    "a benchmark run": re.compile(r"\b(dev host|2-core host|callgrind|bench runs?|(engine|rpc|wal|cluster|tiers|"
                                  r"recovery|e2e|vllm) bench('s)?)\b|\bbench/\w+\.py\W+(showed|measured)|"
                                  r"\bmeasured (on|here|at|in)\b", re.I),
}

def offending_lines(text: str) -> list[tuple[int, str, str]]:
    """``(line number, what, line)`` for every line of ``text`` that cites history."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for what, pattern in FORBIDDEN.items():
            if pattern.search(line):
                found.append((number, what, line.strip()))
    return found


def test_no_history_in_prefixd_modules():
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        problems += [f"{rel}:{n}: {what}: {line}" for n, what, line in offending_lines(path.read_text())]
    assert not problems, "say what the code does and why, without history:\n" + "\n".join(problems)


@pytest.mark.parametrize("line", [
    "the writer (issue 14) keeps",
    "# measured 2026-12-03 on the dev host",
    "the run of record had 0.91",
    "runs 2-5 spread 1.28-1.32",
    "bench/rpc_ablate.py showed the loop",
    "cost the engine bench's commit ~20 us",
    "(callgrind: 52.7k -> 35.8k)",
    "Measured here on 2 MiB blocks",
])
def test_each_kind_of_history_is_caught(line):
    """The patterns catch what they are for (a pattern that matches nothing guards nothing)."""
    assert offending_lines(line), line


@pytest.mark.parametrize("line", [
    "A commit hashes ~23 blocks; a slice each is a third of the hashing's instructions.",
    "Used by ``bench/e2e.py`` (numbers, JSON, plot) and ``make demo``.",
    "reconnect_s: float  # the client session's recovery, measured by a Stats call after it",
    "raise ConfigError(f'no socket named {name!r} on this host')",
    "The path is cut at the first run that cannot be had (a run of blocks, not a bench run)"[:60],
    "hf_logging.disable_progress_bar()  # a bar per load is noise in the demo's and bench's output",
])
def test_present_tense_reasons_pass(line):
    assert not offending_lines(line), line
