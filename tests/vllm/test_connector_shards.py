"""Tensor and pipeline parallel shards at the connector's level (main venv, no vLLM): which heads
and layers a rank holds, copies of only that slice through one whole-model pool of a real
daemon (TP=1, TP=2, PP=2 and TP=2 x PP=2 engines of one model share blocks), and the scheduler
committing only blocks every shard saved.

vLLM 0.32's CPU backend does not run PP=2 here (tests/vllm/test_vllm_tp.py's NOTE), so this is
where pipeline parallelism is tested."""

import pytest
import torch

from prefixd.api.layout import KVLayout
from prefixd.client import connect
from prefixd.client.vllm.block_transfer import load_blocks, save_blocks
from prefixd.client.vllm.daemon_link import DaemonLink
from prefixd.client.vllm.metadata import SaveReport, StepPlan, Transfer
from prefixd.client.vllm.shards import Shard, head_range, layer_index, pool_layers
from prefixd.client.vllm.worker import WorkerSide
from tests.daemon.harness import start_daemon
from tests.vllm.test_connector_scheduler import BS as FAKE_BS
from tests.vllm.test_connector_scheduler import FakeSession, _admit, _side

L, H, D, BS, B = 4, 4, 8, 16, 6
LAYOUT = KVLayout("connector-shards", L, H, D, "float32", BS)
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(L)]


def test_head_range_splits_the_kv_heads_like_vllms_kv_projection():
    assert [head_range(4, 2, r) for r in range(2)] == [(0, 2), (2, 4)]
    assert [head_range(4, 4, r) for r in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert head_range(4, 1, 0) == (0, 4)
    # fewer heads than ranks: each head on tp / H ranks in a row
    assert [head_range(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    for bad in ((3, 2, 0), (2, 3, 0), (4, 2, 2)):
        with pytest.raises(ValueError):
            head_range(*bad)


def test_pool_layers_are_the_layer_numbers_under_pipeline_parallelism():
    assert layer_index("model.layers.17.self_attn.attn") == 17
    assert layer_index("lm.attn") is None and layer_index("a.1.b.2") is None
    assert pool_layers(NAMES[2:], 4, pipeline=True) == ((2, 3), 4)
    assert pool_layers(NAMES, 4, pipeline=False) == ((0, 1, 2, 3), 4)
    assert pool_layers(["x.attn", "y.attn"], 9, pipeline=False) == ((0, 1), 2)  # no numbers: their order
    with pytest.raises(ValueError, match="layer number"):
        pool_layers(["x.attn"], 4, pipeline=True)
    with pytest.raises(ValueError, match="layer number"):
        pool_layers(["model.layers.4.attn"], 4, pipeline=True)


def _rank_tensors(src: dict, shard: Shard) -> dict:
    """A rank's vLLM tensors (CPU_ATTN's ``[B, heads, N, 2D]``) cut from the whole model's."""
    h0, h1 = shard.heads
    return {NAMES[i]: src[NAMES[i]][:, h0:h1].clone() for i in shard.layers}


def _whole(seed=None) -> dict:
    if seed is None:
        return {n: torch.zeros(B, H, BS, 2 * D) for n in NAMES}
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(B, H, BS, 2 * D, generator=g) for n in NAMES}


def _worker(socket, tensors: dict, shard: Shard) -> WorkerSide:
    names = [NAMES[i] for i in shard.layers]
    link = DaemonLink(socket, LAYOUT, f"shard-{shard.index}", mapped=True, timeout_s=5, retry_s=0.2)
    w = WorkerSide(link, names, num_kv_heads=shard.num_kv_heads, head_dim=D, block_size=BS, shard=shard)
    assert w.register({n: tensors[n] for n in names}, {n: "CPU_ATTN" for n in names})
    return w


def _shards(tp: int, pp: int) -> list[Shard]:
    per = L // pp
    return [Shard(p * tp + t, tp * pp, tuple(range(p * per, (p + 1) * per)), head_range(H, tp, t))
            for p in range(pp) for t in range(tp)]


@pytest.fixture(scope="module")
def daemon():
    with start_daemon(lease_s=3.0) as d:
        yield d


@pytest.mark.parametrize("save_with,load_with", [((1, 1), (2, 1)), ((2, 1), (1, 1)), ((1, 2), (2, 2)),
                                                 ((2, 2), (1, 1)), ((2, 1), (1, 2))])
def test_blocks_saved_by_one_parallel_layout_load_into_another(daemon, save_with, load_with):
    """Each rank writes only its slice of a block in the whole-model pool; an engine of another
    TP x PP loads the same blocks, each of its ranks its own slice, equal to the whole model's."""
    tokens = list(range(500, 500 + 2 * BS + 1)) + [sum(save_with) * 10 + sum(load_with)]
    src = _whole(seed=sum(save_with) + 7)
    with connect(daemon.socket, LAYOUT, mapped=False) as s:
        seq = s.open(tokens)
        plan = StepPlan(epoch=s.epoch, saves=[Transfer("r", (4, 1), tuple(seq.block_table[:2]))])
        savers = [_worker(daemon.socket, _rank_tensors(src, sh), sh) for sh in _shards(*save_with)]
        report = SaveReport()
        for w in savers:
            w.save(plan)
            report = report.merge(w.take_report())
        assert report.whole_blocks("r", len(savers)) == (2, True)
        s.release(seq, commit=True)
        seq2 = s.open(tokens)
        assert seq2.cached_tokens == 2 * BS
        load = StepPlan(epoch=s.epoch, loads=[Transfer("q", (0, 2), tuple(seq2.block_table[:2]))])
        for sh in _shards(*load_with):
            dst = _rank_tensors(_whole(), sh)
            w = _worker(daemon.socket, dst, sh)
            w.load(load)
            assert w.take_load_errors() == set()
            want = _rank_tensors(src, sh)
            for n, t in dst.items():
                assert torch.equal(t[0], want[n][4]) and torch.equal(t[2], want[n][1]), (sh, n)
                assert t[1].eq(0).all()
            w.check_invariants()
            w.close()
        s.release(seq2)
        for w in savers:
            w.close()


def test_a_shard_copy_touches_only_its_heads_and_layers():
    """The other ranks' slices of a pool block are left as they were (no rank writes past its
    own slice, so ranks save at once without a lock)."""
    pool = torch.full((3, L, 2, BS, H, D), 7.0)
    shard = Shard(1, 4, (2, 3), (2, 4))
    views = [torch.ones(B, 2, BS, 2, D) for _ in shard.layers]
    save_blocks(pool, views, [0], [1], shard)
    assert pool[1, 2:, :, :, 2:].eq(1).all()
    assert pool[1, :2].eq(7).all() and pool[1, 2:, :, :, :2].eq(7).all() and pool[0].eq(7).all()
    load_blocks(pool, views, [3], [0], shard)
    assert views[0][3].eq(7).all() and views[0][0].eq(1).all()
    with pytest.raises(ValueError, match="does not hold"):
        save_blocks(pool, views, [0], [1], Shard(0, 1, (3, 4), (0, 2)))
    with pytest.raises(ValueError, match="slice"):
        save_blocks(pool, views, [0], [1], Shard(0, 1, (0, 1), (0, 4)))


def test_the_scheduler_commits_only_blocks_every_shard_saved():
    """Regression: a worker whose connector is disabled (or dead) reports nothing; counting the
    other shard's saves alone would commit blocks half of whose heads were never written."""
    session = FakeSession()
    side = _side(session)
    side.num_shards = 2
    prompt = list(range(2 * FAKE_BS + 1))
    for req_id in ("half", "whole"):
        _admit(side, req_id, prompt)
        side.build_plan([(req_id, [1, 2, 3], 0)], [], {req_id: len(prompt)})
    side.on_report(SaveReport({"half": {0: 2}, "whole": {0: 2, 1: 2}}))
    assert len(session.committed) == 1  # "whole" only
    side.finished("half")
    side.finished("whole")
    assert [c for _, c, _ in session.released] == [False, False]  # "whole" was committed before
    assert side.stats.committed == 1 and side.stats.uncommitted == 1
    side.check_invariants()


def test_save_reports_merge_per_shard():
    a, b = SaveReport(), SaveReport()
    a.add("r", 0, 2)
    b.add("r", 1, 2)
    b.add("s", 1, 1)
    merged = a.merge(b)
    assert merged.saved == {"r": {0: 2, 1: 2}, "s": {1: 1}}
    assert merged.whole_blocks("r", 2) == (2, True)
    assert merged.whole_blocks("s", 2) == (0, False)
    assert merged.whole_blocks("r", 1) == (2, False)  # a shard past the engine's: not trusted
