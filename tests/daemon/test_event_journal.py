"""The KV-event journal on its own (issue 15 part C): numbering, the ring, replay-from, the
``cleared`` answer, cutting off a subscriber that lags, and the ``[daemon.events]`` config.
The daemon-level behaviour (real streams, tenants, SIGTERM) is tests/daemon/test_events.py."""

from __future__ import annotations

import pytest

from prefixd.api.layout import KVLayout
from prefixd.cache.events import BlocksDropped, BlocksMoved, BlocksStored, SeqCommitted
from prefixd.config.daemon_settings import DaemonConfig, EventsConfig
from prefixd.config.errors import ConfigError
from prefixd.config.toml_reader import daemon_config
from prefixd.daemon.event_journal import CLEARED, REMOVED, STORED, EventJournal, EventJournals

EPOCH = 77
LAYOUT = KVLayout("journal-test", 1, 1, 8, "float16", 4)


def journal(ring: int = 8, queue: int = 4) -> EventJournal:
    return EventJournal("t", EPOCH, ring, queue)


def fill(j: EventJournal, n: int) -> None:
    for i in range(n):
        j.append(STORED, "device", "m", 4, (bytes([i % 256]) * 16,))


def drain(j: EventJournal, sub) -> list:
    out = []
    while (entry := j.next_entry(sub)) is not None:
        out.append(entry)
    return out


def test_cache_events_become_stored_and_removed_per_tier():
    j = journal(ring=16)
    h = [bytes([i]) * 16 for i in range(3)]
    j.observe(LAYOUT, [BlocksStored(b"p" * 16, h, b"\x01\x00\x00\x00" * 12, [0, 1, 2]),
                       SeqCommitted(1, 3, h[-1]),
                       BlocksMoved(1, h, [5, 6, 7], []),
                       BlocksDropped(0, h[1:], [1, 2], False)])
    got = drain(j, j.subscribe(0))
    assert [(e.sequence_number, e.kind, e.tier, e.block_hashes) for e in got] == [
        (1, STORED, "device", tuple(h)), (2, STORED, "host", tuple(h)),
        (3, REMOVED, "device", tuple(h[1:]))]
    assert got[0].parent_block_hash == b"p" * 16 and len(got[0].tokens) == 48
    assert got[0].model_id == "journal-test" and got[0].block_size == 4
    j.check_invariants()


def test_replay_from_a_number_gives_every_later_event_once():
    j = journal(ring=8)
    fill(j, 5)
    assert [e.sequence_number for e in drain(j, j.subscribe(3, EPOCH))] == [4, 5]
    assert [e.sequence_number for e in drain(j, j.subscribe(5, EPOCH))] == []
    assert [e.sequence_number for e in drain(j, j.subscribe(0))] == [1, 2, 3, 4, 5]
    assert j.gaps == 0
    j.check_invariants()


@pytest.mark.parametrize("from_number, epoch", [(1, EPOCH), (12, EPOCH), (20, 0), (5, EPOCH + 1)])
def test_what_cannot_be_replayed_begins_with_cleared(from_number, epoch):
    """Older than the ring (1: events 2..4 were dropped), newer than any sent (a number of
    an earlier daemon start), or another epoch: ``cleared`` numbered just before the oldest
    entry held, then the ring from there."""
    j = journal(ring=8)
    fill(j, 11)  # holds 4..11
    got = drain(j, j.subscribe(from_number, epoch))
    assert got[0].kind == CLEARED and got[0].sequence_number == 3
    assert [e.sequence_number for e in got[1:]] == list(range(4, 12))
    assert j.gaps == 1


def test_a_live_subscriber_that_lags_past_its_queue_is_cut_off():
    j = journal(ring=64, queue=4)
    slow, fast = j.subscribe(0), j.subscribe(0)
    assert drain(j, slow) == [] and drain(j, fast) == []  # both caught up: live
    fill(j, 4)
    assert not slow.overflowed
    drain(j, fast)
    fill(j, 1)  # slow now lags 5 > 4
    assert slow.overflowed and not fast.overflowed
    assert j.next_entry(slow) is None and j.overflows == 1 and j.num_subscribers == 1
    assert [e.sequence_number for e in drain(j, fast)] == [5]
    j.check_invariants()


def test_a_replay_overtaken_by_the_ring_is_cut_off():
    """While replaying, a subscriber may fall ``queue`` appends behind the oldest entry
    offered, not more: once the ring drops its next entry it is cut off rather than sent a
    hole."""
    j = journal(ring=8, queue=2)
    fill(j, 8)
    sub = j.subscribe(0)
    assert j.next_entry(sub).sequence_number == 1  # replaying: lags 7, not held to queue=2
    fill(j, 3)  # offered from 4, kept from 2: its next, 2, is still there
    assert j.next_entry(sub).sequence_number == 2
    fill(j, 2)  # kept from 4
    assert j.next_entry(sub) is None and sub.overflowed and j.overflows == 1
    j.check_invariants()


@pytest.mark.parametrize("from_number", [0, 1])
def test_a_replay_from_the_oldest_offered_survives_appends_before_its_first_send(from_number):
    """A full ring, a stream from 0 (or after ``cleared``), then ``queue`` appends before it
    sends anything (the daemon's other calls ran first): it is not cut off, and sends the
    entries it was offered, in order, then the new ones. With the ring alone as the replay's
    bound the first append cut it off, and its next subscription the same, for ever."""
    j = journal(ring=8, queue=4)
    fill(j, 20)  # offers 13..20
    sub = j.subscribe(from_number, EPOCH)
    fill(j, 4)
    got = drain(j, sub)
    numbers = [e.sequence_number for e in got if e.kind != CLEARED]
    assert not sub.overflowed and numbers == list(range(13, 25))
    assert [e.kind for e in got[:1]] == ([CLEARED] if from_number else [STORED])
    j.check_invariants()


def test_close_ends_every_subscriber():
    journals = EventJournals(["a", "b"], EPOCH, 16, 4)
    subs = [journals.journal(t).subscribe(0) for t in ("a", "b")]
    journals.close()
    assert all(s.closed and s.wake.is_set() for s in subs)
    journals.check_invariants()


def test_tenants_have_separate_numbers_and_rings():
    journals = EventJournals(["a", "b"], EPOCH, 16, 4)
    journals.observe("a", LAYOUT, [BlocksMoved(1, [b"x" * 16], [0], [])])
    journals.observe("nobody", LAYOUT, [BlocksMoved(1, [b"y" * 16], [0], [])])  # ignored
    assert journals.journal("a").emitted == 1 and journals.journal("b").emitted == 0
    assert drain(journals.journal("b"), journals.journal("b").subscribe(0)) == []


@pytest.mark.parametrize("table", [{"ring_size": 0}, {"ring_size": 8}, {"subscriber_queue": 0},
                                   {"ring_size": "big"}, {"subscriber_queue": True},
                                   {"ring": 100}])
def test_events_config_refuses_bad_values(table):
    with pytest.raises(ConfigError, match="daemon.events"):
        daemon_config({"events": table})


def test_events_config_defaults_and_values():
    assert DaemonConfig().events == EventsConfig(65536, 4096)
    assert daemon_config({"events": {"ring_size": 100, "subscriber_queue": 7}}).events \
        == EventsConfig(100, 7)
