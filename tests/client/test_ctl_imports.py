"""``prefixctl`` status, stats and lookup (without --tokenizer) never import torch: they answer
in a fraction of a second, not after torch's seconds of import (checked with ``-X importtime``
in a process of its own against a real daemon)."""

import os
import struct
import subprocess
import sys

import pytest

from prefixd.api import prefixd_pb2 as pb
from tests.daemon.harness import ROOT, start_daemon

LAYOUT = pb.KVLayout(model_id="ctl-imports", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16",
                     block_size=4)


def imported_modules(*argv) -> tuple[subprocess.CompletedProcess, set[str]]:
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "prefixd.client.ctl", *argv], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=120)
    names = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    return proc, names


@pytest.fixture(scope="module")
def daemon():
    with start_daemon(lease_s=30.0) as d:
        stub = d.stub()
        session = stub.Attach(pb.AttachRequest(client_name="t", layout=LAYOUT)).session_id
        ids = list(range(1, 9))
        seq = stub.Open(pb.OpenRequest(session_id=session, tokens=struct.pack("<8i", *ids))).sequence
        stub.Release(pb.ReleaseRequest(session_id=session, seq_id=seq.seq_id, commit=True))
        stub.Detach(pb.DetachRequest(session_id=session))
        yield d


@pytest.mark.parametrize("command", [["status"], ["stats"], ["stats", "--json"],
                                     ["lookup", "1", "2", "3", "4", "5", "6", "7", "8", "9"]])
def test_prefixctl_answers_without_importing_torch(daemon, command):
    proc, names = imported_modules("--socket", daemon.socket, *command)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "prefixd.client.ctl" in names or "prefixd.client" in names, "importtime saw the imports"
    assert not {n for n in names if n == "torch" or n.startswith("torch.")}, "torch was imported"
    if command[0] == "lookup":
        assert "8" in proc.stdout  # the committed prompt's two blocks
