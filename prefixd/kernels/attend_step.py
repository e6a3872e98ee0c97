"""One step of paged attention's inner loop, shared by the decode and extend kernels.

``attend_step`` takes ``BLOCK_N`` keys of one sequence (logical positions ``offs_n``) through
its block table, scores them against the program's query rows and folds them into the online
softmax state ``(acc, m_i, l_i)`` (fp32, exp2, the scale and log2(e) folded into ``qk_scale``).
A key's address is ``slot * stride_block + offset * stride_tok`` in int64: a pool past 2**31
elements is normal on a large device.

The caller says which scores count with ``visible`` (broadcast against ``[rows, BLOCK_N]``):
decode passes the keys in range, extend those in range and at or before each row's token.
Invariant: a row whose ``visible`` was all false for a step keeps its state (p = 0 there once a
finite maximum exists; the kernels arrange that key 0 is seen first).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_step(q, acc, m_i, l_i, k_base, v_base, table, offs_n, mask_n, visible, offs_d, mask_d,
                stride_k_block, stride_k_tok, stride_v_block, stride_v_tok, qk_scale,
                BLOCK_SIZE: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold keys ``offs_n`` (``mask_n``: the ones that exist) into ``(acc, m_i, l_i)``; returns
    the new state."""
    slot = tl.load(table + offs_n // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
    within = (offs_n % BLOCK_SIZE).to(tl.int64)
    mask_kv = mask_n[:, None] & mask_d[None, :]
    k_off = slot * stride_k_block + within * stride_k_tok
    k = tl.load(k_base + k_off[:, None] + offs_d[None, :], mask=mask_kv, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v_off = slot * stride_v_block + within * stride_v_tok
    v = tl.load(v_base + v_off[:, None] + offs_d[None, :], mask=mask_kv, other=0.0)
    if UPCAST:
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i
