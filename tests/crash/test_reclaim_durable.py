"""A Reclaim is answered only once its sequences are durable under the session that reclaimed them.

A Reclaim reopens the recovered sequences under new ids in the new session (an OPEN record)
and releases the old ids (a RELEASE record). The client then knows its sequences by the new
ids and the new session only: if the daemon dies again before those records are durable, the
next restart recovers the sequences under the old session and ids, which the client no longer
asks for, so a held sequence whose commit was acknowledged came back lost.

The test kills the daemon the moment each Reclaim reply arrives (records that nothing flushes
wait up to the log's group delay, a few milliseconds, before they are written) and reclaims
again from the session that the reply made current, three times over.
"""

from __future__ import annotations

import pytest

from prefixd.api import prefixd_pb2 as pb
from tests.crash.test_daemon_kill9 import ForkedDaemon, config
from tests.daemon.gsp_workload import BS, digest, kv_of, packed, pb_layout, read_kv, systems, write_kv

ROUNDS = 3


def attach(stub) -> int:
    return stub.Attach(pb.AttachRequest(client_name="reclaimer", layout=pb_layout()), timeout=30).session_id


@pytest.mark.timeout(600)
def test_a_reclaimed_sequence_survives_a_kill_right_after_the_reclaim_reply():
    """Regression: Reclaim replied before its OPEN / RELEASE records were durable; a kill
    right after the reply lost the reclaimed ids, and the held sequence came back with None."""
    d = ForkedDaemon(config(), lease_s=30.0)
    try:
        d.start()
        stub = d.stub()
        session = attach(stub)
        tokens = systems()[1] + list(range(1000, 1040))  # 48 shared + 40: 80 full tokens
        full = len(tokens) // BS * BS
        seq_id = stub.Open(pb.OpenRequest(session_id=session, tokens=packed(tokens)), timeout=30).sequence.seq_id
        write_kv(stub, session, seq_id, tokens, 0)
        stub.Commit(pb.CommitRequest(session_id=session, seq_id=seq_id, durability="crash"), timeout=30)
        for k in range(ROUNDS):
            d.kill()  # round 0: the held sequence's commit is acknowledged; later: a reply came
            d.start()
            stub = d.stub()
            previous, session = session, attach(stub)
            reply = stub.Reclaim(pb.ReclaimRequest(session_id=session, previous_session_id=previous),
                                 timeout=30)
            back = {s.previous_seq_id: s for s in reply.sequences}
            got = back.get(seq_id)
            assert got is not None and got.seq_id and got.num_tokens >= full, (
                f"round {k}: held sequence {seq_id} (acknowledged {full} tokens, reclaimed by the "
                f"reply before the last kill) came back with "
                f"{None if got is None else got.num_tokens}: {list(back)}")
            seq_id = got.seq_id
        data = read_kv(stub, session, seq_id, full)
        assert digest(data) == digest(kv_of(tokens, 0, full).tobytes())
    except BaseException:
        print(d.log()[-4000:])
        raise
    finally:
        d.close()
