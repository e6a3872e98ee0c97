"""How a Triton kernel is launched here: compiled for CUDA, or under Triton's interpreter.

Triton decides between compiling and interpreting when ``triton`` is first imported
(``TRITON_INTERPRET=1`` in the environment at that moment): its own library functions
(``tl.zeros``, ``tl.max``...) are built one way or the other then. A process therefore runs our
kernels interpreted exactly when Triton's library is interpreted, whatever the environment says
now; :func:`kernel_for` returns the matching variant of a kernel, so a kernel module imported
before or after the environment changed still works.

The interpreter runs on CPU tensors (milliseconds per loop step: for tests on tiny shapes).
Compiled kernels need CUDA tensors; anything else is refused with a message saying how to run
them interpreted.
"""

from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger(__name__)

# dtypes the attention and KV-write kernels accept (block copy takes any element size).
ATTENTION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpreter_active() -> bool:
    """True when Triton was imported in interpreter mode (``TRITON_INTERPRET=1`` at import)."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.zeros, InterpretedFunction)


def kernel_for(kernel, device: torch.device):
    """The variant of ``kernel`` that runs in this process, for tensors on ``device``.

    Args:
        kernel: a ``@triton.jit`` function (or the ``InterpretedFunction`` that decorator makes
            in interpreter mode).
        device: where the kernel's tensors live.

    Returns:
        Something indexable by a grid and callable with the kernel's arguments.

    Raises:
        ValueError: for tensors that are not on CUDA while Triton compiles, or on neither CUDA
            nor CPU while it interprets.
    """
    fn = getattr(kernel, "fn", kernel)
    if interpreter_active():
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"the Triton interpreter runs on CPU tensors, got device {device}")
        return _variant(fn, interpreted=True)
    if device.type != "cuda":
        raise ValueError(
            f"Triton kernels need CUDA tensors, got device {device}; to run them on CPU, set "
            "TRITON_INTERPRET=1 before triton is first imported, or use backend='reference'"
        )
    import triton

    if isinstance(kernel, triton.runtime.JITFunction):
        return kernel
    return _variant(fn, interpreted=False)


@functools.cache
def _variant(fn, interpreted: bool):
    if interpreted:
        from triton.runtime.interpreter import InterpretedFunction

        log.debug("triton interpreter kernel=%s", fn.__name__)
        return InterpretedFunction(fn)
    import triton

    return triton.jit(fn)


def is_interpreted(device: torch.device) -> bool:
    """True when kernels for tensors on ``device`` run under the Triton interpreter."""
    return device.type != "cuda" or interpreter_active()


@functools.cache
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (cached: the query is not free)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` reinterpreted as integers of its element width (copies then work for any dtype).

    Raises:
        ValueError: for an element size with no integer twin.
    """
    bits = _BITS.get(t.element_size())
    if bits is None:
        raise ValueError(f"cannot copy elements of {t.element_size()} bytes ({t.dtype})")
    return t.view(bits)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (and >= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)
