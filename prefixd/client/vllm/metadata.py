"""What the scheduler side tells the worker side each step, and what the worker answers.

Plain dataclasses (picklable: a multi-process executor ships them to its workers); the vLLM
base classes wrap them in ``connector.py``, so this module imports no vLLM.

- ``StepPlan`` (scheduler -> worker, one per step): the blocks to load before the forward and
  to save after it, each as ``Transfer``\\ s pairing vLLM block ids with prefixd slots, under the
  daemon ``epoch`` the slots were handed out in; and the vLLM blocks the scheduler already knows
  it cannot load (``failed_block_ids``: promised under a daemon epoch that has ended), which the worker reports to vLLM as load errors in this step.
- ``SaveReport`` (worker -> scheduler, one per step): blocks saved per request, and requests
  with a save that failed (their sequence is then released without a commit).
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
    """Blocks saved per request this step, and requests whose save failed."""

    saved: dict[str, int] = dataclasses.field(default_factory=dict)
    failed: set[str] = dataclasses.field(default_factory=set)

    def merge(self, other: "SaveReport") -> "SaveReport":
        """Both reports in one (several workers' reports for one step)."""
        saved = dict(self.saved)
        for req_id, n in other.saved.items():
            saved[req_id] = saved.get(req_id, 0) + n
        return SaveReport(saved, self.failed | other.failed)
