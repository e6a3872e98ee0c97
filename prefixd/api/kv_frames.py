"""KV chunks on the wire with the fewest copies: encoding a message that carries a ``KVChunk``
(``WriteKVRequest``, ``ReadKVReply``) and decoding one without copying its KV bytes.

The bytes of a ``KVChunk`` are most of such a message (4 MiB for a 2k-token tiny prefix), so
every copy of them costs the same order as the socket itself. gRPC
hands a receiver one ``bytes`` object per message; protobuf (upb) would copy the KV twice out
of it (``FromString`` copies the whole message into its arena, and every read of a ``bytes``
field copies again). ``decode_kv_frame`` copies neither: the chunk's ``data`` stays a
``memoryview`` of the received bytes, and only the small fields around it go through protobuf.

NOTE (the decoder's fast path, and its fallback): the fast path walks the protobuf wire format
itself (tag, varint, length-delimited) to find the chunk and its ``data``; everything else is
parsed by the generated classes, so field semantics (unknown fields, packed or unpacked
``shape``, UTF-8 checks) stay protobuf's. Whatever the walk does not expect (a chunk or a
``data`` field given twice, which protobuf would merge; a group; a truncated field) goes
through plain ``FromString`` instead, which decodes it or raises ``DecodeError`` exactly as
before. So a decoded frame is always what protobuf would decode, only cheaper.

NOTE: ``data`` views immutable ``bytes``: a tensor over it (``tensor_from_bytes``) is READ-ONLY
in fact, like every decoded tensor (``prefixd.api.tensors``).
"""

from __future__ import annotations

import ctypes
import functools
import math

from prefixd.api import prefixd_pb2 as pb
from prefixd.api.tensors import dtype_name

_KVCHUNK_DATA = pb.KVChunk.DESCRIPTOR.fields_by_name["data"].number
_LEN = 2  # the wire type of length-delimited fields (bytes, strings, messages, packed)
_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.argtypes = (ctypes.c_char_p, ctypes.c_ssize_t)
_new_bytes.restype = ctypes.py_object


class KVFrame:
    """One decoded message that carries a ``KVChunk`` (a ``WriteKVRequest`` or ``ReadKVReply``),
    its KV bytes not copied.

    Attributes:
        message: the message as protobuf decodes it, except that its chunk's ``data`` is empty
            (unless the frame was made by ``KVFrame.of``).
        data: the chunk's ``data``: a read-only ``memoryview`` of the received bytes (or
            ``bytes``); empty when the message has no chunk.

    NOTE: reading an attribute the frame lacks reads the message's (``frame.session_id``,
    ``frame.HasField("chunk")``), so code written for the message reads a frame alike; only
    the chunk's data must be taken from ``frame.data`` (``frame.chunk.data`` is empty, which
    a length check then refuses, never silently).
    """

    __slots__ = ("message", "data")

    def __init__(self, message, data) -> None:
        self.message = message
        self.data = data

    def __getattr__(self, name: str):
        return getattr(self.message, name)

    @classmethod
    def of(cls, message) -> "KVFrame":
        """The frame of a message protobuf decoded (its chunk's data read out once; the
        message is left as it was), or ``message`` itself if it is a frame."""
        if isinstance(message, KVFrame):
            return message
        field, _ = _chunk_field(type(message))
        if not message.HasField(field):
            return cls(message, b"")
        return cls(message, getattr(message, field).data)


@functools.cache
def _chunk_field(message_type) -> tuple[str, int]:
    """Name and number of ``message_type``'s ``KVChunk`` field."""
    for f in message_type.DESCRIPTOR.fields:
        if f.message_type is pb.KVChunk.DESCRIPTOR:
            return f.name, f.number
    raise TypeError(f"{message_type.__name__} carries no KVChunk")


def _varint_bytes(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def framed_kv(outer: bytes, field: int, seq_id: int, start: int, kv) -> bytes:
    """The encoded message ``outer`` with field ``field`` set to the ``KVChunk`` of ``kv``,
    built with ONE copy of the KV bytes (``b"".join`` straight from the tensor's memory).

    The encoding is exactly what protobuf would produce for the same message (a chunk's
    ``data`` is its last field, and protobuf writes fields in number order), so a receiver
    parses it with the generated class. Building it through protobuf instead copies the KV
    three times (``tobytes``, the field setter, ``SerializeToString``). A ``kv`` that is a
    token slice of a larger tensor (not contiguous) is joined from its ``num_layers * 2``
    contiguous pieces, not copied to a contiguous tensor first.

    Args:
        outer: the encoded outer message without the chunk (``WriteKVRequest(session_id=..)``
            or an empty ``ReadKVReply``).
        field: the outer message's ``KVChunk`` field number.
        kv: a tensor ``[num_layers, 2, n, num_kv_heads, head_dim]`` (copied to the host
            first if it is on a GPU).
    """
    import torch

    t = kv.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    head = pb.KVChunk(seq_id=seq_id, start=start, num_tokens=t.shape[2], shape=list(t.shape),
                      dtype=dtype_name(t.dtype)).SerializeToString()
    nbytes = t.numel() * t.element_size()
    if not nbytes:
        data = []
    else:  # a token range of a contiguous tensor is contiguous per layer and K/V
        pieces = [t] if t.is_contiguous() else [p.contiguous() for p in t.flatten(0, 1)]
        data = [memoryview(p.reshape(-1).view(torch.uint8).numpy()) for p in pieces]
    data_head = _varint_bytes(_KVCHUNK_DATA << 3 | _LEN) + _varint_bytes(nbytes) if nbytes else b""
    chunk_len = len(head) + len(data_head) + nbytes
    return b"".join((outer, _varint_bytes(field << 3 | _LEN), _varint_bytes(chunk_len), head,
                     data_head, *data))


def framed_kv_to_fill(outer: bytes, field: int, seq_id: int, start: int, shape, dtype):
    """``(message, kv)``: the encoding ``framed_kv`` would make for a ``kv`` of ``shape`` and
    ``dtype`` (a torch dtype), as a new ``bytes`` object whose KV bytes are left for the
    caller to fill through ``kv``, a writable CPU tensor over them: the caller gathers the
    KV straight into the message, with no tensor between (ReadKV's replies).

    NOTE (filling a new ``bytes``): the object comes from ``PyBytes_FromStringAndSize(NULL,
    n)``, the C API's way to build a ``bytes`` in place: it is writable until anyone else
    sees it. The caller must fill ``kv`` completely, then drop it, before the message goes
    anywhere (handing it to gRPC, which copies it at once, is the only use here).
    """
    import torch

    n = math.prod(shape)
    nbytes = n * dtype.itemsize
    head = pb.KVChunk(seq_id=seq_id, start=start, num_tokens=shape[2], shape=list(shape),
                      dtype=dtype_name(dtype)).SerializeToString()
    data_head = _varint_bytes(_KVCHUNK_DATA << 3 | _LEN) + _varint_bytes(nbytes) if nbytes else b""
    prefix = b"".join((outer, _varint_bytes(field << 3 | _LEN),
                       _varint_bytes(len(head) + len(data_head) + nbytes), head, data_head))
    if not nbytes:
        return prefix, torch.empty(shape, dtype=dtype)
    message = _new_bytes(None, len(prefix) + nbytes)  # > 1 byte: never a shared singleton
    address = ctypes.cast(ctypes.c_char_p(message), ctypes.c_void_p).value
    mem = (ctypes.c_char * len(message)).from_address(address)
    mem.owner = message  # the view keeps the message alive, as a buffer's view would
    mem[:len(prefix)] = prefix
    raw = torch.frombuffer(mem, dtype=torch.uint8, offset=len(prefix), count=nbytes)
    return message, raw.view(dtype).view(shape)


class _Unusual(Exception):
    """The fast path met something it leaves to protobuf."""


def _varint(buf: memoryview, i: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= end or shift > 63:
            raise _Unusual
        byte = buf[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i
        shift += 7


def _fields(buf: memoryview, i: int, end: int):
    """``(field number, wire type, first byte of the field, value start, value end)`` of each
    field in ``buf[i:end]``."""
    while i < end:
        first = i
        key, i = _varint(buf, i, end)
        wire = key & 7
        if wire == 0:
            _, stop = _varint(buf, i, end)
        elif wire == 1:
            stop = i + 8
        elif wire == 5:
            stop = i + 4
        elif wire == _LEN:
            n, i = _varint(buf, i, end)
            stop = i + n
        else:  # groups: protobuf's business
            raise _Unusual
        if stop > end:
            raise _Unusual
        yield key >> 3, wire, first, i, stop
        i = stop


def _split(raw: bytes, chunk_field: int):
    """``(outer fields, chunk fields, data)``, the first two as encoded bytes without the
    chunk resp. its data, or raises ``_Unusual``."""
    buf = memoryview(raw)
    outer, chunk = [], None
    for number, wire, first, lo, hi in _fields(buf, 0, len(buf)):
        if number == chunk_field:
            if wire != _LEN or chunk is not None:
                raise _Unusual
            chunk = (lo, hi)
        else:
            outer.append(buf[first:hi])
    if chunk is None:
        return b"".join(outer), None, b""
    head, data = [], None
    for number, wire, first, lo, hi in _fields(buf, *chunk):
        if number == _KVCHUNK_DATA:
            if wire != _LEN or data is not None:
                raise _Unusual
            data = buf[lo:hi]
        else:
            head.append(buf[first:hi])
    return b"".join(outer), b"".join(head), b"" if data is None else data


def decode_kv_frame(raw: bytes, message_type) -> KVFrame:
    """Decode ``raw``, an encoded ``message_type`` (``WriteKVRequest`` or ``ReadKVReply``),
    leaving its chunk's KV bytes where they are (see the module NOTE).

    Raises:
        google.protobuf.message.DecodeError: ``raw`` is not a valid encoding (as ``FromString``).
    """
    field, number = _chunk_field(message_type)
    try:
        outer, head, data = _split(raw, number)
    except _Unusual:
        message = message_type.FromString(raw)
        frame = KVFrame.of(message)
        if frame.data:
            getattr(message, field).ClearField("data")
        return frame
    message = message_type.FromString(outer)
    if head is not None:
        chunk = getattr(message, field)
        chunk.MergeFromString(head)
        chunk.SetInParent()  # present even when it held nothing but data
    return KVFrame(message, data)


def decode_write_request(raw: bytes) -> KVFrame:
    """A ``WriteKVRequest`` frame (the daemon's request deserializer for WriteKV)."""
    return decode_kv_frame(raw, pb.WriteKVRequest)


def decode_read_reply(raw: bytes) -> KVFrame:
    """A ``ReadKVReply`` frame (the client's response deserializer for ReadKV)."""
    return decode_kv_frame(raw, pb.ReadKVReply)
