"""KV-event journal benchmark: what publishing KV events costs the serving thread.

Prints one JSON object. gsp requests (``open`` the prompt, ``extend`` by the output less 4
tokens, ``commit`` at ``index``, ``release``) through a ``DurableCache`` with ``sync="none"``
(no fsync in the way), the same requests twice on fresh state directories, interleaved in
rounds so that the host's noise lands on both:

- ``off.per_request_us``: no listener (the daemon before SubscribeEvents);
- ``on.per_request_us``: the daemon's listener (``EventJournals.observe``) with
  ``--subscribers`` live subscribers that read every event after each request (as the stream
  handlers would, on the same thread);
- ``observe_us_per_request``: the journal's own time per request (timed inside the listener);
- ``events_per_request``, ``blocks_per_event``: what a router receives.

Device 10% / host 40% / disk 150% of the working set, ``write_through``, block 16, 512-byte
blocks (as ``bench/engine.py``) so that the bookkeeping shows, not memcpy.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from prefixd.api.layout import KVLayout  # noqa: E402
from prefixd.daemon.event_journal import EventJournals  # noqa: E402
from prefixd.engine.durable import DurableCache  # noqa: E402
from prefixd.tools.driver import gc_paused  # noqa: E402
from prefixd.tools.workloads import gsp, working_set_tokens  # noqa: E402

BS = 16
LAYOUT = KVLayout("bench-events", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16",
                  block_size=BS)


def _sizes(reqs) -> tuple[int, int, int]:
    ws = working_set_tokens(reqs, BS) // BS
    per_request = max((len(r.prompt) + len(r.output)) // 4 // BS + 1 for r in reqs)
    return max(ws // 10, 2 * per_request), max(1, ws * 4 // 10), max(1, ws * 15 // 10)


def run(reqs, sizes, listen: bool, num_subscribers: int) -> dict:
    root = tempfile.mkdtemp(prefix="prefixd-bench-events-")
    shm = tempfile.mkdtemp(prefix="prefixd-bench-events-", dir="/dev/shm")
    dc = DurableCache(os.path.join(root, "state"), LAYOUT, sizes, sync="none", shm_dir=shm,
                      checkpoint_records=10**9, checkpoint_blocks=10**12)
    journals = EventJournals(["t"], 1, 65536, 4096)
    journal = journals.journal("t")
    subs = [journal.subscribe(0) for _ in range(num_subscribers)]
    observe_ns = [0]
    if listen:
        def listener(events, _clock=time.perf_counter_ns):
            t0 = _clock()
            journals.observe("t", LAYOUT, events)
            observe_ns[0] += _clock() - t0
        dc.event_listener = listener
    clock = time.perf_counter_ns
    totals = []
    try:
        with gc_paused():
            for req in reqs:
                t0 = clock()
                seq = dc.open(req.prompt)
                dc.extend(seq.id, req.output[:-4])
                dc.commit(seq.id, "index")
                dc.release(seq.id)
                for sub in subs:
                    while journal.next_entry(sub) is not None:
                        pass
                totals.append(clock() - t0)
    finally:
        dc.close()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    assert all(not s.overflowed for s in subs)
    blocks = 0
    for n in range(journal.oldest, journal.next_sequence_number):
        blocks += len(journal._ring[n % journal.ring_size].block_hashes)
    held = journal.next_sequence_number - journal.oldest
    return {"per_request_us": round(statistics.median(totals) / 1000, 2),
            "observe_us_per_request": round(observe_ns[0] / len(reqs) / 1000, 2),
            "events_per_request": round(journal.emitted / len(reqs), 2),
            "blocks_per_event": round(blocks / held, 1) if held else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--subscribers", type=int, default=4)
    args = parser.parse_args()
    reqs = gsp(num_groups=args.groups, prompts_per_group=args.prompts, seed=0)
    sizes = _sizes(reqs)
    off, on = [], []
    for _ in range(args.rounds):
        off.append(run(reqs, sizes, False, 0))
        on.append(run(reqs, sizes, True, args.subscribers))
    pick = lambda runs: min(runs, key=lambda r: r["per_request_us"])  # noqa: E731
    best_off, best_on = pick(off), pick(on)
    print(json.dumps({
        "workload": {"name": "gsp", "groups": args.groups, "prompts_per_group": args.prompts,
                     "requests": len(reqs), "block_size": BS, "sizes": sizes},
        "subscribers": args.subscribers, "rounds": args.rounds,
        "off": {"per_request_us": best_off["per_request_us"]},
        "on": {"per_request_us": best_on["per_request_us"]},
        "on_over_off": round(best_on["per_request_us"] / best_off["per_request_us"], 3),
        "observe_us_per_request": best_on["observe_us_per_request"],
        "events_per_request": best_on["events_per_request"],
        "blocks_per_event": best_on["blocks_per_event"],
    }, sort_keys=True))


if __name__ == "__main__":
    main()
