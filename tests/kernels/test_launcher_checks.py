"""Every launcher refuses bad input with a ValueError that names the problem.

These checks read only metadata, so they run the same for the Triton launchers and the
references; the launchers raise before any kernel runs.
"""

import pytest
import torch

from prefixd.kernels import layer_kv, paged_attention
from prefixd.kernels.block_copy import copy_blocks
from prefixd.kernels.decode import paged_decode
from prefixd.kernels.extend import paged_extend
from prefixd.kernels.kv_write import write_kv
from tests.kernels.paged_factories import make_decode_batch


def _decode_args(**over):
    q, k, v, tables, lens = make_decode_batch(
        [20, 5], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=torch.float16, device="cpu",
    )
    args = dict(query=q, k_cache=k, v_cache=v, block_tables=tables, seq_lens=lens)
    args.update(over)
    return args


def _q():
    return _decode_args()["query"]


def _k():
    return _decode_args()["k_cache"]


DECODE_BAD = [
    ("query_2d", dict(query=torch.zeros(2, 256, dtype=torch.float16)), "query must be"),
    ("query_int", dict(query=torch.zeros(2, 4, 64, dtype=torch.int32)), "query dtype"),
    ("query_strided", dict(query=torch.zeros(2, 4, 128, dtype=torch.float16)[..., ::2]),
     "query must be contiguous in head_dim"),
    ("cache_3d", dict(k_cache=torch.zeros(4, 16, 64, dtype=torch.float16)), "k_cache must be"),
    ("cache_dtype", dict(v_cache=torch.zeros(5, 16, 2, 64)), "v_cache has dtype"),
    ("cache_strided", dict(k_cache=torch.zeros(5, 16, 2, 128, dtype=torch.float16)[..., ::2]),
     "k_cache must be contiguous"),
    ("cache_shapes", dict(v_cache=torch.zeros(9, 16, 2, 64, dtype=torch.float16)), "differ"),
    ("head_dim", dict(query=torch.zeros(2, 4, 32, dtype=torch.float16)), "head_dim 32 !="),
    ("gqa", dict(query=torch.zeros(2, 3, 64, dtype=torch.float16)), "multiple of num_kv_heads"),
    ("tables_1d", dict(block_tables=torch.zeros(2, dtype=torch.int32)), "block_tables must be 2-D"),
    ("tables_float", dict(block_tables=torch.zeros(2, 3)), "block_tables must be int32"),
    ("tables_strided", dict(block_tables=torch.zeros(2, 6, dtype=torch.int32)[:, ::2]),
     "block_tables must be contiguous"),
    ("lens_count", dict(seq_lens=torch.ones(3, dtype=torch.int32)), "seq_lens has 3 entries"),
    ("lens_2d", dict(seq_lens=torch.ones(2, 1, dtype=torch.int32)), "seq_lens must be 1-D"),
    ("one_query_each", dict(query=torch.zeros(3, 4, 64, dtype=torch.float16)),
     "one query per sequence"),
    ("out_shape", dict(out=torch.zeros(2, 4, 32, dtype=torch.float16)), "out must match"),
    ("out_strided", dict(out=torch.zeros(2, 4, 128, dtype=torch.float16)[..., ::2]),
     "out must be contiguous"),
    ("not_a_tensor", dict(seq_lens=[20, 5]), "seq_lens must be a tensor"),
]


@pytest.mark.parametrize("launcher", [paged_decode, paged_attention], ids=["triton", "entry"])
@pytest.mark.parametrize("name,over,error", DECODE_BAD, ids=[c[0] for c in DECODE_BAD])
def test_decode_launcher_rejects_bad_input(launcher, name, over, error):
    with pytest.raises(ValueError, match=error):
        launcher(**_decode_args(**over))


def test_decode_launcher_rejects_head_dim_over_256():
    q, k, v, tables, lens = make_decode_batch(
        [3], num_q_heads=1, num_kv_heads=1, head_dim=320, block_size=16, dtype=torch.float16,
        device="cpu",
    )
    with pytest.raises(ValueError, match="head_dim 320 > 256"):
        paged_decode(q, k, v, tables, lens)


def test_decode_launcher_rejects_zero_splits():
    with pytest.raises(ValueError, match="num_splits must be >= 1"):
        paged_decode(**_decode_args(), num_splits=0)


def test_compiled_kernels_refuse_cpu_tensors_when_not_interpreting(monkeypatch):
    monkeypatch.setattr("prefixd.kernels.launch.interpreter_active", lambda: False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        paged_decode(**_decode_args())


@pytest.mark.parametrize(
    "starts,error",
    [(torch.tensor([0, 2], dtype=torch.int32), "num_seqs \\+ 1 = 3"),
     (torch.tensor([0.0, 1.0, 2.0]), "query_start_loc must be int32"),
     (torch.tensor([[0, 1, 2]], dtype=torch.int32), "query_start_loc must be 1-D")],
)
def test_extend_launcher_rejects_bad_query_start_loc(starts, error):
    args = _decode_args()
    with pytest.raises(ValueError, match=error):
        paged_extend(**args, query_start_loc=starts)


def test_extend_launcher_rejects_head_dim_over_256():
    q, k, v, tables, lens = make_decode_batch(
        [3], num_q_heads=1, num_kv_heads=1, head_dim=272, block_size=16, dtype=torch.float16,
        device="cpu",
    )
    with pytest.raises(ValueError, match="head_dim 272 > 256"):
        paged_extend(q, k, v, tables, lens, torch.tensor([0, 1], dtype=torch.int32))


def _kv_args(**over):
    k_cache, v_cache = layer_kv(torch.zeros(4, 2, 2, 16, 2, 64, dtype=torch.float16), 1)
    args = dict(key=torch.zeros(3, 2, 64, dtype=torch.float16),
                value=torch.zeros(3, 2, 64, dtype=torch.float16),
                k_cache=k_cache, v_cache=v_cache, slot_mapping=torch.arange(3))
    args.update(over)
    return args


KV_BAD = [
    ("key_2d", dict(key=torch.zeros(3, 128, dtype=torch.float16)), "key must be"),
    ("value_strided", dict(value=torch.zeros(3, 2, 128, dtype=torch.float16)[..., ::2]),
     "value must be contiguous"),
    ("shapes", dict(value=torch.zeros(4, 2, 64, dtype=torch.float16)), "differ"),
    ("dtypes", dict(value=torch.zeros(3, 2, 64)), "dtypes must match"),
    ("int_dtype", dict(key=torch.zeros(3, 2, 64, dtype=torch.int16),
                       value=torch.zeros(3, 2, 64, dtype=torch.int16)), "dtypes must match"),
    ("cache_dtype", dict(k_cache=torch.zeros(4, 16, 2, 64)), "k_cache has dtype"),
    ("heads", dict(key=torch.zeros(3, 1, 64, dtype=torch.float16),
                   value=torch.zeros(3, 1, 64, dtype=torch.float16)), "key heads/head_dim"),
    ("slots_float", dict(slot_mapping=torch.zeros(3)), "slot_mapping must be int32"),
    ("slots_count", dict(slot_mapping=torch.arange(4)), "slot_mapping has 4 entries"),
]


@pytest.mark.parametrize("name,over,error", KV_BAD, ids=[c[0] for c in KV_BAD])
def test_write_kv_launcher_rejects_bad_input(name, over, error):
    with pytest.raises(ValueError, match=error):
        write_kv(**_kv_args(**over))


COPY_BAD = [
    ("src_not_block_major", dict(src=torch.zeros(4, 8, 2)[:, :, 0]), "one contiguous chunk"),
    ("src_1d", dict(src=torch.zeros(4)), "src must be a pool"),
    ("block_shape", dict(dst=torch.zeros(4, 9)), "block shapes differ"),
    ("dtype", dict(dst=torch.zeros(4, 8, dtype=torch.float16)), "src dtype"),
    ("slots_dtype", dict(src_slots=torch.zeros(2)), "src_slots must be int32"),
    ("slots_len", dict(dst_slots=torch.arange(3)), "src_slots has 2 entries, dst_slots 3"),
]


@pytest.mark.parametrize("name,over,error", COPY_BAD, ids=[c[0] for c in COPY_BAD])
def test_copy_blocks_launcher_rejects_bad_input(name, over, error):
    args = dict(src=torch.zeros(4, 8), dst=torch.zeros(4, 8), src_slots=torch.arange(2),
                dst_slots=torch.arange(2))
    args.update(over)
    with pytest.raises(ValueError, match=error):
        copy_blocks(**args)


def test_layer_kv_rejects_a_pool_of_the_wrong_shape_and_a_bad_layer():
    with pytest.raises(ValueError, match="pool must be"):
        layer_kv(torch.zeros(4, 2, 3, 16, 2, 8), 0)
    with pytest.raises(ValueError, match="layer 2 out of range"):
        layer_kv(torch.zeros(4, 2, 2, 16, 2, 8), 2)


def test_entry_point_rejects_an_unknown_backend():
    with pytest.raises(ValueError, match="backend must be one of"):
        paged_attention(**_decode_args(), backend="cuda")
