"""SIGTERM with calls in flight, 200 times: every call a client made is answered OK or
UNAVAILABLE (never CANCELLED, which leaves a client unable to tell whether its commit
happened), every stop exits 0, and a commit answered OK is a hit after the restart.

One state directory and one zygote (``tests.daemon.forked``) serve all the cycles, so a
restart costs the daemon's recovery of small pools, not an interpreter importing torch.
"""

from __future__ import annotations

import random
import re
import signal
import time

import grpc
import pytest

from prefixd.api import prefixd_pb2 as pb
from prefixd.api import prefixd_pb2_grpc as pb_grpc
from tests.daemon.forked import ForkedDaemon
from tests.daemon.gsp_workload import BS, packed, pb_layout, write_kv

CONFIG = """
[engine]
sync = "commit"
shm_dir = "{shm}"
reclaim_grace_s = 60.0

[engine.blocks]
device = 128
host = 256
disk = 4096

[daemon]
lease_s = 30.0
"""
CYCLES = 200
SEQS, LOOKUPS = 6, 24  # commits and lookups in flight at each SIGTERM
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}


def _code(call) -> grpc.StatusCode:
    try:
        call.result()
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()


class Cycles:
    """The SIGTERM cycles over one daemon; each checks the previous one's answers by a
    Reclaim of its session: a commit answered OK came back with its tokens, one answered
    UNAVAILABLE did not happen."""

    def __init__(self, d: ForkedDaemon, seed: int) -> None:
        self.d = d
        self.rng = random.Random(seed)
        self.codes: dict = {}
        self.previous: tuple[int, dict] | None = None  # (session, {seq_id: (tokens, committed)})

    def count(self, call) -> grpc.StatusCode:
        code = _code(call)
        self.codes[code] = self.codes.get(code, 0) + 1
        return code

    def check_previous(self, stub, sid: int) -> None:
        if self.previous is None:
            return
        old, seqs = self.previous
        back = stub.Reclaim(pb.ReclaimRequest(session_id=sid, previous_session_id=old),
                            timeout=60).sequences
        got = {s.previous_seq_id: s.num_tokens for s in back}
        for seq_id, (tokens, committed) in seqs.items():
            want = len(tokens) // BS * BS if committed else 0
            assert got.get(seq_id, 0) == want, (
                f"seq {seq_id}: its commit was answered {'OK' if committed else 'UNAVAILABLE'} "
                f"but the restart holds {got.get(seq_id, 0)} of its {len(tokens)} tokens")
        for s in (s for s in back if s.seq_id):  # 0: nothing survived, nothing to release
            stub.Release(pb.ReleaseRequest(session_id=sid, seq_id=s.seq_id), timeout=60)

    def one(self) -> None:
        """Start, reclaim the previous cycle's session, put SEQS commits and LOOKUPS lookups in
        flight, SIGTERM after a random delay, and wait for a clean exit."""
        d, rng = self.d, self.rng
        d.start()
        with grpc.insecure_channel("unix:" + d.socket) as ch:
            stub = pb_grpc.PrefixCacheStub(ch)
            sid = stub.Attach(pb.AttachRequest(client_name="stop", layout=pb_layout()),
                              timeout=60).session_id
            self.check_previous(stub, sid)
            prompts = {}
            for _ in range(SEQS):
                tokens = [rng.randrange(50000, 90000) for _ in range(2 * BS + 3)]
                seq = stub.Open(pb.OpenRequest(session_id=sid, tokens=packed(tokens)),
                                timeout=60).sequence
                write_kv(stub, sid, seq.seq_id, tokens, 0)
                prompts[seq.seq_id] = tokens
            commits = {seq_id: stub.Commit.future(pb.CommitRequest(
                session_id=sid, seq_id=seq_id, durability=rng.choice(("crash", "power"))),
                timeout=120) for seq_id in prompts}
            looks = [stub.Lookup.future(pb.LookupRequest(session_id=sid, tokens=packed(t)),
                                        timeout=120)
                     for t in list(prompts.values()) * (LOOKUPS // SEQS)]
            time.sleep(rng.random() * 0.01)  # the SIGTERM lands at varied points of the calls
            d.proc.send_signal(signal.SIGTERM)
            seqs = {seq_id: (prompts[seq_id], self.count(call) == grpc.StatusCode.OK)
                    for seq_id, call in commits.items()}
            for call in looks:
                self.count(call)
        self.previous = (sid, seqs)
        assert d.stop(120) == 0, d.log()


@pytest.mark.timeout(1800)
def test_200_sigterms_with_calls_in_flight_answer_ok_or_unavailable(capsys):
    d = ForkedDaemon(CONFIG)
    cycles = Cycles(d, seed=7)
    try:
        started = time.monotonic()
        for cycle in range(CYCLES):
            cycles.one()
            bad = {c: n for c, n in cycles.codes.items() if c not in ALLOWED}
            assert not bad, f"cycle {cycle}: calls answered {bad}\n{d.log()[-4000:]}"
        d.start()
        with grpc.insecure_channel("unix:" + d.socket) as ch:
            stub = pb_grpc.PrefixCacheStub(ch)
            cycles.check_previous(stub, stub.Attach(pb.AttachRequest(
                client_name="check", layout=pb_layout()), timeout=60).session_id)
        in_flight = [int(n) for n in re.findall(r"stopping sessions=\d+ in_flight=(\d+)",
                                                d.log_text())]
        d.close()
    except BaseException:
        d.close(check=False)
        raise
    codes = cycles.codes
    with capsys.disabled():
        print(f"\nSIGTERM x{CYCLES}: {({c.name: n for c, n in codes.items()})}, "
              f"stops with calls in flight: {sum(1 for n in in_flight if n)}, "
              f"{time.monotonic() - started:.0f} s")
    assert len(in_flight) >= CYCLES
    # the test means something: stops met calls in flight, and both answers happened
    assert sum(1 for n in in_flight if n) >= CYCLES // 10, in_flight
    assert codes.get(grpc.StatusCode.OK, 0) and codes.get(grpc.StatusCode.UNAVAILABLE, 0), codes
