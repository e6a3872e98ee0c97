"""ClusterLinks without a cluster: routing state that a real cluster reaches only by resharding."""

from __future__ import annotations

from prefixd.storage.cluster_nodes import NUM_SLOTS, ClusterLinks


def test_reloading_a_partly_covered_slot_map_never_raises():
    """Bug: a slot map with uncovered slots (a master's slots deleted, or mid-reshard) names
    them "" and the reload asked the node "" too, raising ValueError out of get_run."""
    links = ClusterLinks(["127.0.0.1:1"], timeout_s=0.05, connect_timeout_s=0.05, retry_after_s=0.0)
    links._slots = ["127.0.0.1:1"] * 100 + [""] * (NUM_SLOTS - 100)
    links.mark_stale()
    owners = links.nodes_of([b"a", b"b"])  # the reload fails (nothing on port 1): old map kept
    assert owners is not None and len(owners) == 2
    links.check_invariants()
    links.close()


def test_no_slot_map_at_all_is_none_not_an_error():
    links = ClusterLinks(["127.0.0.1:1", "127.0.0.1:2"], timeout_s=0.05, connect_timeout_s=0.05,
                         retry_after_s=60.0)
    assert links.nodes_of([b"a"]) is None
    assert links.nodes_of([b"a"]) is None  # within retry_after_s: not asked again
    links.close()
