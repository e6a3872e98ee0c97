"""A ``PrefixdConnector`` whose worker of one shard dies in the middle of a save: a tensor-parallel
rank killed while it writes its slice of a block (loaded by vLLM in the vLLM venv, from
``tests/vllm/test_vllm_tp.py``, as ``--connector-class tests.vllm.dying_connector:DyingConnector``).

The worker of shard ``$PREFIXD_TEST_DIE_SHARD`` counts the steps in which it has blocks to save;
at the ``$PREFIXD_TEST_DIE_AT_SAVE``-th it writes its slice of the first layer of those blocks
(so the pool holds a part of a shard), writes the file ``$PREFIXD_TEST_DIE_MARK`` (the test's
proof that it died there) and SIGKILLs its own process. Every other worker, and that one
before, is the real connector.
"""

import os
import signal

from prefixd.client.vllm.block_transfer import save_blocks
from prefixd.client.vllm.connector import PrefixdConnector
from prefixd.client.vllm.shards import Shard

SHARD_ENV = "PREFIXD_TEST_DIE_SHARD"
SAVE_ENV = "PREFIXD_TEST_DIE_AT_SAVE"
MARK_ENV = "PREFIXD_TEST_DIE_MARK"


class DyingConnector(PrefixdConnector):
    """``PrefixdConnector`` with a worker that dies mid-save (module docstring)."""

    save_steps = 0

    def wait_for_save(self) -> None:
        plan = self._plan()
        worker = self.worker
        if worker is not None and plan is not None and plan.saves \
                and worker.shard.index == int(os.environ[SHARD_ENV]):
            self.save_steps += 1
            if self.save_steps == int(os.environ[SAVE_ENV]):
                pool = worker.link.call("map", lambda s: s.pool.tensor)
                part = Shard(worker.shard.index, worker.shard.num_shards, worker.shard.layers[:1],
                             worker.shard.heads)
                for t in plan.saves:
                    save_blocks(pool, worker.views[:1], t.block_ids, t.slots, part)
                with open(os.environ[MARK_ENV], "w") as f:
                    f.write(" ".join(f"{t.req_id}:{list(t.slots)}" for t in plan.saves))
                os.kill(os.getpid(), signal.SIGKILL)
        super().wait_for_save()
