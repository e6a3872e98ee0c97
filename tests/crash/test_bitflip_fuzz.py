"""Bit-flip fuzz of a closed state directory: every damaged open ends promptly, typed, never wrong.

One state directory is built (``tests.crash.corruption_harness``'s prompts, the first three at
``power`` then a checkpoint, the last two at ``crash``, shm pools kept as on the same boot, so
the checkpoint, the log tail, the disk pool and the host pool all hold something). Each trial
copies it, flips random bits in it (seeded, so a failing trial can be replayed), and recovers
the copy in a forked child with a deadline (``recovery_driver``). A trial passes when it ends in
one of:

- a clean open that serves no wrong byte: every prompt is opened and each block it reports
  cached holds exactly the bytes written (store reads of the device slots), invariants hold
  (with ``verify="eager"`` every block left in the index is checked in every tier too);
- an error of a typed family (``WalError``, ``CacheError``, ``StorageError``) whose message
  says what to do.

Never a bare ``KeyError``/``struct.error``/``IndexError``, a signal (SIGSEGV, SIGBUS) or a hang.

Where the flips go: ``wal/data.mdb`` anywhere (as the fixture of the prefetch hang was made);
the disk pool anywhere, half of them in its header page; the device pool anywhere (it is
dropped at every restart); the host pool in its header page only. NOTE: host slots are trusted
memory after a restart on the same boot (DESIGN.md: "host (shm) residency is kept only if the
boot id matches", re-checked on the way up only for disk), as the device pool is on a GPU: a
flipped host slot is a memory error, which prefixd does not claim to detect.

    python -m tests.crash.test_bitflip_fuzz run SPEC.json
recovers each trial directory listed in SPEC.json in its own forked child and prints one JSON
line: trial name -> ``{"error": [mro], "message": ...}`` (``"after_open"`` when the open succeeded
and a later call raised), ``{"served": [...]}``,
``{"died": rc, "stderr": ...}`` or ``{"hung": seconds}``.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import sys
from functools import partial
from pathlib import Path

import pytest

from prefixd.cache.errors import CacheError
from prefixd.storage.errors import StorageError
from prefixd.wal.errors import WalError
from tests.crash.corruption_harness import PAGE, PROMPTS, commit_prompts, flip_bit, open_cache, serve_all
from tests.crash.recovery_driver import recover_in_child, run_driver

TRIAL_TIMEOUT_S = 30.0  # a recovery of this tiny state takes well under a second
TYPED_ERRORS = (WalError, CacheError, StorageError)
TYPED = tuple(f"{k.__module__}.{k.__name__}" for k in TYPED_ERRORS)
# what an error that says what to do contains (each typed error's advice, in one of its words)
ADVICE = re.compile(r"restore|move .* (aside|away)|delete|put the file back|point the daemon|lower the|"
                    r"start with|start the prefixd|free space|grow the pool|restart", re.I)


def build(root: Path) -> tuple[str, str]:
    """The base state directory and shm directory (see the module docstring)."""
    state, shm = root / "state", root / "shm"
    shm.mkdir(parents=True)
    dc = open_cache(str(state), str(shm))
    try:
        commit_prompts(dc, PROMPTS[:3], "power")
        dc.checkpoint()
        commit_prompts(dc, PROMPTS[3:], "crash")
    finally:
        dc.close()
    return str(state), str(shm)


def _targets(state: str, shm: str) -> list[tuple[str, str]]:
    """``(path, where)`` of every file a flip may hit: ``any`` byte, or ``header`` page only."""
    out = [(os.path.join(state, "wal", "data.mdb"), "any")]
    for directory in (state, shm):
        for name in sorted(os.listdir(directory)):
            path = os.path.join(directory, name)
            if name.endswith(".disk.pool"):
                out += [(path, "any"), (path, "header")]
            elif name.endswith(".device.pool"):
                out.append((path, "any"))
            elif name.endswith(".host.pool"):
                out.append((path, "header"))
    assert len(out) == 5, f"the base state lacks a file to damage: {out}"
    return out


def damage(state: str, shm: str, seed: int) -> list[str]:
    """Flip 1, 5 or 50 random bits (seeded) across the damageable files (a quarter of the
    trials: ``data.mdb`` alone); returns what was hit."""
    rng = random.Random(seed)
    targets = _targets(state, shm)
    if rng.random() < 0.25:  # as the fixture of the prefetch hang was made: the log file alone
        targets = targets[:1]
    hits = []
    for _ in range(rng.choice((1, 5, 50))):
        path, where = rng.choice(targets)
        size = os.path.getsize(path)
        offset = rng.randrange(min(size, PAGE) if where == "header" else size)
        bit = rng.randrange(8)
        flip_bit(path, offset, 1 << bit)
        hits.append(f"{os.path.basename(path)}@{offset}^{bit}")
    return hits


def run_trials(base: tuple[str, str], root: Path, seeds: list[int]) -> dict[str, dict]:
    """Damage a copy of ``base`` per seed and recover them all in one driver process."""
    spec = {}
    for seed in seeds:
        trial = root / f"trial-{seed}"
        shutil.copytree(Path(base[0]).parent, trial)
        state, shm = str(trial / "state"), str(trial / "shm")
        hits = damage(state, shm, seed)
        spec[str(seed)] = {"state": state, "shm": shm, "verify": "eager" if seed % 2 else "lazy", "hits": hits}
    spec_path = root / "spec.json"
    spec_path.write_text(json.dumps(spec))
    got = run_driver("tests.crash.test_bitflip_fuzz", ["run", str(spec_path)],
                     timeout_s=120 + TRIAL_TIMEOUT_S * len(seeds))
    return {name: dict(got[name], hits=spec[name]["hits"], verify=spec[name]["verify"]) for name in spec}


def check_outcomes(outcomes: dict[str, dict]) -> dict[str, int]:
    """Assert the contract on every trial; returns a count per kind of outcome."""
    bad, kinds = [], {}
    for name, got in sorted(outcomes.items(), key=lambda kv: int(kv[0])):
        if "served" in got:
            kind = "clean open"
        elif "error" in got:
            kind = got["error"][0] + (" after open" if got.get("after_open") else "")
            if not any(t in got["error"] for t in TYPED):
                bad.append(f"seed {name}: untyped {kind}: {got['message'][:300]} (hits {got['hits'][:8]})\n"
                           f"{got.get('where', '')}")
            elif not ADVICE.search(got["message"]):
                bad.append(f"seed {name}: {kind} does not say what to do: {got['message'][:300]}")
        elif "hung" in got:
            kind = "hang"
            bad.append(f"seed {name}: recovery still running after {got['hung']:.0f} s (hits {got['hits'][:8]})")
        else:
            kind = "death"
            bad.append(f"seed {name}: recovery died rc={got['died']} ({got['verify']}): "
                       f"{got.get('stderr', '')[-600:]} (hits {got['hits'][:8]})")
        kinds[kind] = kinds.get(kind, 0) + 1
    assert not bad, f"{len(bad)} of {len(outcomes)} trials broke the contract:\n" + "\n".join(bad)
    return kinds


@pytest.fixture(scope="module")
def base_state(tmp_path_factory) -> tuple[str, str]:
    return build(tmp_path_factory.mktemp("fuzz-base"))


def test_random_bit_flips_in_the_state_directory_end_typed_or_serve_only_right_bytes(base_state, tmp_path):
    """Guards against a damaged state directory that hangs the open (the log-prefetch loop on a
    tree that went backwards), kills it (a signal) or ends in an untyped error, and against one
    that opens and serves wrong bytes."""
    kinds = check_outcomes(run_trials(base_state, tmp_path, list(range(24))))
    assert sum(kinds.values()) == 24


@pytest.mark.soak
@pytest.mark.timeout(3600)
def test_random_bit_flips_in_the_state_directory_soak(base_state, tmp_path, capsys):
    kinds = check_outcomes(run_trials(base_state, tmp_path, list(range(1000, 1240))))
    with capsys.disabled():
        print(f"\nbit-flip fuzz: {kinds}")


# -- the driver (runs in its own interpreter) -------------------------------------------------------

def _recover_one(state: str, shm: str, verify: str) -> dict:
    from tests.crash.prefixd_workload import verify_index

    try:
        dc = open_cache(state, shm, verify=verify)
    except Exception as exc:  # noqa: BLE001 - the parent judges the type
        import traceback

        return {"error": [f"{k.__module__}.{k.__name__}" for k in type(exc).__mro__], "message": str(exc),
                "where": traceback.format_exc()[-1500:]}
    try:
        if verify == "eager":  # every block left in the index holds its bytes, in every tier
            verify_index(dc)
        served = serve_all(dc)
        dc.check_invariants()
    except TYPED_ERRORS as exc:
        # NOTE: LMDB meets a damaged page that nothing reads at recovery (its free list) only
        # when a later commit reuses it: the log is then poisoned (WalFailedError), typed,
        # and nothing is acknowledged or served wrong.
        return {"error": [f"{k.__module__}.{k.__name__}" for k in type(exc).__mro__], "message": str(exc),
                "after_open": True}
    finally:
        try:
            dc.close()
        except TYPED_ERRORS:
            pass  # the same poisoned log, once more
    return {"served": served}


def _run_main(spec_path: str) -> None:
    """Recover each trial in a forked child (a signal kills only it), with a deadline."""
    spec = json.loads(Path(spec_path).read_text())
    results = {name: recover_in_child(partial(_recover_one, trial["state"], trial["shm"], trial["verify"]),
                                      os.path.dirname(trial["state"]), TRIAL_TIMEOUT_S)
               for name, trial in spec.items()}
    print(json.dumps(results))


if __name__ == "__main__":
    if sys.argv[1:2] != ["run"] or len(sys.argv) != 3:
        sys.exit("usage: python -m tests.crash.test_bitflip_fuzz run SPEC.json")
    _run_main(sys.argv[2])
