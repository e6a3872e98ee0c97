"""The daemon's malloc policy (``prefixd.daemon.heap``) against a real ``prefixd serve``."""

import platform

import pytest
import torch

import prefixd.client as pc
from prefixd.daemon.heap import keep_message_buffers
from tests.daemon.harness import start_daemon

CONFIG = """
[engine]
sync = "commit"
shm_dir = "{shm}"

[engine.blocks]
device = 256
host = 256
disk = 0

[daemon]
lease_s = {lease_s}
"""
LAYOUT = pc.KVLayout("heap-test", num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16", block_size=16)
TOKENS = 2048  # 4 MiB of KV: one ReadKV reply


def _minor_faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def test_large_readkv_replies_do_not_page_fault_the_daemon():
    """Regression (kv.rpc_gbps): each 4 MiB ReadKV reply faulted two fresh 4 MiB buffers in
    (2,016 minor faults per call: glibc trimmed the freed heap top and grew it back), 13 ms of
    the daemon's CPU per call against 6 ms once freed message buffers stay in the heap."""
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("not glibc: the daemon sets no malloc thresholds")
    with start_daemon(CONFIG, lease_s=30.0) as d, \
            pc.connect(d.socket, LAYOUT, name="heap-test", mapped=False) as s:
        seq = s.open(list(range(TOKENS)))
        x = torch.randn((4, 2, TOKENS, 2, 64)).half()
        s.write_kv(seq, 0, x)
        for _ in range(3):  # warm-up: the heap grows to its working size
            s.read_kv(seq, 0, TOKENS)
        before = _minor_faults(d.proc.pid)
        for _ in range(4):
            assert torch.equal(s.read_kv(seq, 0, TOKENS), x)
        per_call = (_minor_faults(d.proc.pid) - before) / 4
        assert per_call < 256, f"{per_call:.0f} minor faults per 4 MiB ReadKV (a reply is 1,024 pages)"


def test_the_operators_malloc_settings_win():
    assert keep_message_buffers({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}) is False
    assert keep_message_buffers({"MALLOC_TRIM_THRESHOLD_": "1"}) is False
