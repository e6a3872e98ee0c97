"""KV layout: the key of a pool, and the shape of one block in it."""

from __future__ import annotations

import dataclasses
import hashlib
import math


# dtype name -> (bytes per element, numpy view used for raw byte handling)
_DTYPES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
}


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """What one model's KV looks like; a pool is keyed by it.

    A pool is one tensor ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``
    (block-major), so one block is one contiguous chunk of ``block_bytes`` bytes.

    Raises:
        ValueError: on construction, for any field out of range or an unknown dtype.
    """

    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float16"
    block_size: int = 16

    def __post_init__(self) -> None:
        if not self.model_id or len(self.model_id) > 256:
            raise ValueError(f"model_id must be 1..256 characters, got {self.model_id!r}")
        if "\x00" in self.model_id:  # ``to_bytes`` separates the fields with NUL
            raise ValueError(f"model_id must not contain NUL characters, got {self.model_id!r}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 65536:
                raise ValueError(f"{name} must be an int in 1..65536, got {value!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")

    @property
    def itemsize(self) -> int:
        return _DTYPES[self.dtype]

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one block: ``(num_layers, 2, block_size, num_kv_heads, head_dim)``."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_numel(self) -> int:
        return math.prod(self.block_shape)

    @property
    def block_bytes(self) -> int:
        return self.block_numel * self.itemsize

    def pool_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, *self.block_shape)

    def torch_dtype(self):
        import torch  # local: api/ must stay importable without torch for light clients

        return getattr(torch, self.dtype)

    def to_bytes(self) -> bytes:
        """A canonical, stable encoding (enters the root hash and the WAL's ``meta``)."""
        return (
            f"{self.model_id}\x00{self.num_layers}\x00{self.num_kv_heads}\x00{self.head_dim}"
            f"\x00{self.dtype}\x00{self.block_size}"
        ).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> "KVLayout":
        model_id, nl, nh, hd, dtype, bs = raw.decode().split("\x00")
        return cls(model_id, int(nl), int(nh), int(hd), dtype, int(bs))

    def digest(self) -> bytes:
        """16 bytes that identify the layout (stable across processes)."""
        return hashlib.blake2b(self.to_bytes(), digest_size=16).digest()


def as_token_bytes(tokens) -> bytes:
    """Token ids as packed little-endian int32 bytes (the form the cache core carries).

    Accepts bytes/bytearray/memoryview (taken as already packed), a numpy array, or any
    sequence of ints. Raises ValueError for ids outside [0, 2**31) or a byte length that is not
    a multiple of 4.
    """
    if isinstance(tokens, (bytes, bytearray, memoryview)):
        raw = bytes(tokens)
        if len(raw) % 4:
            raise ValueError(f"packed tokens must be a multiple of 4 bytes, got {len(raw)}")
        return raw
    import numpy as np  # here, not at import: prefixctl imports this module and answers without it

    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return b""
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"tokens must be integers, got dtype {arr.dtype}")
    if int(arr.min()) < 0 or int(arr.max()) >= 2**31:
        raise ValueError("token ids must be in [0, 2**31)")
    return arr.astype("<i4", copy=False).tobytes()
