"""Recovery progress: the records an engine replays are counted for the daemon's Status."""

from __future__ import annotations

from prefixd.api.layout import KVLayout
from prefixd.config.engine_settings import EngineConfig, TierSizes
from prefixd.engine.engine import Engine
from prefixd.engine.progress import RecoveryProgress

LAYOUT = KVLayout("m", 1, 1, 8, "float16", 16)


def test_replayed_records_are_counted_up_to_the_log_tail(tmp_path):
    config = EngineConfig(blocks=TierSizes(64, 256, 256), shm_dir=str(tmp_path / "shm"))
    with Engine(str(tmp_path / "st"), config) as engine:
        pool = engine.pool("default", LAYOUT)
        for i in range(5):
            seq = pool.open(list(range(i * 100, i * 100 + 40)))
            pool.release(seq.id, commit=True).result()
    progress = RecoveryProgress()
    with Engine(str(tmp_path / "st"), config, progress=progress) as engine:
        engine.check_invariants()
    assert progress.pools == 1
    assert progress.total > 0 and progress.replayed == progress.total


def test_counting_passes_batches_through_unchanged():
    progress = RecoveryProgress()
    batches = [(1, [b"a", b"b"]), (3, [b"c"])]
    assert list(progress.counting(batches)) == batches
    assert progress.replayed == 3
