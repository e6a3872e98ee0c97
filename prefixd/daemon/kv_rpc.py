"""The KV data path over RPC: ``WriteKV``, ``ReadKV`` and ``Attend`` (DESIGN.md "The API").
The pool descriptors a client maps instead are ``prefixd.daemon.pool_descriptors``.

For clients that cannot map the pools (another user, a container), KV travels through the
socket as ``KVChunk`` messages: the KV of tokens ``start .. start + num_tokens`` of one
sequence, ``[num_layers, 2, num_tokens, num_kv_heads, head_dim]`` in the layout's dtype. The
servicer (``prefixd.daemon.service``) resolves the session and calls these plain functions on
the event-loop thread, which owns the engine; they raise ``RpcFailure`` (``prefixd.daemon.status``)
for every refusal, and let the engine's typed errors through for ``status_of``.

What the checks guarantee: through these rpcs a client writes only tokens of a sequence its
session owns, within the sequence's length, and only in blocks private to that sequence (the
engine's rules, ``prefixd.engine.kv_io.PoolKV``: never an indexed block, which other prompts may
be reading, never the partial last block it still shares with forked siblings). A refusal
writes nothing of the refused chunk, so it never changes the pool's shared blocks or the index.
This module checks what is the rpc's own (the session, the message's fields and size) and
reaches the pool's KV only through ``session.pool.kv``.

NOTE (a stream is checked chunk by chunk): each ``WriteKV`` chunk is checked, then written,
as it arrives: a stream can be far larger than memory is willing to buffer, and the loop
serves other calls between chunks (so a sequence may be released or extended in between;
checking at the time of writing is the only check that holds). Consequently a refused chunk
leaves the stream's earlier chunks written; the refusal's message says how many tokens were.
A client that wants all or nothing sends one chunk (``max_message_bytes`` allows it) or
rewrites the range after fixing the cause: a write to private blocks is idempotent.

NOTE (Attend's kernel leaves the loop): ``prepare_attend`` checks, writes the new K/V and
builds the arguments on the loop, and returns the kernel as an ``AttendJob`` the servicer runs
in parts on its compute threads (``DaemonCore.compute``; ``attend`` runs it inline, for tests).
On a GPU the launch is asynchronous and the wait is the output's copy to the host; on a CPU
pool the reference kernel does the work: ~70 ms for a decode step of 16 sequences x 2k
tokens of a tiny layout (4 layers, 2 KV heads, head_dim 64, float16) on two cores, against
~1 ms of checks, tables and encoding around it -- long enough that the loop should not wait
for it.
"""

from __future__ import annotations

import logging
import math
from typing import AsyncIterator, Iterator

import torch

from prefixd.api import prefixd_pb2 as pb
from prefixd.api.kv_frames import KVFrame, framed_kv_to_fill
from prefixd.api.tensors import tensor_from_bytes
from prefixd.engine import kv_io
from prefixd.engine.errors import SharedBlockError
from prefixd.kernels import layer_kv, write_kv as write_layer_kv
from prefixd.daemon.attend_job import AttendJob
from prefixd.daemon.status import RpcFailure, exhausted, invalid, not_found, precondition

log = logging.getLogger(__name__)

# Bytes a reply spends on fields other than the KV bytes (ids, shape, dtype, framing); a
# chunk's data is kept to ``max_bytes - MESSAGE_OVERHEAD`` so the whole message fits.
MESSAGE_OVERHEAD = 256


# -- checks shared by every rpc of the data path -----------------------------------------------

def live(session) -> None:
    """Raises NOT_FOUND if ``session`` ended (a stream can outlive it: lease, Detach)."""
    if session.ended:
        raise not_found(f"session {session.id:#x} ended while the call was running (lease "
                        f"expired or Detach): Attach again")


def owned_sequence(session, seq_id: int):
    """The live sequence ``seq_id`` of ``session`` (NOT_FOUND unless the session owns it)."""
    session.owns(seq_id)
    return session.pool.sequence(seq_id)


def check_range(seq, start: int, n: int) -> None:
    """INVALID_ARGUMENT unless tokens ``start .. start + n`` lie within ``seq`` (the engine's
    rule, ``kv_io.check_range``)."""
    try:
        kv_io.check_range(seq, start, n)
    except ValueError as exc:
        raise invalid(str(exc)) from None


def check_private(pool, seq, start: int, n: int) -> None:
    """FAILED_PRECONDITION unless every block that tokens ``start .. start + n`` touch is
    private to ``seq`` (the engine's rule, ``PoolKV.check_writable``)."""
    try:
        pool.kv.check_writable(seq, start, n)
    except SharedBlockError as exc:
        raise precondition(str(exc)) from None


def token_bytes(layout) -> int:
    """Bytes of one token's KV across all layers: ``num_layers * 2 * num_kv_heads * head_dim *
    itemsize``."""
    return layout.num_layers * 2 * layout.num_kv_heads * layout.head_dim * layout.itemsize


def tokens_per_chunk(layout, max_bytes: int) -> int:
    """How many whole tokens of KV one message of at most ``max_bytes`` carries (>= 1).

    Raises:
        RESOURCE_EXHAUSTED: not even one token fits (the message limit is set too low).
    """
    per_token = token_bytes(layout)
    room = max_bytes - MESSAGE_OVERHEAD
    if room < per_token:
        raise exhausted(f"one token's KV is {per_token} bytes, over the message limit of "
                        f"{max_bytes} bytes: raise the daemon's max_message_bytes")
    return room // per_token


# -- WriteKV -----------------------------------------------------------------------------------

def _chunk_kv(session, chunk: pb.KVChunk, data, max_bytes: int):
    """``(seq, kv)`` of a checked chunk whose KV bytes are ``data`` (its frame's: see
    ``prefixd.api.kv_frames``); raises ``RpcFailure`` for any bad field."""
    layout = session.layout
    seq = owned_sequence(session, chunk.seq_id)
    n = chunk.num_tokens
    want = [layout.num_layers, 2, n, layout.num_kv_heads, layout.head_dim]
    if list(chunk.shape) != want:
        raise invalid(f"chunk shape must be [num_layers, 2, num_tokens, num_kv_heads, head_dim] = "
                      f"{want} for {n} tokens of this session's layout, got {list(chunk.shape)}")
    if chunk.dtype != layout.dtype:
        raise invalid(f"chunk dtype must be the layout's {layout.dtype!r}, got {chunk.dtype!r}")
    if len(data) > max_bytes:  # a message gRPC let in is never refused for our overhead guess
        raise exhausted(f"a chunk of {len(data)} bytes is over the message limit of "
                        f"{max_bytes} bytes: send at most {tokens_per_chunk(layout, max_bytes)} "
                        f"tokens per chunk")
    try:
        kv = tensor_from_bytes(data, want, chunk.dtype)
    except ValueError as exc:
        raise invalid(f"chunk of sequence {chunk.seq_id}: {exc}") from None
    check_range(seq, chunk.start, n)
    check_private(session.pool, seq, chunk.start, n)
    return seq, kv


async def write_kv(session, requests: AsyncIterator[pb.WriteKVRequest], max_bytes: int) -> pb.WriteKVReply:
    """Write each chunk of a ``WriteKV`` stream into its sequence's private blocks.

    Args:
        session: the caller's ``Session`` (resolved from the stream's first request).
        requests: the whole stream, its first request included; every request must name
            ``session`` and carry a chunk (``KVFrame``s, as the daemon decodes them, or messages).
        max_bytes: the daemon's message limit (a chunk must fit in it).

    Returns:
        ``WriteKVReply`` with the tokens written (the sum of the chunks' ``num_tokens``).

    Raises:
        RpcFailure: NOT_FOUND (the session ended, or a sequence it does not own),
            INVALID_ARGUMENT (another session's id, no chunk, wrong shape, dtype or byte
            length, a range past the sequence's end), FAILED_PRECONDITION (a block the range
            touches is indexed or shared with forked siblings), RESOURCE_EXHAUSTED (a chunk
            over the message limit). Chunks before the refused one stay written (module NOTE).
    """
    written = 0
    async for request in requests:
        frame = KVFrame.of(request)
        request = frame.message
        try:
            live(session)
            if request.session_id != session.id:
                raise invalid(f"every request of a WriteKV stream must name session "
                              f"{session.id:#x}, got {request.session_id:#x}")
            if not request.HasField("chunk"):
                raise invalid("a WriteKV request must carry a chunk")
            seq, kv = _chunk_kv(session, request.chunk, frame.data, max_bytes)
        except RpcFailure as failure:
            if written:
                log.info("writekv chunk refused after a partial write session=%#x written=%d "
                         "code=%s", session.id, written, failure.code.name)
                failure = RpcFailure(failure.code, f"{failure.message} ({written} tokens of this "
                                                   f"stream's earlier chunks were written)")
            raise failure from None
        session.pool.write_kv(seq, request.chunk.start, kv)
        written += request.chunk.num_tokens
    return pb.WriteKVReply(written_tokens=written)


# -- ReadKV ------------------------------------------------------------------------------------

def read_kv(session, request: pb.ReadKVRequest, max_bytes: int) -> Iterator[bytes]:
    """The KV of a token range as a stream of encoded ``ReadKVReply`` messages, each under
    ``max_bytes``.

    The request is checked now (raising before any reply); the replies are read lazily,
    one chunk of whole tokens per ``next()``, each after checking again that the session
    still holds the sequence (the loop serves other calls while a reply is sent). Reading
    shared (indexed) blocks is fine. An empty range yields one chunk of 0 tokens.

    Raises:
        RpcFailure: NOT_FOUND (the session ended, or a sequence it does not own),
            INVALID_ARGUMENT (a range past the sequence's end), RESOURCE_EXHAUSTED (not one
            token's KV fits in ``max_bytes``).
    """
    live(session)
    seq = owned_sequence(session, request.seq_id)
    start, n = request.start, request.num_tokens
    check_range(seq, start, n)
    per = tokens_per_chunk(session.layout, max_bytes)
    return _read_chunks(session, seq.id, start, n, per)


_READ_REPLY_CHUNK = pb.ReadKVReply.DESCRIPTOR.fields_by_name["chunk"].number


def _read_chunks(session, seq_id: int, start: int, n: int, per: int) -> Iterator[bytes]:
    layout = session.layout
    pool_kv = session.pool.kv
    dtype = pool_kv.device_tensor.dtype
    end = start + n
    at = start
    while True:
        k = min(per, end - at)
        if at != start:
            live(session)
        seq = owned_sequence(session, seq_id)
        check_range(seq, at, k)
        # the KV gathered straight into an encoded ReadKVReply (handlers pass bytes on as they are)
        reply, kv = framed_kv_to_fill(b"", _READ_REPLY_CHUNK, seq_id, at, (
            layout.num_layers, 2, k, layout.num_kv_heads, layout.head_dim), dtype)
        pool_kv.read(seq, at, k, kv)
        del kv
        yield reply
        at += k
        if at >= end:
            return


# -- Attend ------------------------------------------------------------------------------------

def _tensor(msg: pb.Tensor, name: str, dtype: str, shape: list[int] | None = None):
    """The tensor of field ``name``, checked: the layout's ``dtype``, and ``shape`` if given."""
    if msg.dtype != dtype:
        raise invalid(f"{name} dtype must be the layout's {dtype!r}, got {msg.dtype!r}")
    if shape is not None and list(msg.shape) != shape:
        raise invalid(f"{name} shape must be {shape} ([num_tokens, num_kv_heads, head_dim], one "
                      f"row per query token), got {list(msg.shape)}")
    try:
        return tensor_from_bytes(msg.data, msg.shape, msg.dtype)
    except ValueError as exc:
        raise invalid(f"{name}: {exc}") from None


def _new_counts(request: pb.AttendRequest, seqs, num_rows: int) -> tuple[list[int], bool]:
    """New tokens per sequence (1 each for decode) and whether the call is an extend."""
    if not request.query_start_loc:
        if num_rows != len(seqs):
            raise invalid(f"decode takes one query row per sequence: {len(seqs)} sequences, "
                          f"query has {num_rows} rows (an extend sends query_start_loc)")
        return [1] * len(seqs), False
    loc = list(request.query_start_loc)
    if len(loc) != len(seqs) + 1 or loc[0] != 0 or loc[-1] != num_rows:
        raise invalid(f"query_start_loc must have num_seqs + 1 = {len(seqs) + 1} offsets from 0 "
                      f"to the query's {num_rows} rows, got {loc}")
    counts = [b - a for a, b in zip(loc, loc[1:])]
    if any(c < 0 for c in counts):
        raise invalid(f"query_start_loc must not decrease, got {loc}")
    return counts, True


def attend(session, request: pb.AttendRequest, max_bytes: int) -> pb.AttendReply:
    """``prepare_attend(...)()``: the whole call on the caller's thread."""
    return prepare_attend(session, request, max_bytes)()


def prepare_attend(session, request: pb.AttendRequest, max_bytes: int) -> AttendJob:
    """Paged attention over one layer of the session's device pool for a batch of sequences:
    checks, writes the new K/V and builds the kernel's arguments now (on the loop), and returns
    the rest (the kernel and the reply's encoding), which may run on a worker thread.

    Decode (no ``query_start_loc``): ``query`` is ``[num_seqs, num_q_heads, head_dim]``, the
    last token of each sequence. Extend: ``query`` packs each sequence's last ``n_b`` tokens,
    located by ``query_start_loc``. With ``new_k``/``new_v`` (``[num_rows, num_kv_heads,
    head_dim]``) the K/V of those tokens are written into layer ``request.layer`` first, at
    positions ``seq_len - n_b .. seq_len`` of each sequence; those blocks must be private.

    Everything is checked before anything is written: a refused call changes nothing.

    NOTE (the kernel off the loop): the returned computation only reads the pool, so running
    it on a thread cannot corrupt anything; its output is right as long as the client holds
    its sequences until the reply (one that releases a sequence mid-call may read slots
    reused within its own tenant's pool, which a mapped client can read anyway).

    Returns:
        The kernel's work (``attend_job.AttendJob``): called, it returns the ``AttendReply``,
        whose ``output`` is shaped like ``query``, in the layout's dtype; the servicer runs it
        in parts on its compute threads.

    Raises:
        RpcFailure: NOT_FOUND (session ended, a sequence it does not own); INVALID_ARGUMENT
            (no or repeated sequences, a layer out of range, a query or new K/V of the
            wrong dtype / shape / byte length, q heads not a multiple of the KV heads, bad
            ``query_start_loc``, more new tokens than a sequence has, a bad scale, a float8
            layout); FAILED_PRECONDITION (new K/V into a shared block); RESOURCE_EXHAUSTED
            (the output would not fit in ``max_bytes``).
    """
    live(session)
    layout, pool = session.layout, session.pool
    if layout.dtype not in ("float16", "bfloat16", "float32"):
        raise invalid(f"Attend runs over float16, bfloat16 or float32 pools; this layout is "
                      f"{layout.dtype}: compute attention in the client")
    seq_ids = list(request.seq_ids)
    if not seq_ids:
        raise invalid("Attend needs at least one sequence in seq_ids")
    if len(set(seq_ids)) != len(seq_ids):
        raise invalid(f"seq_ids lists a sequence twice: {seq_ids}; attend each once")
    seqs = [owned_sequence(session, s) for s in seq_ids]
    if request.layer >= layout.num_layers:
        raise invalid(f"layer {request.layer} is out of range: the layout has "
                      f"{layout.num_layers} layers (0..{layout.num_layers - 1})")
    if not request.HasField("query"):
        raise invalid("Attend needs a query tensor")
    q = _tensor(request.query, "query", layout.dtype)
    if q.dim() != 3 or q.shape[2] != layout.head_dim or not q.shape[1] \
            or q.shape[1] % layout.num_kv_heads:
        raise invalid(f"query must be [rows, num_q_heads, head_dim={layout.head_dim}] with "
                      f"num_q_heads a multiple of num_kv_heads={layout.num_kv_heads}, got "
                      f"{list(q.shape)}")
    out_bytes = q.numel() * q.element_size()
    if out_bytes + MESSAGE_OVERHEAD > max_bytes:
        raise exhausted(f"the output ({out_bytes} bytes, like the query) would not "
                        f"fit in the message limit of {max_bytes} bytes: split the batch")
    counts, extend = _new_counts(request, seqs, q.shape[0])
    if not q.shape[0]:
        raise invalid("an extend needs at least one query row (query_start_loc ends at 0)")
    for seq, n in zip(seqs, counts):
        if n > seq.num_tokens:
            raise invalid(f"sequence {seq.id} has {seq.num_tokens} tokens, fewer than its {n} "
                          f"query rows: Extend it with the new tokens first")
    scale = request.scale or None
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        raise invalid(f"scale must be a finite number > 0 (0: head_dim ** -0.5), got {scale}")
    has_k, has_v = request.HasField("new_k"), request.HasField("new_v")
    if has_k != has_v:
        raise invalid("send new_k and new_v together, or neither")
    if has_k:
        kv_shape = [q.shape[0], layout.num_kv_heads, layout.head_dim]
        new_k = _tensor(request.new_k, "new_k", layout.dtype, kv_shape)
        new_v = _tensor(request.new_v, "new_v", layout.dtype, kv_shape)
        for seq, n in zip(seqs, counts):
            check_private(pool, seq, seq.num_tokens - n, n)

    device_pool = pool.kv.device_tensor
    device = device_pool.device
    k_cache, v_cache = layer_kv(device_pool, request.layer)
    if has_k:
        slots = [slot for seq, n in zip(seqs, counts)
                 for slot in pool.kv.token_slots(seq, seq.num_tokens - n, n)]
        write_layer_kv(new_k.to(device), new_v.to(device), k_cache, v_cache,
                       torch.tensor(slots, dtype=torch.int64, device=device))
    width = max(len(seq.block_table) for seq in seqs)
    tables = torch.tensor([seq.block_table + [0] * (width - len(seq.block_table)) for seq in seqs],
                          dtype=torch.int32, device=device)
    lens = [seq.num_tokens for seq in seqs]
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    loc = None
    if extend:
        loc = torch.tensor(list(request.query_start_loc), dtype=torch.int32, device=device)
    return AttendJob(q.to(device), k_cache, v_cache, tables, seq_lens, loc, scale, lens, counts)
