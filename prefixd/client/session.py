"""``connect`` and ``Session``: one attachment to a prefixd daemon (DESIGN.md "Client library").

A session is made by ``Attach`` (on ``connect``), held by a ``KeepAlive`` stream on a background
thread, and ended by ``Detach`` (``close()``, or leaving the ``with`` block). Its sequences are
``Sequence`` handles that every reply updates in place. KV moves through the mapped device pool
when this process can map it (``mapped.py``) and over the rpcs otherwise (``remote_kv.py``).

Reconnect semantics (``reconnect=True``, the default):

- A KeepAlive stream that breaks starts a recovery at once on a background thread (recovered
  sequences wait only ``reclaim_grace_s`` in the daemon); a call that fails UNAVAILABLE or
  NOT_FOUND starts one too if none has run since the call began. A recovery first probes the
  old session (still there: it was a hiccup, nothing changes); else it attaches again with
  exponential backoff (``Backoff``: bounded total time), calls ``Reclaim(previous session id)``,
  remaps the pools, and updates every live ``Sequence`` in place: a new ``id`` and
  ``block_table``, ``reclaimed`` set, ``num_tokens`` cut back to what survived (whole committed
  blocks) and ``previous_num_tokens`` what it had, so the caller re-extends and rewrites tokens
  ``num_tokens .. previous_num_tokens``; ``lost`` when nothing survived (open it again).
- Calls that name no sequence (``lookup``, ``lookup_tiers``, ``stats``, ``open``) are retried
  and succeed as if nothing happened. (``open`` too: if the failed attempt did open a sequence
  before the crash, the Reclaim returns it under an id no handle knows, and the recovery
  releases it.) A call that names sequences (``extend``, ``commit``, ``fork``, ``release``,
  ``write_kv``, ``read_kv``, ``attend``) and failed under the restart raises
  ``DaemonRestarted`` (``.reclaimed``: the updated handles), because whether its effect
  happened is unknown and its handles changed; redo its work against them.
- A handle a recovery changed raises ``DaemonRestarted`` once at the next call that names it,
  even when the recovery ran in the background and the call itself would work: a sequence
  cut back from 40 to 32 tokens must not be extended from 32 as if nothing happened.
- If the daemon does not come back within the backoff's total, the call raises
  ``Unavailable``; the session stays usable and the next call tries again.
- Mapped reads and writes never talk to the daemon, so each first checks the lease: a broken
  keep-alive stream (the daemon died) sends it through a recovery first, and a handle that
  recovery changed raises ``DaemonRestarted`` instead of storing through its old block table
  (whose slots the new daemon may have given to another client).

With ``reconnect=False`` every failure is raised as its typed error and a lost lease ends the
session (calls then raise ``NotFound``).

A session may be shared by threads; recovery runs under one lock and at most once per failure.
"""

from __future__ import annotations

import json
import logging

from prefixd.api import prefixd_pb2 as pb
from prefixd.api.layout import KVLayout
from prefixd.client import kv_events, remote_kv
from prefixd.client.attachment import Attachment
from prefixd.client.errors import InvalidArgument, NotFound
from prefixd.client.handles import LookupResult, Sequence
from prefixd.client.mapped import check_attend_args
from prefixd.client.reconnect import Backoff
from prefixd.client.wire import pack_tokens
from prefixd.kernels.token_io import check_kv

log = logging.getLogger(__name__)


def connect(socket_path: str, layout: KVLayout, name: str = "prefixd-client", *, mapped: bool | None = None,
            lease_renew: float | None = None, reconnect: bool = True, backoff: Backoff | None = None,
            timeout_s: float | None = 60.0, request_timeout_ms: float | None = None,
            max_model_len: int | None = None) -> "Session":
    """Attach to the daemon on ``socket_path`` for ``layout``; use as a context manager.

    Args:
        mapped: ``None`` maps the device pool when possible and falls back to the rpcs; ``True``
            requires the mapping (MappingError otherwise); ``False`` always uses the rpcs.
        lease_renew: seconds between keep-alive pings (default: a third of the lease).
        reconnect: recover after a daemon restart (module docstring); ``backoff`` bounds it.
        timeout_s: deadline of each call (None: none); with ``request_timeout_ms``, of Attach,
            Reclaim and the bulk KV rpcs (write_kv, read_kv, attend) only.
        request_timeout_ms: fail fast (``prefixd.client.breaker``): the deadline in ms of the
            request-path calls (lookup, open, extend, commit, fork, release, stats). A call that
            misses it, or finds the daemon unreachable or the session lost, trips the session's
            breaker: until a background probe sees the daemon answer (and re-attaches after a
            restart), every call raises ``DaemonNotAnswering`` (an ``Unavailable``) at once.
            Calls are then never retried inside the library. None (default): no breaker; calls
            wait through a restart as described in the module docstring.
        max_model_len: the longest request this client runs, in tokens (None: unknown); the
            daemon refuses the Attach when one such request cannot fit the pool.
    Raises:
        Unavailable: no daemon answered (within the backoff's total when ``reconnect``);
        InvalidArgument: the daemon refused the layout; ResourceExhausted: the pool cannot hold
        one request of ``max_model_len`` (the message names the config key); MappingError:
        ``mapped=True`` and the pool cannot be mapped.
    """
    return Session(socket_path, layout, name, mapped=mapped, lease_renew=lease_renew, reconnect=reconnect,
                   backoff=backoff, timeout_s=timeout_s, request_timeout_ms=request_timeout_ms,
                   max_model_len=max_model_len)


def _attached(name: str, doc: str | None = None) -> property:
    """An attribute of the session that is its attachment's (read and set through)."""
    return property(lambda self: getattr(self.attachment, name),
                    lambda self, value: setattr(self.attachment, name, value), doc=doc)


class Session:
    """The client API over one attachment, which it holds (``attachment``: the channel, the
    session id, the lease, the live handles and recovery; see ``Attachment`` for its state and
    invariants).

    Every method that names a ``Sequence`` updates it in place from the daemon's reply.
    """

    def __init__(self, socket_path: str, layout: KVLayout, name: str, *, mapped: bool | None,
                 lease_renew: float | None, reconnect: bool, backoff: Backoff | None,
                 timeout_s: float | None, request_timeout_ms: float | None = None,
                 max_model_len: int | None = None) -> None:
        self.attachment = Attachment(socket_path, layout, name, mapped=mapped, lease_renew=lease_renew,
                                     reconnect=reconnect, backoff=backoff, timeout_s=timeout_s,
                                     request_timeout_ms=request_timeout_ms, max_model_len=max_model_len)

    # -- the attachment's state and lifecycle --------------------------------------------------

    socket_path = _attached("socket_path")
    layout = _attached("layout")
    name = _attached("name")
    id = _attached("id", "The session id of the last Attach (a recovery changes it).")
    epoch = _attached("epoch", "The daemon's epoch at the last Attach.")
    tenant = _attached("tenant")
    lease_s = _attached("lease_s")
    max_message_bytes = _attached("max_message_bytes")
    pool = _attached("pool", "The mapped device pool (``MappedPool``), or None (KV over the rpcs).")
    recoveries = _attached("recoveries", "How many recoveries re-attached this session.")
    mapped = _attached("mapped", "True when KV and attention go through the mapped pool.")
    breaker = _attached("breaker", "The fail-fast breaker (``request_timeout_ms``), or None.")
    lease_held = _attached("lease_held", "True while the keep-alive stream is up (``Attachment.lease_held``).")
    # what the calls below use of the attachment: its stub, deadline, live handles and call path
    _stub = _attached("_stub")
    _timeout = _attached("_timeout")
    _bulk_timeout = _attached("_bulk_timeout")
    _live = _attached("_live")
    _closed = _attached("_closed")
    _call = _attached("_call")
    _check_lease = _attached("_check_lease")

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> int:
        """Detach (``Attachment.close``): the daemon releases every sequence still held.
        Returns the sequences it released (0 if the daemon was gone). Idempotent."""
        return self.attachment.close()

    detach = close

    def check_invariants(self) -> None:
        self.attachment.check_invariants()

    # -- the API -----------------------------------------------------------------------------

    def lookup(self, tokens) -> int:
        """Cached tokens of the prompt ``tokens`` (any tier), pinning nothing."""
        return self.lookup_tiers(tokens).cached_tokens

    def lookup_tiers(self, tokens) -> LookupResult:
        """Cached tokens of ``tokens`` by tier (``LookupResult``), pinning nothing."""
        raw = pack_tokens(tokens)
        r = self._call(lambda: self._stub.Lookup(pb.LookupRequest(session_id=self.id, tokens=raw),
                                                 timeout=self._timeout), retry_safe=True, what="lookup")
        return LookupResult(r.cached_tokens, r.device_tokens, r.host_tokens, r.disk_tokens, r.unverified_tokens)

    def open(self, tokens) -> Sequence:
        """Open a sequence for ``tokens``: its cached prefix is shared, the rest allocated.
        Compute KV only for tokens past ``seq.cached_tokens``. Raises ResourceExhausted."""
        raw = pack_tokens(tokens)
        r = self._call(lambda: self._stub.Open(pb.OpenRequest(session_id=self.id, tokens=raw),
                                               timeout=self._timeout), retry_safe=True, what="open")
        seq = Sequence(r.sequence)
        self._live[seq.id] = seq
        return seq

    def extend(self, seq: Sequence, tokens) -> Sequence:
        """Append ``tokens`` to ``seq`` (copy-on-write of a shared last block done); returns it."""
        seq.check_live()
        raw = pack_tokens(tokens)
        r = self._call(lambda: self._stub.Extend(pb.ExtendRequest(session_id=self.id, seq_id=seq.id, tokens=raw),
                                                 timeout=self._timeout), retry_safe=False, what="extend")
        self._rekey(seq, r.sequence)
        return seq

    def commit(self, seq: Sequence, durability: str = "crash") -> int:
        """Index ``seq``'s full blocks (its KV must be written); answered once as durable as
        asked ("index", "crash", "power"). Returns the blocks newly indexed."""
        seq.check_live()
        self._settle()
        r = self._call(lambda: self._stub.Commit(pb.CommitRequest(session_id=self.id, seq_id=seq.id,
                                                                  durability=durability), timeout=self._timeout),
                       retry_safe=False, what="commit")
        if r.HasField("sequence"):
            self._rekey(seq, r.sequence)
        return r.indexed_blocks

    def fork(self, seq: Sequence, n: int) -> list[Sequence]:
        """``n`` children sharing every block of ``seq`` (copy-on-write on their next extend)."""
        seq.check_live()
        r = self._call(lambda: self._stub.Fork(pb.ForkRequest(session_id=self.id, seq_id=seq.id, num_children=n),
                                               timeout=self._timeout), retry_safe=False, what="fork")
        children = [Sequence(c) for c in r.children]
        for s in [seq, *children]:
            s.mark_forked()
        for c in children:
            self._live[c.id] = c
        return children

    def release(self, seq: Sequence, commit: bool = False, durability: str = "crash") -> None:
        """Drop ``seq`` (committing first when ``commit``); its indexed blocks stay cached."""
        seq.check_live()
        if commit:
            self._settle()
        self._call(lambda: self._stub.Release(pb.ReleaseRequest(session_id=self.id, seq_id=seq.id, commit=commit,
                                                                 durability=durability), timeout=self._timeout),
                   retry_safe=False, what="release")
        self._live.pop(seq.id, None)
        seq.released = True

    def write_kv(self, seq: Sequence, start: int, kv) -> None:
        """Write ``kv`` (``[num_layers, 2, n, num_kv_heads, head_dim]`` of the layout's dtype)
        as the KV of tokens ``start .. start + n`` of ``seq``.

        Raises:
            InvalidArgument: shape, dtype or range; SharedBlockError: the range reaches a
            committed block (write only tokens past ``seq.num_indexed * block_size``).
        """
        seq.check_live()
        try:
            n = check_kv(self.layout, kv)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        self._check_range(seq, start, n)
        if not n:
            return
        pool = self.pool  # a store into the pool never joins an autograd graph (MappedPool.write)
        if pool is not None and (start // self.layout.block_size >= seq.shared_blocks()
                                 or start // self.layout.block_size < seq.num_indexed):
            self._check_lease([seq])
            pool = self.pool  # a recovery in the check may have remapped it (or found no mapping)
            if pool is not None:
                pool.write(seq, start, kv)
                return
        self._call(lambda: remote_kv.write_kv(self._stub, self.id, seq.id, start, kv, self.layout.block_size,
                                              self.max_message_bytes, self._bulk_timeout),
                   retry_safe=False, what="write_kv")

    def read_kv(self, seq: Sequence, start: int, n: int, *, out=None):
        """The KV of tokens ``start .. start + n`` of ``seq``: a new tensor, or ``out``
        (``[num_layers, 2, n, num_kv_heads, head_dim]`` of the layout's dtype, on any device)
        filled in place, which spares a fresh allocation per read."""
        seq.check_live()
        self._check_range(seq, start, n)
        if out is not None:
            want = (self.layout.num_layers, 2, n, self.layout.num_kv_heads, self.layout.head_dim)
            if tuple(out.shape) != want or out.dtype != self.layout.torch_dtype():
                raise InvalidArgument(f"out must be {want} of {self.layout.dtype}, got "
                                      f"{tuple(out.shape)} of {out.dtype}")
        if self.pool is not None:
            self._check_lease([seq])
            pool = self.pool
            if pool is not None:
                return pool.read(seq, start, n, out)
        return self._call(lambda: remote_kv.read_kv(self._stub, self.id, seq.id, start, n, self.layout,
                                                    self._bulk_timeout, out), retry_safe=False, what="read_kv")

    def attend(self, seqs, q, *, layer: int = 0, new_k=None, new_v=None, query_start_loc=None,
               scale: float | None = None):
        """Paged attention of ``seqs`` (decode: ``q`` is ``[num_seqs, num_q_heads, head_dim]``;
        extend: the new tokens packed, located by ``query_start_loc``) over layer ``layer`` of
        the pool, after writing ``new_k``/``new_v`` (``[tokens, num_kv_heads, head_dim]``) as
        the K/V of each sequence's last tokens. Computed here over the mapped pool, else by
        the daemon (Attend). Returns a tensor like ``q`` (on its device)."""
        seqs = list(seqs)
        for s in seqs:
            s.check_live()
        check_attend_args(seqs, q, new_k, new_v, query_start_loc)
        if not 0 <= layer < self.layout.num_layers:
            raise InvalidArgument(f"layer must be in 0..{self.layout.num_layers - 1}, got {layer}")
        if self.pool is not None and (new_k is None or self._new_tokens_private(seqs, q, query_start_loc)):
            self._check_lease(seqs)
            pool = self.pool  # a recovery in the check may have remapped it
            if pool is not None:
                try:
                    return pool.attend(seqs, q, layer=layer, new_k=new_k, new_v=new_v,
                                       query_start_loc=query_start_loc, scale=scale)
                except InvalidArgument:
                    raise
                except ValueError as exc:  # the kernels' checks (dtype, heads, strides)
                    raise InvalidArgument(str(exc)) from None
        out = self._call(lambda: remote_kv.attend(self._stub, self.id, [s.id for s in seqs], q, layer=layer,
                                                  new_k=new_k, new_v=new_v, query_start_loc=query_start_loc,
                                                  scale=scale, timeout=self._bulk_timeout),
                         retry_safe=False, what="attend")
        return out.to(q.device)

    def stats(self) -> dict[str, float]:
        """The tenant's counters and gauges (Prometheus-style names)."""
        return dict(self._stats().values)

    def stats_json(self) -> dict:
        """The same, nested by tenant and pool."""
        raw = self._stats().json
        return json.loads(raw) if raw else {}

    def _stats(self) -> pb.StatsReply:
        return self._call(lambda: self._stub.Stats(pb.StatsRequest(session_id=self.id), timeout=self._timeout),
                          retry_safe=True, what="stats")

    def subscribe_events(self, from_sequence_number: int = 0, epoch: int = 0, *,
                         timeout: float | None = None):
        """The KV events of this session's tenant (every pool of it) after
        ``from_sequence_number`` of ``epoch``, replayed then live: an iterator of
        ``prefixd.client.kv_events.KVEvent`` until the stream ends (see that module for a
        router's use, ``cleared``, and how to resume). Not retried: on ResourceExhausted,
        Unavailable or NotFound subscribe again from the last event's number and epoch.
        ``timeout``: the whole stream's deadline (None: none)."""
        if self._closed:
            raise NotFound("the session is closed; connect again")
        return kv_events.subscribe(self._stub, self.id, from_sequence_number, epoch, timeout=timeout)

    @property
    def sequences(self) -> list[Sequence]:
        """The live handles (opened, forked or reclaimed, not released)."""
        return list(self._live.values())

    # -- helpers -----------------------------------------------------------------------------

    def _settle(self) -> None:
        """Mapped stores into a CUDA pool done before the daemon reads the blocks."""
        if self.pool is not None:
            self.pool.settle()

    def _rekey(self, seq: Sequence, reply: pb.SequenceReply) -> None:
        old = seq.id
        seq.update(reply)
        if seq.id != old:
            self._live.pop(old, None)
        self._live[seq.id] = seq

    def _new_tokens_private(self, seqs, q, query_start_loc) -> bool:
        """True when every new token's block is past what a fork may share (mapped write safe)."""
        bs = self.layout.block_size
        for i, s in enumerate(seqs):
            n = 1 if query_start_loc is None else int(query_start_loc[i + 1]) - int(query_start_loc[i])
            if n and (s.num_tokens - n) // bs < s.shared_blocks() and (s.num_tokens - n) // bs >= s.num_indexed:
                return False
        return True

    @staticmethod
    def _check_range(seq: Sequence, start: int, n: int) -> None:
        if not isinstance(start, int) or not isinstance(n, int) or start < 0 or n < 0:
            raise InvalidArgument(f"start and n must be ints >= 0, got start={start!r} n={n!r}")
        if start + n > seq.num_tokens:
            raise InvalidArgument(f"tokens {start}..{start + n} are past the end of sequence {seq.id} "
                                  f"({seq.num_tokens} tokens): extend it first")
