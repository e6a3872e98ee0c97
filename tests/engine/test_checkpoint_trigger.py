"""The checkpoint trigger: the log tail a restart replays stays bounded in blocks, not just records."""


import numpy as np
import pytest

from prefixd.api.layout import KVLayout
from tests.engine.factory import cache_factory

BS = 16
LAYOUT = KVLayout("trigger", num_layers=1, num_kv_heads=1, head_dim=2, dtype="float32", block_size=BS)
SIZES = (2048, 4096, 16384)
PROMPT_TOKENS = 12_000  # a long prompt: 750 blocks, named again by every move and drop
BOUND = 8000


@pytest.fixture
def make(tmp_path):
    with cache_factory(tmp_path, LAYOUT, SIZES, sync="none") as make:
        yield make


def _long_prompt(rng) -> bytes:
    return rng.integers(0, 128_000, PROMPT_TOKENS, dtype="<i4").tobytes()


def _serve(dc, prompt: bytes) -> None:
    seq = dc.open(prompt)
    dc.commit(seq.id, "index").result()
    dc.release(seq.id)


def test_a_long_prompt_workload_keeps_the_replayed_tail_under_the_block_bound(make):
    """Regression: the checkpoint was triggered by records alone, and one record names a whole
    run: with 12k-token prompts a tail far below ``checkpoint_records`` named millions of blocks
    and a restart spent seconds replaying it. Also: recovery restarted the count at zero though
    the tail it replayed stays in the log until the next checkpoint, so a process restarted
    more often than it checkpointed grew the tail without bound."""
    rng = np.random.default_rng(0)
    dc = make(checkpoint_blocks=BOUND)
    replayed = []
    for _ in range(6):
        for _ in range(2):  # ~5.7k blocks named: under the bound in one round, over it in two
            _serve(dc, _long_prompt(rng))
        dc.close()
        dc = make(checkpoint_blocks=BOUND)
        replayed.append(dc.recovery["blocks_replayed"])
        assert dc.recovery["records_replayed"] < dc.checkpoint_records
    assert max(replayed) < BOUND, f"blocks replayed by each restart: {replayed}"
    assert max(replayed) > BOUND // 2, f"the workload never came near the bound: {replayed}"
    dc.check_invariants()


def test_records_remain_a_bound_for_block_less_traffic(make):
    dc = make(checkpoint_records=50)
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, 1000, 40, dtype="<i4").tobytes()
    _serve(dc, prompt)
    for _ in range(40):  # re-opens of a cached prefix: records, no block records
        seq = dc.open(prompt)
        dc.release(seq.id)
    dc.close()
    dc = make(checkpoint_records=50)
    assert 0 < dc.recovery["records_replayed"] < 50


def _checkpoint_lsn(dc) -> int:
    return dc.wal.with_checkpoint(lambda lsn, index, seqs: lsn)


def test_a_replayed_tail_over_the_bound_is_folded_after_ready_not_before(make):
    """Regression: a restart whose replayed tail was over the bound wrote a checkpoint of the
    whole cache inside recovery, so ready waited for it; the first operation takes it."""
    rng = np.random.default_rng(3)
    dc = make(checkpoint_blocks=1 << 60)
    for _ in range(4):
        _serve(dc, _long_prompt(rng))
    before = _checkpoint_lsn(dc)
    dc.close()
    dc = make(checkpoint_blocks=BOUND)
    assert dc.recovery["blocks_replayed"] > BOUND
    assert _checkpoint_lsn(dc) == before
    _serve(dc, _long_prompt(rng))
    assert _checkpoint_lsn(dc) > before
    dc.close()
    dc = make(checkpoint_blocks=BOUND)
    assert dc.recovery["blocks_replayed"] < BOUND
