"""The scheduler side of the connector: how much of a prompt prefixd holds, the pin, the plan of
each step's copies, and the commit (pure Python over the client library; no vLLM import).

Per request, in vLLM's order:

1. ``num_new_matched_tokens``: ``Open`` of the whole prompt, which pins its cached blocks and
   allocates prefixd blocks for the rest; the hit is its whole cached blocks below the last
   token (vLLM must compute at least that one to get logits), past what vLLM holds itself. May
   be called again for the same request (vLLM could not schedule it yet, or resumes it): the
   open is made once and its pin answers every call.
2. ``after_alloc``: what vLLM took of the hit, to load. A request vLLM held whole itself (no
   open in step 1) is opened here, for its saves. A sequence opened under an older daemon
   epoch loads nothing: those vLLM blocks go to the worker as failed loads and vLLM
   recomputes them.
3. ``build_plan`` each step: loads (promised blocks, once) and saves (blocks of the prompt that
   are full after this step and that prefixd does not hold), as vLLM block id <-> prefixd slot.
4. ``on_report``: the workers' saves of a step, counted per request as the blocks every shard
   saved (under tensor or pipeline parallelism each worker writes its slice of a block, and a
   block is whole only when all ``num_shards`` did; a shard that saved less fails the request,
   which is then released uncommitted); the report that completes a prompt (every full block past the cached prefix saved) commits it at the
   configured durability at once, so that other vLLMs hit it while this one still decodes.
5. ``finished``: ``Release`` (committing first if the commit is still owed). vLLM finishes a
   request before it hands the scheduler that step's worker report, so a request whose saves
   are not all reported yet is parked and released by the report that completes it.

NOTE: one rpc, not a ``Lookup`` then an ``Open``: the open's pin is the lookup, and the time to
first token of an external hit paid both (~3 ms each, against a ~400 ms TTFT
within ~10 ms of the ExampleConnector's). A request vLLM cannot schedule holds its pin until
it is scheduled or finished (vLLM calls ``request_finished`` for aborted waiting requests too);
a client that dies holding it loses it with its lease.
NOTE: only the prompt's blocks are saved, not generated tokens: the prefix cache is for
prompts (a multi-turn chat's next prompt contains the answer, and its own save covers it).
NOTE: every daemon call goes through ``DaemonLink.call``: a daemon that is down or restarting
gives a miss (0 hit tokens, no save), never an error, and its sessions reconnect by themselves.
Slots are handed out under a daemon epoch; a request opened under an older epoch neither
loads nor saves nor commits again (its old block table may name another client's slots).
"""

from __future__ import annotations

import dataclasses
import logging

from prefixd.client.vllm.daemon_link import DaemonLink
from prefixd.client.vllm.metadata import SaveReport, StepPlan, Transfer

log = logging.getLogger(__name__)
requests_log = logging.getLogger("prefixd.client.vllm")  # one INFO line per request


@dataclasses.dataclass
class Tracked:
    """One request's state on the scheduler side.

    ``seq``: the daemon sequence holding the prompt (None: the open failed; nothing to load or
    save). ``epoch``: the daemon epoch it was opened in. ``match_start`` / ``load_tokens``: the
    external hit vLLM will load (from ``match_start``, a block boundary), cleared once planned.
    ``block_ids``: vLLM's blocks of the request. Blocks ``save_from .. save_to`` are the prompt's
    full blocks that prefixd does not hold; ``planned`` is the first not yet planned, of which
    ``planned_blocks`` were planned and ``confirmed`` reported saved.

    Invariants: ``save_from <= save_to``; ``confirmed <= planned_blocks <= save_to - save_from``.
    """

    req_id: str
    num_prompt_tokens: int
    seq: object = None
    epoch: int = 0
    match_start: int = 0
    load_tokens: int = 0
    hit_tokens: int = 0
    block_ids: list = dataclasses.field(default_factory=list)
    save_from: int = 0
    save_to: int = 0
    planned: int = 0
    planned_blocks: int = 0
    confirmed: int = 0
    failed: bool = False
    committed: bool = False

    def saves_settled(self) -> bool:
        return self.failed or self.confirmed >= self.planned_blocks

    def complete(self) -> bool:
        """Every full prompt block past the cached prefix saved: the commit may index them."""
        return (not self.failed and self.save_to > self.save_from and self.planned == self.save_to
                and self.confirmed == self.planned_blocks)


@dataclasses.dataclass
class SchedulerStats:
    """Requests seen, external hit tokens promised, blocks that failed to load, blocks saved,
    requests committed / released without a commit."""

    requests: int = 0
    hit_tokens: int = 0
    failed_load_blocks: int = 0
    saved_blocks: int = 0
    committed: int = 0
    uncommitted: int = 0


class SchedulerSide:
    """What the scheduler half of ``PrefixdConnector`` does, over one ``DaemonLink``.

    State: ``_matched`` (req id -> (vLLM's block-aligned local tokens, hit past them)) from the
    last ``num_new_matched_tokens``; ``_tracked`` (req id -> ``Tracked``) for requests opened
    and not finished; ``_parked`` for finished ones waiting for their last save report.

    Invariants: a request is in at most one of ``_tracked`` and ``_parked``; every sequence
    this side holds belongs to one of them (``check_invariants``).
    """

    def __init__(self, link: DaemonLink, block_size: int, durability: str, num_shards: int = 1) -> None:
        self.link = link
        self.block_size = block_size
        self.durability = durability
        self.num_shards = num_shards
        self.stats = SchedulerStats()
        self._matched: dict[str, tuple[int, int]] = {}
        self._tracked: dict[str, Tracked] = {}
        self._parked: dict[str, Tracked] = {}
        self._orphans: list = []  # sequences whose release the daemon did not take (yet)

    # -- vLLM's calls, in order ------------------------------------------------------------

    def num_new_matched_tokens(self, req_id: str, prompt, num_computed: int) -> int:
        """Tokens past ``num_computed`` (vLLM's own block-aligned hit) that prefixd can give."""
        bs = self.block_size
        limit = (len(prompt) - 1) // bs * bs
        if limit <= num_computed:
            return 0
        t = self._tracked.get(req_id)
        if t is None:
            t = self._tracked[req_id] = self._open(req_id, prompt)
        if t.seq is None or t.epoch != self.link.epoch():
            return 0
        hit = min(limit, t.seq.cached_tokens // bs * bs)
        extra = max(0, hit - num_computed)
        self._matched[req_id] = (num_computed, extra)
        return extra

    def after_alloc(self, req_id: str, prompt, num_external: int) -> None:
        """vLLM allocated blocks for the request (new, or resumed after a preemption): open its
        prompt in prefixd if ``num_new_matched_tokens`` did not, and remember what to load."""
        t = self._tracked.get(req_id)
        if t is None:
            t = self._tracked[req_id] = self._open(req_id, prompt)
        start, _ = self._matched.pop(req_id, (0, 0))  # vLLM may trim the hit: take its count
        if num_external > 0:
            t.match_start, t.load_tokens = start, num_external
            if not t.hit_tokens:
                t.hit_tokens = num_external
                self.stats.hit_tokens += num_external

    def build_plan(self, new_reqs, cached_reqs, num_scheduled: dict) -> StepPlan:
        """This step's copies.

        Args:
            new_reqs: ``(req_id, block_ids, num_computed_tokens)`` of requests scheduled for the
                first time. cached_reqs: ``(req_id, new_block_ids or None, resumed,
                num_computed_tokens)`` of the others (a resumed one's ids replace its list).
            num_scheduled: req id -> tokens computed in this step.
        """
        if self._orphans:
            self._release_orphans()
        plan = StepPlan(epoch=self.link.epoch())
        for req_id, block_ids, num_computed in new_reqs:
            t = self._tracked.get(req_id)
            if t is not None:
                t.block_ids = list(block_ids)
                self._plan(t, plan, num_computed + num_scheduled.get(req_id, 0))
        for req_id, new_block_ids, resumed, num_computed in cached_reqs:
            t = self._tracked.get(req_id)
            if t is None:
                continue
            if resumed:
                t.block_ids = list(new_block_ids or ())
            elif new_block_ids:
                t.block_ids.extend(new_block_ids)
            self._plan(t, plan, num_computed + num_scheduled.get(req_id, 0))
        self.stats.failed_load_blocks += len(plan.failed_block_ids)
        return plan

    def on_report(self, report: SaveReport) -> None:
        """The workers' saves of one step (every shard's, merged by vLLM): commits the prompts
        they complete and releases the parked requests they settle."""
        for req_id in report.saved:
            t = self._tracked.get(req_id) or self._parked.get(req_id)
            if t is None:
                continue
            n, agree = report.whole_blocks(req_id, self.num_shards)
            if not agree:
                log.warning("request=%s: the workers' saves differ %s over %d shards; not committed",
                            req_id, report.saved[req_id], self.num_shards)
                t.failed = True
            t.confirmed += n
            self.stats.saved_blocks += n
        for req_id in report.failed:
            t = self._tracked.get(req_id) or self._parked.get(req_id)
            if t is not None:
                t.failed = True
        epoch = self.link.epoch()
        for t in self._tracked.values():
            if not t.committed and t.complete() and t.epoch == epoch:
                t.committed = bool(self.link.call("commit", lambda s: s.commit(t.seq, durability=self.durability) >= 0,
                                                  False))
        for req_id in [r for r, t in self._parked.items() if t.saves_settled()]:
            self._release(self._parked.pop(req_id))

    def finished(self, req_id: str) -> None:
        """vLLM is done with the request: release its sequence (committing what was saved),
        now or once its last saves are reported."""
        self._matched.pop(req_id, None)
        t = self._tracked.pop(req_id, None)
        if t is None:
            return
        if t.saves_settled():
            self._release(t)
        else:
            self._parked[req_id] = t

    def shutdown(self) -> None:
        """Release everything still held (parked requests commit if complete), then detach."""
        for t in [*self._parked.values(), *self._tracked.values()]:
            self._release(t)
        self._parked.clear()
        self._tracked.clear()
        self._release_orphans()
        self.link.close()

    # -- helpers ---------------------------------------------------------------------------

    def _open(self, req_id: str, prompt) -> Tracked:
        bs = self.block_size
        t = Tracked(req_id, len(prompt))
        self.stats.requests += 1
        if len(prompt) < bs:
            return t  # no full block: nothing to load or save, no rpc
        seq = self.link.call("open", lambda s: s.open(prompt))
        if seq is not None:
            t.seq, t.epoch = seq, self.link.epoch()
            t.save_from = seq.cached_tokens // bs
            t.save_to = max(t.save_from, len(prompt) // bs)
            t.planned = t.save_from
        return t

    def _plan(self, t: Tracked, plan: StepPlan, computed_after: int) -> None:
        bs = self.block_size
        usable = t.seq is not None and t.epoch == plan.epoch and not t.failed
        if t.load_tokens:
            first, end = t.match_start // bs, -(-(t.match_start + t.load_tokens) // bs)
            held = t.seq.cached_tokens // bs if usable else 0
            ids, slots = [], []
            for j in range(first, min(end, len(t.block_ids))):
                if j < held:
                    ids.append(t.block_ids[j])
                    slots.append(t.seq.block_table[j])
                else:
                    plan.failed_block_ids.add(t.block_ids[j])
            if ids:
                plan.loads.append(Transfer(t.req_id, tuple(ids), tuple(slots)))
            t.load_tokens = 0
        if not usable:
            if t.seq is not None:
                t.failed = True  # opened under another daemon epoch: never commit it
            return
        start, upto = t.planned, min(t.save_to, computed_after // bs, len(t.block_ids))
        if upto > start:
            plan.saves.append(Transfer(t.req_id, tuple(t.block_ids[start:upto]),
                                       tuple(t.seq.block_table[start:upto])))
            t.planned_blocks += upto - start
            t.planned = upto

    def _release(self, t: Tracked) -> None:
        committed = t.committed
        if t.seq is not None:
            commit = not t.committed and t.complete() and t.epoch == self.link.epoch()
            done = self.link.call("release", lambda s: s.release(t.seq, commit=commit,
                                                                 durability=self.durability) or True, False)
            committed = committed or (done and commit)
            if not done and _held(t.seq):
                # a refused commit, or the daemon restarted under it: do not leave a pin behind
                self.link.call("release", lambda s: s.release(t.seq))
            if _held(t.seq):  # the daemon is down: the next steps try again
                self._orphans.append(t.seq)
        if committed:
            self.stats.committed += 1
        else:
            self.stats.uncommitted += 1
        requests_log.info("prefixd request=%s prompt_tokens=%d external_hit_tokens=%d saved_blocks=%d "
                          "committed=%s", t.req_id, t.num_prompt_tokens, t.hit_tokens, t.confirmed, committed)

    def _release_orphans(self) -> None:
        """Release the sequences an outage kept (after a restart the library reclaimed them:
        the first call naming one raises DaemonRestarted, answered as a miss, the next works)."""
        for seq in list(self._orphans):
            if _held(seq):
                self.link.call("release", lambda s: s.release(seq))
            if not _held(seq):
                self._orphans.remove(seq)

    def check_invariants(self) -> None:
        assert not set(self._tracked) & set(self._parked), (set(self._tracked) & set(self._parked))
        for t in [*self._tracked.values(), *self._parked.values()]:
            assert t.save_from <= t.save_to, t
            assert 0 <= t.confirmed <= t.planned_blocks <= t.save_to - t.save_from, t
        self.link.check_invariants()


def _held(seq) -> bool:
    """The session still holds ``seq`` (neither released nor lost in a restart)."""
    return not seq.released and not getattr(seq, "lost", False)
