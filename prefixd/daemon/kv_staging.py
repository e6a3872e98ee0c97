"""The staging buffer ReadKV gathers a chunk's KV into before framing it as a reply.

A ReadKV chunk leaves the pool in two copies: the gather through the block table into a
contiguous ``[num_layers, 2, n, num_kv_heads, head_dim]`` tensor, then ``framed_kv``'s join into
the reply's ``bytes`` (gRPC takes nothing else). The first copy's destination is reused here
rather than allocated per chunk: a fresh tensor of a few MiB is fresh pages, faulted in on
every read (a 4 MiB chunk's gather then its join: 2.5-3.0 ms with a fresh tensor against
1.4 ms staged, medians on the loaded 2-core dev host).
"""

from __future__ import annotations

import math

import torch

RETAIN_BYTES = 16 << 20  # a larger chunk gets a tensor of its own, freed with it


class StagingBuffer:
    """One reusable byte buffer, viewed as each chunk's tensor.

    Invariants: ``_buf`` is None or a 1-D uint8 CPU tensor of at most ``RETAIN_BYTES``;
    a view ``take`` returned is valid until the next ``take``.

    NOTE (one buffer serves every stream): the loop thread runs each ReadKV chunk's gather
    and its join into the reply's bytes within one ``next()`` of the stream's generator,
    so no two chunks ever hold the buffer at once, and nothing but the loop uses it.
    """

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous CPU tensor of ``shape`` and ``dtype`` over the buffer (uninitialized),
        or a fresh tensor when it is larger than ``RETAIN_BYTES``."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > RETAIN_BYTES:
            return torch.empty(shape, dtype=dtype)
        if self._buf is None or self._buf.numel() < nbytes:
            self._buf = torch.empty(nbytes, dtype=torch.uint8)
        return self._buf[:nbytes].view(dtype).view(shape)

    def check_invariants(self) -> None:
        buf = self._buf
        assert buf is None or (buf.dtype == torch.uint8 and buf.dim() == 1
                               and buf.numel() <= RETAIN_BYTES and buf.device.type == "cpu")
