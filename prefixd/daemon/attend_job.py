"""One checked Attend call's kernel work (``AttendJob``), split over sequences for the daemon's
compute threads.

``kv_rpc.prepare_attend`` checks the request, writes the new K/V and builds the kernel's
arguments on the loop; the job it returns only reads the pool. Calling it runs the whole batch
on the caller's thread. The servicer instead asks for ``parts(n)`` (contiguous ranges of
sequences of about equal work), runs ``run(a, b)`` for each on ``DaemonCore.compute`` at once,
and builds the reply from the outputs in order with ``reply``.

NOTE (why split): the daemon runs torch with one intra-op thread (``core.limit_intra_op_threads``:
libgomp throttles an OpenMP team started off the process's first thread), so a CPU pool's
kernel gains its parallelism here, from threads that each take some of the sequences. The
sequences of a batch are independent, and each part is the same kernel over fewer of them: the
output is bit-identical to the whole batch's (tested). A CUDA pool is never split: its kernel
is one launch.
"""

from __future__ import annotations

from itertools import accumulate

import torch

from prefixd.api import prefixd_pb2 as pb
from prefixd.api.tensors import to_tensor_msg
from prefixd.kernels import paged_attention


class AttendJob:
    """The kernel's arguments for a batch of sequences (all on the pool's device).

    Invariants: ``len(lens) == len(counts) == tables.shape[0] == seq_lens.shape[0]``;
    decode (``loc is None``): ``query`` has one row per sequence; extend: ``loc`` holds
    ``len(lens) + 1`` offsets from 0 to ``query.shape[0]`` and ``counts`` their differences.
    """

    def __init__(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 tables: torch.Tensor, seq_lens: torch.Tensor, loc: torch.Tensor | None,
                 scale: float | None, lens: list[int], counts: list[int]) -> None:
        self.query, self.k_cache, self.v_cache = query, k_cache, v_cache
        self.tables, self.seq_lens, self.loc, self.scale = tables, seq_lens, loc, scale
        self.lens, self.counts = lens, counts

    def __call__(self) -> pb.AttendReply:
        return self.reply([self.run(0, len(self.lens))])

    def parts(self, n: int) -> list[tuple[int, int]]:
        """At most ``n`` contiguous ranges of sequences covering the batch, cut where the work
        (query rows x cached tokens) is about equal; one range on a CUDA pool."""
        num = len(self.lens)
        n = max(1, min(n, num))
        if n == 1 or self.query.device.type != "cpu":
            return [(0, num)]
        work = list(accumulate(rows * tokens for rows, tokens in zip(self.counts, self.lens)))
        total, cuts, a = work[-1], [], 0
        for i in range(1, n):
            b = next((j + 1 for j in range(a, num - 1) if work[j] * n >= total * i), num - 1)
            if b > a:
                cuts.append((a, b))
                a = b
        cuts.append((a, num))
        return cuts

    def run(self, a: int, b: int) -> torch.Tensor:
        """The kernel over sequences ``a .. b`` of the batch; their query rows' output."""
        if a == 0 and b == len(self.lens):  # the whole batch (every CUDA call): no slicing
            query, loc = self.query, self.loc
        elif self.loc is None:
            query, loc = self.query[a:b], None
        else:
            r0, r1 = int(self.loc[a]), int(self.loc[b])
            query, loc = self.query[r0:r1], self.loc[a:b + 1] - r0
        return paged_attention(query, self.k_cache, self.v_cache, self.tables[a:b],
                               self.seq_lens[a:b], query_start_loc=loc, scale=self.scale,
                               max_seq_len=max(self.lens[a:b]), max_query_len=max(self.counts[a:b]))

    def reply(self, outputs: list[torch.Tensor]) -> pb.AttendReply:
        """The reply from the parts' outputs, in the order of ``parts``."""
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
        reply = pb.AttendReply()
        to_tensor_msg(out, out=reply.output)  # in place: see prefixd.api.tensors
        return reply
