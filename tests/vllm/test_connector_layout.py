"""Layout discovery of vLLM's registered KV tensors and the block copies, on tensors shaped like
each backend's (main venv: no vLLM needed)."""

import threading
import time

import pytest
import torch

from prefixd.client.vllm.block_transfer import load_blocks, save_blocks
from prefixd.client.vllm.paged_layout import COLUMNS, ROWS, LayoutError, find_layout, split_for_backend

B, H, N, D = 7, 3, 32, 16  # blocks, kv heads, block size, head dim


def _kv(seed: int = 0):
    """K and V of every block as [B, N, H, D] each, distinct values everywhere."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, N, H, D, generator=g), torch.randn(B, N, H, D, generator=g)


def _found(tensor, split=ROWS):
    layout = find_layout(tensor.shape, tensor.stride(), num_kv_heads=H, head_dim=D, block_size=N, fused_split=split)
    return layout, layout.view(tensor)


def _expect(view, k, v):
    assert tuple(view.shape) == (B, 2, N, H, D)
    torch.testing.assert_close(view[:, 0], k, rtol=0, atol=0)
    torch.testing.assert_close(view[:, 1], v, rtol=0, atol=0)


def test_cpu_attn_fused_tensor_splits_k_and_v_by_rows():
    """vLLM 0.32's CPU_ATTN: [B, H, N, 2D] per layer, read by its kernels as [B, H, 2N, D] with
    a head's N rows of K first, then N rows of V (what cpu_attn.py's forward does)."""
    k, v = _kv()
    kv = torch.zeros(B, H, N, 2 * D)
    key_cache, value_cache = kv.view(B, H, 2 * N, D).chunk(2, dim=2)
    key_cache.copy_(k.permute(0, 2, 1, 3))
    value_cache.copy_(v.permute(0, 2, 1, 3))
    layout, view = _found(kv, ROWS)
    assert layout.form == "fused-rows"
    _expect(view, k, v)


def test_gpu_fused_tensor_splits_k_and_v_by_columns():
    """flash_attn / triton: the same [B, H, N, 2D] shape, K = C[:D] and V = C[D:] per token."""
    k, v = _kv(1)
    kv = torch.cat([k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)], dim=-1).contiguous()
    layout, view = _found(kv, COLUMNS)
    assert layout.form == "fused-columns"
    _expect(view, k, v)


def test_columns_reading_of_a_cpu_tensor_is_wrong():
    """The misreport: the shape is the same for both backends, so reading CPU_ATTN's tensor the
    GPU way gives other numbers (the split must come from the backend, not the shape)."""
    k, v = _kv(2)
    kv = torch.zeros(B, H, N, 2 * D)
    key_cache, value_cache = kv.view(B, H, 2 * N, D).chunk(2, dim=2)
    key_cache.copy_(k.permute(0, 2, 1, 3))
    value_cache.copy_(v.permute(0, 2, 1, 3))
    _, view = _found(kv, COLUMNS)
    assert not torch.equal(view[:, 0], k)


def test_fused_tensor_with_block_outermost_strides():
    """A [B, H, N, 2D] view over a buffer where every layer of a block sits together (vLLM's
    block-outermost layouts): only the block stride differs, and the view follows it."""
    k, v = _kv(3)
    layers = 4
    buf = torch.zeros(B, layers, H, 2 * N, D)
    buf[:, 2, :, :N] = k.permute(0, 2, 1, 3)
    buf[:, 2, :, N:] = v.permute(0, 2, 1, 3)
    kv = buf.view(B, layers, H, N, 2 * D)[:, 2]
    assert not kv.is_contiguous()
    _, view = _found(kv, ROWS)
    _expect(view, k, v)


@pytest.mark.parametrize("form", ["2BNHD", "2BHND", "B2NHD"])
def test_split_tensors(form):
    """Older backends: a K/V axis of 2 first or second, NHD or HND inside."""
    k, v = _kv(4)
    if form == "2BNHD":
        kv = torch.stack([k, v])
    elif form == "2BHND":
        kv = torch.stack([k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)]).contiguous()
    else:
        kv = torch.stack([k, v], dim=1)
    layout, view = _found(kv)
    assert layout.form == "split"
    _expect(view, k, v)


def test_writes_through_the_view_land_in_vllms_tensor():
    kv = torch.zeros(B, H, N, 2 * D)
    _, view = _found(kv, ROWS)
    view[3, 1, 5, 2] = 7.0  # block 3, V, token 5, head 2
    assert kv.view(B, H, 2 * N, D)[3, 2, N + 5].eq(7.0).all()
    assert int(kv.ne(0).sum()) == D


@pytest.mark.parametrize("shape, match", [
    ((B, H, N, 3 * D), "2 \\* head_dim"),
    ((B, H + 1, N, 2 * D), "middle axes"),
    ((B, 3, N, H, D), "K/V axis"),
    ((2, B, N, H, D + 1), "head_dim"),
    ((B, H * N * 2 * D), "neither"),
])
def test_unknown_shapes_are_refused_with_what_was_expected(shape, match):
    t = torch.zeros(shape)
    with pytest.raises(LayoutError, match=match):
        find_layout(t.shape, t.stride(), num_kv_heads=H, head_dim=D, block_size=N)


def test_rows_split_needs_mergeable_rows():
    """A [B, H, N, 2D] tensor whose token rows are not 2D apart cannot be CPU_ATTN's."""
    t = torch.zeros(B, N, H, 2 * D).permute(0, 2, 1, 3)  # HND logical, NHD physical
    with pytest.raises(LayoutError, match="rows"):
        find_layout(t.shape, t.stride(), num_kv_heads=H, head_dim=D, block_size=N, fused_split=ROWS)
    find_layout(t.shape, t.stride(), num_kv_heads=H, head_dim=D, block_size=N, fused_split=COLUMNS)


def test_backend_names_choose_the_split():
    assert split_for_backend("CPU_ATTN") == ROWS
    assert split_for_backend("FLASH_ATTN") == COLUMNS


def test_blocks_round_trip_between_vllm_tensors_and_a_pool():
    """save_blocks then load_blocks into other vLLM blocks gives the same K/V, every layer."""
    layers, slots = 3, 5
    tensors = [torch.zeros(B, H, N, 2 * D) for _ in range(layers)]
    views = [_found(t, ROWS)[1] for t in tensors]
    for i, view in enumerate(views):
        k, v = _kv(10 + i)
        view[:, 0], view[:, 1] = k, v
    pool = torch.zeros(slots, layers, 2, N, H, D)
    save_blocks(pool, views, [1, 4], [3, 0])
    for i, view in enumerate(views):
        torch.testing.assert_close(pool[3, i], view[1], rtol=0, atol=0)
        torch.testing.assert_close(pool[0, i], view[4], rtol=0, atol=0)
    assert pool[[1, 2, 4]].eq(0).all()
    before = [t.clone() for t in tensors]
    load_blocks(pool, views, [6, 2], [3, 0])
    for i, view in enumerate(views):
        torch.testing.assert_close(view[6], view[1], rtol=0, atol=0)
        torch.testing.assert_close(view[2], view[4], rtol=0, atol=0)
        untouched = [b for b in range(B) if b not in (6, 2)]
        assert torch.equal(tensors[i][untouched], before[i][untouched])


def test_block_copies_refuse_a_pool_of_another_shape():
    views = [_found(torch.zeros(B, H, N, 2 * D), ROWS)[1]]
    with pytest.raises(ValueError, match="pool block"):
        save_blocks(torch.zeros(2, 1, 2, N, H, D + 1), views, [0], [0])
    with pytest.raises(ValueError, match="slots"):
        load_blocks(torch.zeros(2, 1, 2, N, H, D), views, [0, 1], [0])


def test_runs_pair_blocks_consecutive_on_both_sides():
    from prefixd.client.vllm.block_transfer import runs

    assert runs([4, 5, 6, 9, 10], [20, 21, 30, 31, 32]) == [(4, 20, 2), (6, 30, 1), (9, 31, 2)]
    assert runs([], []) == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_block_copies_are_bit_exact_for_every_dtype_and_split(dtype):
    """The copies go through numpy (which has no bfloat16): every dtype, both fused splits,
    round-trips bit for bit, NaN payloads included."""
    for split in (ROWS, COLUMNS):
        src, dst = torch.randn(B, H, N, 2 * D).to(dtype), torch.zeros(B, H, N, 2 * D, dtype=dtype)
        src.view(-1)[:7] = float("nan")
        (s_view,), (d_view,) = [_found(src, split)[1]], [_found(dst, split)[1]]
        pool = torch.zeros(4, 1, 2, N, H, D, dtype=dtype)
        save_blocks(pool, [s_view], [2, 0], [1, 3])
        load_blocks(pool, [d_view], [2, 0], [1, 3])
        as_int = torch.int16 if dtype != torch.float32 else torch.int32
        assert torch.equal(d_view[[2, 0]].contiguous().view(as_int), s_view[[2, 0]].contiguous().view(as_int))


def test_block_copies_stay_off_torchs_thread_team(monkeypatch):
    """Regression (issue 14 follow-up, TTFT): the copies were torch ``copy_``s, which torch
    splits over its OpenMP team; on a loaded host the team's barriers made loading 8 SmolLM2
    blocks ~4x slower than one thread (184 vs 41 ms), paid in full by an external hit's TTFT."""
    def no_torch_copy(self, *args, **kwargs):
        raise AssertionError("a block copy went through torch's copy_")

    monkeypatch.setattr(torch.Tensor, "copy_", no_torch_copy)
    views = [_found(torch.randn(B, H, N, 2 * D), ROWS)[1]]
    pool = torch.zeros(2, 1, 2, N, H, D)
    save_blocks(pool, views, [3], [1])
    load_blocks(pool, views, [5], [1])
    assert torch.equal(views[0][5], views[0][3])


def test_a_large_transfer_is_split_over_threads_and_stays_bit_exact(monkeypatch):
    """TTFT (issue 14): the transposing copy runs at half of memcpy's speed on one core, and an
    external hit paid ~20 ms of it on the TTFT; a transfer over ``SPLIT_BYTES`` is split by
    layer over the caller's thread and helpers. Every layer lands, on more than one thread."""
    from prefixd.client.vllm import block_transfer

    monkeypatch.setattr(block_transfer, "COPY_THREADS", 3)
    monkeypatch.setattr(block_transfer, "SPLIT_BYTES", 0)
    threads = set()
    real = block_transfer._copy_all

    def recording(pairs):
        if pairs:
            threads.add(threading.get_ident())
        real(pairs)

    monkeypatch.setattr(block_transfer, "_copy_all", recording)
    layers = 5
    src = [torch.randn(B, H, N, 2 * D) for _ in range(layers)]
    dst = [torch.zeros(B, H, N, 2 * D) for _ in range(layers)]
    s_views, d_views = [_found(t)[1] for t in src], [_found(t)[1] for t in dst]
    pool = torch.zeros(6, layers, 2, N, H, D)
    save_blocks(pool, s_views, [1, 2, 6], [4, 5, 0])
    load_blocks(pool, d_views, [0, 3, 4], [4, 5, 0])
    for s, d in zip(s_views, d_views):
        assert torch.equal(d[[0, 3, 4]], s[[1, 2, 6]])
    assert len(threads) > 1, "the transfer ran on one thread"


def test_a_failed_share_fails_the_transfer_after_every_share_is_done(monkeypatch):
    """A helper's error reaches the caller, and only once every share has stopped (a caller
    that went on while a helper still copied could hand vLLM half-written blocks)."""
    from prefixd.client.vllm import block_transfer

    monkeypatch.setattr(block_transfer, "COPY_THREADS", 2)
    monkeypatch.setattr(block_transfer, "SPLIT_BYTES", 0)
    done = []
    main = threading.get_ident()
    real = block_transfer._copy_all

    def failing_helper(pairs):
        if threading.get_ident() != main:
            time.sleep(0.2)
            done.append("helper")
            raise OSError("planted copy failure")
        real(pairs)
        done.append("main")

    monkeypatch.setattr(block_transfer, "_copy_all", failing_helper)
    views = [_found(torch.randn(B, H, N, 2 * D))[1] for _ in range(2)]
    with pytest.raises(OSError, match="planted"):
        load_blocks(torch.zeros(4, 2, 2, N, H, D), views, [0, 1], [2, 3])
    assert sorted(done) == ["helper", "main"]
