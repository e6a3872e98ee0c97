"""Sequence handles, reclaim bookkeeping and the backoff schedule (no daemon)."""

import pytest

import prefixd.client as pc
from prefixd.api import prefixd_pb2 as pb
from prefixd.client.handles import Sequence
from prefixd.client.reconnect import Backoff, apply_reclaim, unknown_reclaimed
from prefixd.client.wire import pack_tokens

BS = 4


def reply(seq_id, table, num_tokens, num_indexed=0) -> pb.SequenceReply:
    return pb.SequenceReply(seq_id=seq_id, num_tokens=num_tokens, block_table=pack_tokens(table),
                            num_indexed=num_indexed)


def test_a_handle_takes_every_field_of_each_reply():
    s = Sequence(reply(3, [5, 6], 7, 1))
    assert (s.id, len(s), s.block_table, s.num_indexed) == (3, 7, [5, 6], 1)
    s.update(reply(3, [5, 6, 9], 9, 2))
    assert (len(s), s.block_table, s.num_indexed) == (9, [5, 6, 9], 2)
    s.check_invariants()


def test_after_a_fork_blocks_stay_shared_until_copy_on_write_replaces_them():
    """Bug it guards: a mapped write into a fork's shared partial tail changes the siblings' KV."""
    parent = Sequence(reply(1, [5, 6, 7], 10, 1))
    assert parent.shared_blocks() == 1
    child = Sequence(reply(2, [5, 6, 7], 10, 1))
    for s in (parent, child):
        s.mark_forked()
    assert child.shared_blocks() == 3
    child.update(reply(2, [5, 6, 12], 11, 1))  # extend copied the partial tail
    assert child.shared_blocks() == 2
    assert parent.shared_blocks() == 3, "the parent cannot know its siblings moved away"


def test_reclaim_updates_handles_in_place_and_rekeys_them():
    live = {1: Sequence(reply(1, [5, 6, 7], 10, 2)), 2: Sequence(reply(2, [8], 3))}
    a, b = live[1], live[2]
    got = pb.ReclaimReply(sequences=[
        pb.ReclaimedSequence(previous_seq_id=1, seq_id=40, num_tokens=8, block_table=pack_tokens([5, 6])),
        pb.ReclaimedSequence(previous_seq_id=2, seq_id=0, num_tokens=0),
        pb.ReclaimedSequence(previous_seq_id=9, seq_id=41, num_tokens=4, block_table=pack_tokens([3])),
    ])
    handles = apply_reclaim(live, got, BS)
    assert handles == [a, b] and live == {40: a}
    assert (a.id, len(a), a.previous_num_tokens, a.block_table, a.num_indexed, a.reclaimed) == (
        40, 8, 10, [5, 6], 2, True)
    assert b.lost and not b.reclaimed and len(b) == 0 and b.previous_num_tokens == 3
    assert unknown_reclaimed(live, got) == [41]


def test_a_recovered_handle_raises_daemon_restarted_once_then_works():
    """Bug it guards: after a background reclaim cut a sequence back, the next extend appended
    to the shorter sequence as if nothing had happened."""
    live = {1: Sequence(reply(1, [5, 6, 7], 10, 2))}
    a = live[1]
    apply_reclaim(live, pb.ReclaimReply(sequences=[pb.ReclaimedSequence(
        previous_seq_id=1, seq_id=2, num_tokens=8, block_table=pack_tokens([5, 6]))]), BS)
    with pytest.raises(pc.DaemonRestarted, match="kept 8 of its 10 tokens") as err:
        a.check_live()
    assert err.value.reclaimed == [a]
    a.check_live()


def test_a_lost_handle_says_to_open_again():
    live = {1: Sequence(reply(1, [5], 3))}
    a = live[1]
    apply_reclaim(live, pb.ReclaimReply(), BS)
    with pytest.raises(pc.DaemonRestarted, match="open the prompt again"):
        a.check_live()
    with pytest.raises(pc.NotFound, match="open the prompt again"):
        a.check_live()


def test_backoff_grows_to_its_cap_and_stops_at_its_total():
    now = [0.0]
    waits = []
    for w in Backoff(initial_s=0.1, max_s=0.4, total_s=2.0).waits(clock=lambda: now[0]):
        waits.append(w)
        now[0] += w
    assert waits[:4] == [0.1, 0.2, 0.4, 0.4]
    assert sum(waits) == pytest.approx(2.0)


@pytest.mark.parametrize("bad", [dict(initial_s=0), dict(total_s=0), dict(initial_s=2, max_s=1),
                                 dict(multiplier=0.5)])
def test_backoff_refuses_nonsense(bad):
    with pytest.raises(ValueError):
        Backoff(**bad)
