"""Token ids and block tables on the wire: packed little-endian int32 bytes (prefixd.proto
"Conventions"). Tensors on the wire are ``prefixd.api.tensors`` (shared with the daemon).
"""

from __future__ import annotations

import struct
import sys


from prefixd.api.layout import as_token_bytes
from prefixd.client.errors import InvalidArgument

# a C int is the wire's int32 in this process's byte order (little-endian hosts)
_NATIVE_LE_I32 = sys.byteorder == "little" and struct.calcsize("i") == 4


def pack_tokens(tokens) -> bytes:
    """Token ids as packed little-endian int32 bytes.

    Accepts a list of ints, a 1-D numpy array or torch tensor of integers, or bytes already
    packed.

    Raises:
        InvalidArgument: not 1-D integers in ``[0, 2**31)``, or bytes not a multiple of 4.
    """
    # NOTE: torch is not imported here: ``prefixctl`` packs token ids through this module and
    # answers without it (seconds of import). A tensor exists only if torch is already loaded.
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(tokens, torch.Tensor):
        if tokens.is_floating_point() or tokens.is_complex():
            raise InvalidArgument(f"tokens must be integers, got a tensor of {tokens.dtype}")
        tokens = tokens.detach().cpu().numpy()
    try:
        return as_token_bytes(tokens)
    except (ValueError, TypeError) as exc:
        raise InvalidArgument(f"bad tokens: {exc}") from None


def unpack_ints(raw: bytes) -> list[int]:
    """Packed little-endian int32 bytes (tokens or a block table) as a list of ints.

    NOTE: every Open reply's block table comes through here: a ``memoryview`` cast took 17 us
    for a 136-entry table on cold caches, numpy's ``frombuffer`` + ``tolist`` 34."""
    if _NATIVE_LE_I32:
        return memoryview(raw).cast("i").tolist()
    import numpy as np  # big-endian hosts only

    return np.frombuffer(raw, dtype="<i4").tolist()
