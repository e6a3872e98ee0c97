"""What the scheduler side tells the worker side each step, and what the worker answers.

Plain dataclasses (picklable: a multi-process executor ships them to its workers); the vLLM
base classes wrap them in ``connector.py``, so this module imports no vLLM.

- ``StepPlan`` (scheduler -> worker, one per step): the blocks to load before the forward and
  to save after it, each as ``Transfer``\\ s pairing vLLM block ids with prefixd slots, under the
  daemon ``epoch`` the slots were handed out in; and the vLLM blocks the scheduler already knows
  it cannot load (``failed_block_ids``: promised under a daemon epoch that has ended), which the worker reports to vLLM as load errors in this step.
- ``SaveReport`` (worker -> scheduler, one per step): blocks saved per request by each shard
  (one worker's slice of every block: its KV heads under tensor parallelism, its layers under
  pipeline parallelism; ``shards.py``), and requests with a save that failed (their sequence
  is then released without a commit). vLLM merges the workers' reports of a step into one
  (``merge``); a block counts as saved only when every shard saved it.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Transfer:
    """vLLM block ``block_ids[i]`` <-> prefixd slot ``slots[i]``, for request ``req_id``.

    Invariant: ``len(block_ids) == len(slots)``.
    """

    req_id: str
    block_ids: tuple[int, ...]
    slots: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.block_ids) != len(self.slots):
            raise ValueError(f"request {self.req_id}: {len(self.block_ids)} vLLM blocks for {len(self.slots)} slots")


@dataclasses.dataclass
class StepPlan:
    """One step's copies. ``epoch`` is the daemon's (Attach reply) when the slots were given:
    the worker copies only while its own session is attached to the same daemon epoch."""

    epoch: int = 0
    loads: list[Transfer] = dataclasses.field(default_factory=list)
    saves: list[Transfer] = dataclasses.field(default_factory=list)
    failed_block_ids: set[int] = dataclasses.field(default_factory=set)

    def empty(self) -> bool:
        return not (self.loads or self.saves or self.failed_block_ids)


@dataclasses.dataclass
class SaveReport:
    """Blocks saved this step per request and shard (``saved[req_id][shard] = blocks``), and
    requests whose save failed on some shard."""

    saved: dict[str, dict[int, int]] = dataclasses.field(default_factory=dict)
    failed: set[str] = dataclasses.field(default_factory=set)

    def add(self, req_id: str, shard: int, num_blocks: int) -> None:
        by_shard = self.saved.setdefault(req_id, {})
        by_shard[shard] = by_shard.get(shard, 0) + num_blocks

    def merge(self, other: "SaveReport") -> "SaveReport":
        """Both reports in one (several workers' reports for one step)."""
        out = SaveReport({r: dict(by_shard) for r, by_shard in self.saved.items()}, self.failed | other.failed)
        for req_id, by_shard in other.saved.items():
            for shard, n in by_shard.items():
                out.add(req_id, shard, n)
        return out

    def whole_blocks(self, req_id: str, num_shards: int) -> tuple[int, bool]:
        """``(blocks every shard saved, whether the shards agree)`` for ``req_id``: the shards of
        one step save the same blocks, so a shard that saved fewer (or none: a worker that
        reported nothing) left blocks that are not whole."""
        by_shard = self.saved.get(req_id, {})
        counts = [by_shard.get(s, 0) for s in range(num_shards)]
        return min(counts), max(counts) == min(counts) and set(by_shard) <= set(range(num_shards))
