"""A commit whose host write-through forces the log keeps its own COMMIT record.

The forced release (``Upkeep.force_release``, the allocator's ``on_deferred_shortage``)
drains and logs the cache's events in the middle of ``PrefixCache._commit``. The commit used
to append its ``SeqCommitted`` event to the list it had read before that drain, a list already
logged: the record was lost while the ticket still resolved, so the client was told its commit
was durable, and after a restart the held sequence came back cut to where it was opened
(found by the daemon's kill -9 soak: "held sequence 8275 (acknowledged 96 tokens) came back
with 80").
"""

from prefixd.engine import DurableCache
from tests.cache.helpers import tiny_layout

LAYOUT = tiny_layout(2)  # 2 tokens a block
SIZES = (64, 24, 512)


def test_held_commits_come_back_at_their_committed_length_after_forced_releases(tmp_path):
    kw = {"shm_dir": str(tmp_path / "shm"), "reclaim_grace_s": 3600}
    (tmp_path / "shm").mkdir()
    dc = DurableCache(str(tmp_path / "state"), LAYOUT, SIZES, **kw)
    held = {}
    try:
        for i in range(40):
            tokens = [1000 + i] + [i * 100 + k for k in range(6)]  # 3 full blocks, a partial one
            seq = dc.open(tokens, session_id=7)
            dc.commit(seq.id, "crash").result()
            held[seq.id] = 6
            if len(held) > 4:  # a client holds its last few commits, releases the older ones
                old = min(held)
                dc.release(old)
                del held[old]
            dc.check_invariants()
        assert dc.forced_releases > 0  # the case this is about did happen
    finally:
        dc.close()
    dc = DurableCache(str(tmp_path / "state"), LAYOUT, SIZES, **kw)
    try:
        got = {r.seq_id: r.num_tokens for r in dc.recovered.values()}
        assert got == held, "a held sequence came back shorter than its acknowledged commit"
        dc.check_invariants()
    finally:
        dc.close()
