"""The PowerFS durability model on its own (no FUSE): random file operations against bytearrays.

The reference keeps two byte strings per file, what a reader sees and what the last sync left;
the model must read back the first after every call, hold its invariants, and at a cut leave the
second (``lose``) or, page by page, one of the two (``torn``); in ``torn``, a page may also be
the old page cut at the truncation floor (the truncate landed, the write after it did not).
"""

from __future__ import annotations

import os
import random

import pytest

from tests.crash.powerfs_model import PAGE_SIZE, PowerFSError, PowerModel


def _padded(data: bytes, size: int) -> bytes:
    return data[:size] + bytes(max(0, size - len(data)))


def _random_run(tmp_path, seed: int, mode: str) -> None:
    rng = random.Random(seed)
    model = PowerModel(tmp_path / "store")
    fh = model.create("/f", 0o644, os.O_RDWR)
    live, durable, floor = bytearray(), b"", 0  # floor: lowest size since the last sync
    for _ in range(rng.randint(1, 40)):
        op = rng.choice(["write", "write", "write", "truncate", "fsync", "fallocate", "punch", "read"])
        if op == "write":
            off, n = rng.randint(0, 6 * PAGE_SIZE), rng.randint(1, 3 * PAGE_SIZE)
            data = rng.randbytes(n)
            model.write(None, data, off, fh)
            live[:] = _padded(bytes(live), max(len(live), off + n))
            live[off : off + n] = data
        elif op == "truncate":
            size = rng.randint(0, 8 * PAGE_SIZE)
            model.truncate(None, size, fh)
            live[:] = _padded(bytes(live), size)
            floor = min(floor, size)
        elif op == "fallocate":
            off, n = rng.randint(0, 6 * PAGE_SIZE), rng.randint(1, 3 * PAGE_SIZE)
            model.fallocate(None, 0, off, n, fh)
            live[:] = _padded(bytes(live), max(len(live), off + n))
        elif op == "punch":
            off, n = rng.randint(0, 6 * PAGE_SIZE), rng.randint(1, 3 * PAGE_SIZE)
            model.fallocate(None, 3, off, n, fh)
            end = min(off + n, len(live))
            if end > off:
                live[off:end] = bytes(end - off)
        elif op == "fsync":
            model.fsync(None, rng.randint(0, 1), fh)
            durable, floor = bytes(live), len(live)
        assert model.read(None, 10 * PAGE_SIZE, 0, fh) == bytes(live)
        model.check_invariants()
    backing = tmp_path / "backing"
    backing.mkdir()
    report = model.cut(mode, seed, backing)
    got = (backing / "f").read_bytes() if durable or model.root.durable else None
    if not model.root.durable:  # never synced: the name itself is gone
        assert not (backing / "f").exists()
        return
    if mode == "lose":
        assert got == durable
        return
    assert len(got) in (len(durable), len(live)), (len(got), len(durable), len(live))
    for start in range(0, len(got), PAGE_SIZE):
        n = min(PAGE_SIZE, len(got) - start)
        page = got[start : start + n]
        truncated = _padded(_padded(durable, min(floor, len(durable))), len(got))
        assert page in (_padded(bytes(live), len(got))[start : start + n],
                        _padded(durable, len(got))[start : start + n],
                        truncated[start : start + n]), f"seed {seed} page {start}"
    assert report.pages_kept + report.pages_lost >= 0


@pytest.mark.parametrize("mode", ["lose", "torn"])
def test_model_reads_back_and_cuts_like_the_reference(tmp_path, mode):
    for seed in range(150):
        _random_run(tmp_path / f"{mode}{seed}", seed, mode)


def test_model_rename_over_and_across_directories(tmp_path):
    model = PowerModel(tmp_path / "store")
    model.mkdir("/a", 0o755)
    model.mkdir("/b", 0o755)
    for name in ("/a/x", "/b/old"):
        fh = model.create(name, 0o644, os.O_RDWR)
        model.write(None, name.encode(), 0, fh)
        model.fsync(None, 0, fh)
    model.rename("/a/x", "/b/old")  # replaces b/old
    with pytest.raises(OSError):
        model.rename("/b/old", "/b/old/deeper")
    model.fsyncdir("/b", 0, None)  # only the target directory
    model.check_invariants()
    backing = tmp_path / "backing"
    backing.mkdir()
    model.cut("lose", 0, backing)
    assert (backing / "b" / "old").read_bytes() == b"/a/x"
    assert (backing / "a" / "x").read_bytes() == b"/a/x"  # source dir never fsynced: both names
    assert os.stat(backing / "a" / "x").st_ino == os.stat(backing / "b" / "old").st_ino


def test_model_refuses_a_second_cut_and_answers_eio_after_the_cut(tmp_path):
    model = PowerModel(tmp_path / "store")
    (tmp_path / "backing").mkdir()
    model.cut("lose", 0, tmp_path / "backing")
    with pytest.raises(PowerFSError, match="already cut"):
        model.cut("lose", 0, tmp_path / "backing")
    with pytest.raises(OSError, match="power is off"):
        model.lookup("/")
    with pytest.raises(PowerFSError, match="not one of"):
        PowerModel(tmp_path / "store2").cut("gentle", 0, tmp_path / "backing")
