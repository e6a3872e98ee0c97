"""Mapping a real pool file (made by prefixd.storage, as the daemon makes it) and the mapped
KV path, with no daemon."""

import os

import pytest
import torch
from torch.overrides import TorchFunctionMode

import prefixd.client as pc
from prefixd.api import prefixd_pb2 as pb
from prefixd.api.layout import KVLayout
from prefixd.client.handles import Sequence
from prefixd.client.mapped import map_pool
from prefixd.client.wire import pack_tokens
from prefixd.kernels import layer_kv, reference
from prefixd.storage.extent_slots import ExtentSlotAllocator
from prefixd.storage.extents import EXTENT_BYTES
from prefixd.storage.pools import TensorPool
from tests.storage.proc_maps import need_populate, resident_bytes

LAYOUT = KVLayout("mapped-test", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_size=4)
NUM_BLOCKS = 32
BIG_BLOCKS = 5 * EXTENT_BYTES // LAYOUT.block_bytes  # five extents


@pytest.fixture
def daemon_pool(tmp_path):
    p = TensorPool(LAYOUT, 0, NUM_BLOCKS, path=str(tmp_path / "device.pool"), fresh=True)
    yield p
    p.close()


def descriptor(p: TensorPool, **change) -> pb.PoolDescriptor:
    d = p.descriptor()
    fields = dict(tier="device", path=d["path"], offset=d["offset"], shape=d["shape"], strides=d["strides"],
                  dtype=d["dtype"], file_id=d["file_id"])
    fields.update(change)
    return pb.PoolDescriptor(**fields)


def seq(block_table, num_tokens, num_indexed=0) -> Sequence:
    return Sequence(pb.SequenceReply(seq_id=1, num_tokens=num_tokens, block_table=pack_tokens(block_table),
                                     num_indexed=num_indexed))


def kv(n, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((LAYOUT.num_layers, 2, n, LAYOUT.num_kv_heads, LAYOUT.head_dim), generator=g)


def test_a_mapped_pool_aliases_the_daemons_memory_both_ways(daemon_pool):
    mapped = map_pool(descriptor(daemon_pool), LAYOUT)
    assert mapped.tensor.shape == daemon_pool.tensor.shape and mapped.tensor.stride() == daemon_pool.tensor.stride()
    daemon_pool.tensor[3].fill_(7.0)
    assert torch.equal(mapped.tensor[3], daemon_pool.tensor[3])
    mapped.tensor[5].fill_(-2.0)
    assert torch.equal(daemon_pool.tensor[5], torch.full_like(daemon_pool.tensor[5], -2.0))


def test_the_client_maps_the_held_extents_populated_and_not_the_hole(tmp_path):
    """A mapped store never pays a page fault per 4 KB on its first touch of a held extent:
    the client's mapping is populated where the daemon's file holds pages, and only there
    (the rest of the sparse file is a hole that populating would allocate). Counted apart
    from the daemon's own mapping (both are this process's here): the client's adds every
    held page again."""
    need_populate()
    pool = TensorPool(LAYOUT, 0, BIG_BLOCKS, path=str(tmp_path / "device.pool"), fresh=True)
    try:
        alloc = ExtentSlotAllocator(pool.sparse, recovered=True)
        alloc.allocate(3 * EXTENT_BYTES // LAYOUT.block_bytes)  # extents 0..3 held, of 5
        held = pool.sparse.charged
        before = resident_bytes(pool.path)
        mapped = map_pool(descriptor(pool), LAYOUT)
        added = resident_bytes(pool.path) - before
        assert held == 4 * EXTENT_BYTES and added >= held
        assert added < 5 * EXTENT_BYTES
        del mapped
    finally:
        pool.close()


def test_a_client_reads_and_writes_a_slot_of_an_extent_grown_after_it_mapped(tmp_path):
    pool = TensorPool(LAYOUT, 0, BIG_BLOCKS, path=str(tmp_path / "device.pool"), fresh=True)
    try:
        alloc = ExtentSlotAllocator(pool.sparse, recovered=True)
        mapped = map_pool(descriptor(pool), LAYOUT)
        before = os.stat(pool.path).st_blocks
        slots = alloc.allocate(3 * EXTENT_BYTES // LAYOUT.block_bytes)
        assert os.stat(pool.path).st_blocks > before  # extents grown after the mapping
        last = slots[-1]
        assert alloc.extent_of(last) >= 2
        pool.tensor[last].copy_(torch.arange(pool.tensor[last].numel(), dtype=torch.float32).view_as(pool.tensor[last]))
        assert torch.equal(mapped.tensor[last], pool.tensor[last])
        mapped.tensor[last - 1].fill_(3.5)
        assert torch.equal(pool.tensor[last - 1], torch.full_like(pool.tensor[last - 1], 3.5))
        del mapped
    finally:
        pool.close()


def test_mapped_write_and_read_go_through_the_block_table(daemon_pool):
    mapped = map_pool(descriptor(daemon_pool), LAYOUT)
    s = seq([9, 4, 17], 11)
    x = kv(11)
    mapped.write(s, 0, x)
    assert torch.equal(mapped.read(s, 0, 11), x)
    assert torch.equal(daemon_pool.tensor[4, :, :, 2], x[:, :, 6]), "token 6 is row 2 of block 1 (slot 4)"


def test_a_mapped_write_to_a_committed_block_is_refused_and_writes_nothing(daemon_pool):
    """Bug it guards: a mapped client storing into an indexed block changes KV other prompts hit."""
    mapped = map_pool(descriptor(daemon_pool), LAYOUT)
    s = seq([9, 4, 17], 11, num_indexed=2)
    before = daemon_pool.tensor.clone()
    with pytest.raises(pc.SharedBlockError, match="committed"):
        mapped.write(s, 6, kv(5))
    assert torch.equal(daemon_pool.tensor, before)
    mapped.write(s, 8, kv(3))  # block 2 is private
    assert not torch.equal(daemon_pool.tensor[17], before[17])


def test_a_file_replaced_under_the_path_is_refused(daemon_pool):
    with pytest.raises(pc.MappingError, match="replaced"):
        map_pool(descriptor(daemon_pool, file_id=b"\x01" * 16), LAYOUT)


def test_a_missing_file_is_a_mapping_error_not_a_crash(daemon_pool, tmp_path):
    with pytest.raises(pc.MappingError, match="cannot open"):
        map_pool(descriptor(daemon_pool, path=str(tmp_path / "gone.pool")), LAYOUT)


def test_a_file_shorter_than_the_pool_is_refused(daemon_pool, tmp_path):
    short = tmp_path / "short.pool"
    with open(daemon_pool.path, "rb") as f:
        short.write_bytes(f.read(4096 + LAYOUT.block_bytes))
    with pytest.raises(pc.MappingError, match="too short"):
        map_pool(descriptor(daemon_pool, path=str(short)), LAYOUT)


def test_a_file_that_is_not_a_pool_is_refused(tmp_path, daemon_pool):
    other = tmp_path / "other"
    other.write_bytes(os.urandom(8192))
    with pytest.raises(pc.MappingError, match="magic"):
        map_pool(descriptor(daemon_pool, path=str(other)), LAYOUT)


def test_a_descriptor_of_another_layout_is_refused(daemon_pool):
    other = KVLayout("mapped-test", num_layers=3, num_kv_heads=2, head_dim=8, dtype="float32", block_size=4)
    with pytest.raises(pc.MappingError, match="layout"):
        map_pool(descriptor(daemon_pool), other)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a host without CUDA")
def test_a_cuda_handle_without_cuda_is_a_mapping_error(daemon_pool):
    with pytest.raises(pc.MappingError, match="CUDA"):
        map_pool(descriptor(daemon_pool, path="", cuda_ipc=b"not-a-handle"), LAYOUT)


def _reference(pool_tensor, seqs, q, loc=None):
    k, v = layer_kv(pool_tensor, 1)
    width = max(len(s.block_table) for s in seqs)
    tables = torch.zeros((len(seqs), width), dtype=torch.int32)
    for i, s in enumerate(seqs):
        tables[i, :len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.int32)
    lens = torch.tensor([s.num_tokens for s in seqs], dtype=torch.int32)
    if loc is None:
        return reference.paged_decode_reference(q, k, v, tables, lens)
    return reference.paged_extend_reference(q, k, v, tables, lens, torch.tensor(loc, dtype=torch.int32))


def test_mapped_attend_writes_new_kv_then_matches_the_reference(daemon_pool):
    mapped = map_pool(descriptor(daemon_pool), LAYOUT)
    a, b = seq([1, 2, 3], 10), seq([8, 5], 7)
    mapped.write(a, 0, kv(10, 1))
    mapped.write(b, 0, kv(7, 2))
    q = torch.randn(2, 4, LAYOUT.head_dim)
    new_k, new_v = torch.randn(2, 2, LAYOUT.head_dim), torch.randn(2, 2, LAYOUT.head_dim)
    out = mapped.attend([a, b], q, layer=1, new_k=new_k, new_v=new_v, query_start_loc=None, scale=None)
    k, _ = layer_kv(daemon_pool.tensor, 1)
    assert torch.equal(k[3, 1], new_k[0]) and torch.equal(k[5, 2], new_k[1]), "last tokens 9 and 6"
    torch.testing.assert_close(out, _reference(daemon_pool.tensor, [a, b], q))
    q2 = torch.randn(5, 4, LAYOUT.head_dim)
    out2 = mapped.attend([a, b], q2, layer=1, new_k=None, new_v=None, query_start_loc=[0, 3, 5], scale=None)
    torch.testing.assert_close(out2, _reference(daemon_pool.tensor, [a, b], q2, [0, 3, 5]))


class _TorchCalls(TorchFunctionMode):
    """Counts the torch functions, methods and attribute reads made while it is entered."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.append(getattr(func, "__name__", repr(func)))
        return func(*args, **(kwargs or {}))


def test_a_mapped_cpu_write_and_read_make_a_handful_of_torch_calls(daemon_pool):
    """Regression (kv.mapped_gbps): the mapped path made ~30 torch calls a write and ~24 a
    read (views per run, a numpy view per side of each copy), each tens of microseconds on
    cold caches; it now works on the pool's numpy view (token_io's NOTE)."""
    mapped = map_pool(descriptor(daemon_pool), LAYOUT)
    s = seq([9, 10, 11, 4, 5], 5 * LAYOUT.block_size)
    x = kv(5 * LAYOUT.block_size - 2, seed=4)
    with _TorchCalls() as writes:
        mapped.write(s, 1, x)
    with _TorchCalls() as reads:
        got = mapped.read(s, 1, x.shape[2])
    assert torch.equal(got, x)
    assert len(writes.calls) <= 6, writes.calls
    assert len(reads.calls) <= 2, reads.calls


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_a_mapped_pool_of_a_dtype_numpy_lacks_round_trips_bit_exact(tmp_path, dtype):
    """The mapped CPU path moves such dtypes as integers of their size, reads included
    (``new_cpu_tensor`` allocates through numpy)."""
    layout = KVLayout("mapped-bits", num_layers=2, num_kv_heads=2, head_dim=8, dtype=dtype, block_size=4)
    p = TensorPool(layout, 0, NUM_BLOCKS, path=str(tmp_path / "device.pool"), fresh=True)
    try:
        d = p.descriptor()
        desc = pb.PoolDescriptor(tier="device", path=d["path"], offset=d["offset"], shape=d["shape"],
                                 strides=d["strides"], dtype=d["dtype"], file_id=d["file_id"])
        mapped = map_pool(desc, layout)
        s = seq([3, 7, 8], 12)
        size = getattr(torch, dtype).itemsize
        bits = torch.randint(0, 256, (2, 2, 10, 2, 8 * size), dtype=torch.uint8,
                             generator=torch.Generator().manual_seed(1))
        x = bits.view(getattr(torch, dtype))
        mapped.write(s, 2, x)
        got = mapped.read(s, 2, 10)
        assert got.dtype == x.dtype and torch.equal(got.view(torch.uint8), bits)
        out = torch.zeros_like(x)
        assert mapped.read(s, 2, 10, out) is out and torch.equal(out.view(torch.uint8), bits)
    finally:
        p.close()


def test_a_mapped_write_of_a_tensor_that_requires_grad_keeps_no_graph(daemon_pool):
    mapped = map_pool(descriptor(daemon_pool), LAYOUT)
    s = seq([2, 3], 8)
    x = kv(8, seed=2).requires_grad_()
    mapped.write(s, 0, x)
    got = mapped.read(s, 0, 8)
    assert torch.equal(got, x.detach()) and not got.requires_grad
    assert not mapped.tensor.requires_grad
