"""The session's recovery logic against a scripted stub (no daemon): what it probes, when it
re-attaches, what it reclaims, what it retries."""

import threading

import grpc
import pytest

import prefixd.client as pc
from prefixd.api import prefixd_pb2 as pb
from prefixd.client import connection
from prefixd.client.wire import pack_tokens

LAYOUT = pc.KVLayout("fake", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32", block_size=4)


class Failure(grpc.RpcError):
    def __init__(self, code, details="scripted"):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


UNAVAILABLE = Failure(grpc.StatusCode.UNAVAILABLE, "connection refused")
GONE = Failure(grpc.StatusCode.NOT_FOUND, "no session")


class Stream:
    """A KeepAlive call that lasts until cancelled."""

    def __init__(self):
        self._done = threading.Event()

    def cancel(self):
        self._done.set()

    def __iter__(self):
        self._done.wait()
        raise Failure(grpc.StatusCode.CANCELLED)


class FakeDaemon:
    """Answers like a daemon; ``fail[method]`` holds errors to raise at that method's next calls."""

    def __init__(self):
        self.calls = []
        self.fail = {}
        self.next_session = 100
        self.orphans = []
        self.holding = None  # previous session -> what its Reclaim returns (None: seq 7 as 70)

    def _step(self, method, request):
        self.calls.append((method, request))
        queue = self.fail.get(method)
        if queue:
            raise queue.pop(0)

    def Attach(self, request, timeout=None):
        self._step("Attach", request)
        self.next_session += 1
        return pb.AttachReply(session_id=self.next_session, lease_s=60.0, epoch=1)

    def KeepAlive(self, requests, timeout=None):
        return Stream()

    def Stats(self, request, timeout=None):
        self._step("Stats", request)
        return pb.StatsReply()

    def Lookup(self, request, timeout=None):
        self._step("Lookup", request)
        return pb.LookupReply(cached_tokens=8)

    def Open(self, request, timeout=None):
        self._step("Open", request)
        return pb.OpenReply(sequence=pb.SequenceReply(seq_id=7, num_tokens=10, block_table=pack_tokens([1, 2, 3])))

    def Extend(self, request, timeout=None):
        self._step("Extend", request)
        return pb.ExtendReply(sequence=pb.SequenceReply(seq_id=request.seq_id, num_tokens=11,
                                                        block_table=pack_tokens([1, 2, 3])))

    def Reclaim(self, request, timeout=None):
        self._step("Reclaim", request)
        if self.holding is not None:
            return pb.ReclaimReply(sequences=self.holding.get(request.previous_session_id, []))
        return pb.ReclaimReply(sequences=[pb.ReclaimedSequence(previous_seq_id=7, seq_id=70, num_tokens=8,
                                                               block_table=pack_tokens([1, 2])),
                                          *self.orphans])

    def Release(self, request, timeout=None):
        self._step("Release", request)
        return pb.ReleaseReply()

    def Detach(self, request, timeout=None):
        self._step("Detach", request)
        return pb.DetachReply()

    def named(self, method):
        return [r for m, r in self.calls if m == method]


@pytest.fixture
def fake(monkeypatch, tmp_path):
    daemon = FakeDaemon()

    class Channel:
        def close(self):
            pass

    monkeypatch.setattr(connection.grpc, "insecure_channel", lambda *a, **k: Channel())
    monkeypatch.setattr(connection, "KVStub", lambda channel: daemon)
    return daemon


def connect(tmp_path, **kw):
    return pc.connect(str(tmp_path / "s.sock"), LAYOUT, mapped=False,
                      backoff=pc.Backoff(initial_s=0.001, max_s=0.001, total_s=0.2), **kw)


def test_an_idempotent_call_is_retried_after_a_reattach_and_reclaim(fake, tmp_path):
    with connect(tmp_path) as s:
        seq = s.open([1] * 10)
        fake.fail = {"Lookup": [UNAVAILABLE], "Stats": [GONE]}
        assert s.lookup([1] * 10) == 8
        assert s.id == 102 and s.recoveries == 1
        assert [r.previous_session_id for r in fake.named("Reclaim")] == [101]
        assert (seq.id, len(seq), seq.reclaimed, seq.previous_num_tokens) == (70, 8, True, 10)
        s.check_invariants()


def test_a_call_that_is_not_idempotent_raises_daemon_restarted_once(fake, tmp_path):
    with connect(tmp_path) as s:
        seq = s.open([1] * 10)
        fake.fail = {"Extend": [UNAVAILABLE], "Stats": [GONE]}
        with pytest.raises(pc.DaemonRestarted) as err:
            s.extend(seq, [5])
        assert err.value.reclaimed == [seq] and len(fake.named("Extend")) == 1
        s.extend(seq, [5])
        assert fake.named("Extend")[-1].seq_id == 70


def test_an_error_of_the_call_itself_does_not_reattach(fake, tmp_path):
    with connect(tmp_path) as s:
        fake.fail = {"Lookup": [Failure(grpc.StatusCode.NOT_FOUND, "no such sequence")]}
        with pytest.raises(pc.NotFound, match="no such sequence"):
            s.lookup([1])
        assert s.recoveries == 0 and len(fake.named("Attach")) == 1


def test_a_reclaim_cut_short_is_retried_with_the_session_of_before_the_restart(fake, tmp_path):
    """Bug it guards: a recovery that re-attached but lost its Reclaim to the daemon going down
    again reclaimed, next time, the short-lived session in between only: every sequence was
    lost. (It reclaims that session too, after the one of before the restart.)"""
    with connect(tmp_path) as s:
        seq = s.open([1] * 10)
        fake.fail = {"Lookup": [UNAVAILABLE], "Stats": [GONE], "Reclaim": [UNAVAILABLE]}
        with pytest.raises(pc.Unavailable):
            s.lookup([1] * 10)
        fake.fail = {"Lookup": [GONE], "Stats": [GONE]}  # session 102 went down with the daemon
        assert s.lookup([1] * 10) == 8
        assert [r.previous_session_id for r in fake.named("Reclaim")] == [101, 101, 102]
        assert seq.id == 70 and seq.reclaimed


def test_a_reclaim_cut_after_it_moved_the_sequences_finds_them_in_the_cut_session(fake, tmp_path):
    """Bug it guards: the daemon made a Reclaim durable (the sequences in the new session,
    under their own ids) and went down before the reply reached the client; the next recovery
    reclaimed only the session of before the first restart, found nothing, and the held
    handle came back lost."""
    with connect(tmp_path) as s:
        seq = s.open([1] * 10)  # 7, in session 101
        fake.fail = {"Lookup": [UNAVAILABLE], "Stats": [GONE], "Reclaim": [UNAVAILABLE]}
        with pytest.raises(pc.Unavailable):
            s.lookup([1] * 10)
        # what the cut Reclaim did before the daemon went down: 7 is in session 102 now
        fake.holding = {102: [pb.ReclaimedSequence(previous_seq_id=7, seq_id=7, num_tokens=8,
                                                   block_table=pack_tokens([1, 2]))]}
        fake.fail = {"Lookup": [GONE], "Stats": [GONE]}
        assert s.lookup([1] * 10) == 8
        assert [r.previous_session_id for r in fake.named("Reclaim")] == [101, 101, 102]
        assert seq.id == 7 and seq.reclaimed and not seq.lost and seq.num_tokens == 8
        s.check_invariants()


def test_with_reconnect_off_failures_are_raised_as_they_are(fake, tmp_path):
    with connect(tmp_path, reconnect=False) as s:
        fake.fail = {"Lookup": [UNAVAILABLE]}
        with pytest.raises(pc.Unavailable, match="connection refused"):
            s.lookup([1])
        assert len(fake.named("Attach")) == 1 and not fake.named("Stats")


def test_open_is_retried_and_an_open_that_happened_before_the_crash_is_released(fake, tmp_path):
    """An open whose reply the crash swallowed may come back from Reclaim under an id no handle
    knows: the recovery releases it, so retrying the open leaks nothing."""
    with connect(tmp_path) as s:
        first = s.open([1] * 10)
        fake.fail = {"Open": [UNAVAILABLE], "Stats": [GONE]}
        fake.orphans = [pb.ReclaimedSequence(previous_seq_id=8, seq_id=80, num_tokens=8,
                                             block_table=pack_tokens([4, 5]))]
        again = s.open([1] * 10)
        assert len(fake.named("Open")) == 3 and s.recoveries == 1
        assert [r.seq_id for r in fake.named("Release")] == [80]
        assert first.reclaimed and again.id == 7 and not again.reclaimed
