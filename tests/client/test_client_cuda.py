"""The mapped path over a CUDA device pool: the client opens the daemon's pool through torch's
CUDA IPC handle (skipped without CUDA; the GPU check script runs it)."""

import pytest
import torch

import prefixd.client as pc
from tests.daemon.harness import DEFAULT_CONFIG, start_daemon

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (a CUDA device pool)")]

LAYOUT = pc.KVLayout("cuda-test", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_size=16)
CUDA_CONFIG = DEFAULT_CONFIG.replace("[engine]\n", "[engine]\nuse_cuda = true\n", 1)


def test_a_cuda_pool_is_mapped_by_ipc_and_agrees_with_the_rpcs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn((2, 2, 40, 2, 64), generator=g).half()
    tokens = list(range(40))
    with start_daemon(CUDA_CONFIG) as d, pc.connect(d.socket, LAYOUT, mapped=True) as m, \
            pc.connect(d.socket, LAYOUT, mapped=False) as r:
        assert m.pool.tensor.is_cuda
        a = m.open(tokens)
        m.write_kv(a, 0, x.cuda())
        m.commit(a)
        b = r.open(tokens + [1])
        assert b.cached_tokens == 32
        assert torch.equal(r.read_kv(b, 0, 32), x[:, :, :32])
        q = torch.randn(1, 4, 64, generator=g).half()
        r.write_kv(b, 32, torch.cat([x[:, :, 32:], x[:, :, :1]], dim=2))
        c = m.open(tokens + [1])
        m.write_kv(c, 32, torch.cat([x[:, :, 32:], x[:, :, :1]], dim=2).cuda())
        torch.testing.assert_close(m.attend([c], q.cuda()).cpu(), r.attend([b], q), atol=2e-3, rtol=2e-3)
