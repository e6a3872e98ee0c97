"""The way to one daemon under an ``Attachment``: the channel, Attach with backoff, mapping the
pool an Attach reply describes, and the calls a recovery makes before it owns a new session.

It holds no session state: the ``Attachment`` (attachment.py) decides which session id each
call names and what it does with the replies.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import grpc

from prefixd.api import prefixd_pb2 as pb
from prefixd.api.layout import KVLayout
from prefixd.client.errors import MappingError, Unavailable, from_rpc_error
from prefixd.client.mapped import MappedPool, map_pool
from prefixd.client.reconnect import Backoff
from prefixd.client.remote_kv import KVStub

log = logging.getLogger(__name__)

_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class Connection:
    """One channel to the daemon on ``socket_path`` and the stub over it.

    Data structure:
        ``stub``: the generated stub (WriteKV takes encoded chunks), over a channel opened
        once. ``_stopped()``: True once the attachment is closing; a retry loop gives up at
        its next wait. ``_backoff``: the waits while the daemon is UNAVAILABLE.
        ``_bulk_timeout``: the deadline of Attach and Reclaim.

    NOTE: the channel is opened once per session: a channel reconnects by itself after a
    daemon restart (the backoff in ``_CHANNEL_OPTIONS``), and closing it under another
    thread's call made that call raise ValueError ("Cannot invoke RPC on closed channel") out
    of the library.
    """

    def __init__(self, socket_path: str, layout: KVLayout, name: str, *, mapped: bool | None,
                 backoff: Backoff, bulk_timeout: float | None, max_model_len: int,
                 stopped: Callable[[], bool]) -> None:
        self.socket_path = socket_path
        self._layout = layout
        self._name = name
        self._mapped = mapped
        self._backoff = backoff
        self._bulk_timeout = bulk_timeout
        self._max_model_len = max_model_len
        self._stopped = stopped
        self._channel = grpc.insecure_channel("unix:" + socket_path, options=_CHANNEL_OPTIONS)
        self.stub = KVStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def attach(self, *, retry: bool) -> pb.AttachReply:
        """Attach (with backoff while UNAVAILABLE when ``retry``); nothing of it is used yet."""
        request = pb.AttachRequest(client_name=self._name, layout=pb.KVLayout(**_layout_fields(self._layout)),
                                   max_model_len=self._max_model_len)
        waits = self._backoff.waits()
        while True:
            try:
                reply = self.stub.Attach(request, timeout=self._bulk_timeout)
                break
            except grpc.RpcError as exc:
                err = from_rpc_error(exc)
            wait = next(waits, None) if retry and isinstance(err, Unavailable) and not self._stopped() else None
            if wait is None:
                raise err
            log.debug("attach unavailable, retrying in %.3f s error=%s", wait, err)
            time.sleep(wait)  # the channel reconnects by itself (_CHANNEL_OPTIONS' backoff)
        return reply

    def map(self, pools) -> MappedPool | None:
        """The device pool of an Attach reply's descriptors, mapped; None when not mapped (asked
        not to, or, unless ``mapped`` was True, the mapping failed: KV goes over the rpcs)."""
        if self._mapped is False:
            return None
        device = [d for d in pools if d.tier in ("device", "")]
        try:
            if not device:
                raise MappingError("the daemon sent no device pool descriptor")
            return map_pool(device[0], self._layout)
        except MappingError as exc:
            if self._mapped:
                raise
            log.info("pool not mapped, KV goes over the rpcs: %s", exc)
            return None

    def session_alive(self, session_id: int, timeout: float | None) -> bool:
        """Probe ``session_id`` with Stats (backoff while UNAVAILABLE).

        Raises:
            Unavailable: the daemon did not come back within the backoff's total.
        """
        waits = self._backoff.waits()
        while True:
            try:
                self.stub.Stats(pb.StatsRequest(session_id=session_id), timeout=timeout)
                return True
            except grpc.RpcError as exc:
                err = from_rpc_error(exc)
            if not isinstance(err, Unavailable):
                return False
            wait = next(waits, None) if not self._stopped() else None
            if wait is None:
                raise Unavailable(f"the daemon on {self.socket_path} did not come back within "
                                  f"{self._backoff.total_s} s: {err.message}")
            time.sleep(wait)

    def release_quietly(self, session_id: int, seq_id: int, timeout: float | None) -> None:
        """Release a sequence, logging (not raising) a failure."""
        try:
            self.stub.Release(pb.ReleaseRequest(session_id=session_id, seq_id=seq_id), timeout=timeout)
        except grpc.RpcError as exc:
            log.info("release of an unknown reclaimed sequence failed seq=%d error=%s", seq_id, from_rpc_error(exc))


def _layout_fields(layout: KVLayout) -> dict:
    return {"model_id": layout.model_id, "num_layers": layout.num_layers, "num_kv_heads": layout.num_kv_heads,
            "head_dim": layout.head_dim, "dtype": layout.dtype, "block_size": layout.block_size}
