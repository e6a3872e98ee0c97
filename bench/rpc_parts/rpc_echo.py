"""The floor of ``bench/rpc.py``: a bare ``grpc.aio`` echo server on a Unix socket, and its client.

The server is what a gRPC call costs with nothing behind it: raw bytes in and out (no protobuf
parsing, no engine), on the same kind of socket and with the same message limits as the daemon.
Three methods of service ``bench.Echo``:

- ``Unary``: the request's first 8 bytes are the reply's size (little-endian u64); the reply
  is that many bytes (made once per size). The rest of the request is padding, so a call moves
  exactly the bytes of the daemon's request and reply it stands for.
- ``Upload`` (client stream): takes every chunk, replies 8 bytes (the total).
- ``Download`` (server stream): the request is the chunk sizes (u64 each); one reply per size.

Run as ``python bench/rpc_parts/rpc_echo.py SOCKET``; it prints ``ready`` once it listens and serves until
SIGTERM.
"""

from __future__ import annotations

import asyncio
import os
import signal
import struct
import subprocess
import sys
import time

import grpc

U64 = struct.Struct("<Q")
MAX_MESSAGE = 64 << 20
SERVER_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE),
                  ("grpc.max_send_message_length", MAX_MESSAGE), ("grpc.so_reuseport", 0)]
# The client library's channel options (prefixd.client.session), so both sides match.
CLIENT_OPTIONS = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]


class _Payloads:
    """Reply bytes by size, made once (a real server's reply is built per call; this floor's
    is not, so the floor is a little lower than any server can be)."""

    def __init__(self) -> None:
        self._by_size: dict[int, bytes] = {}

    def get(self, n: int) -> bytes:
        data = self._by_size.get(n)
        if data is None:
            data = self._by_size[n] = os.urandom(n)
        return data


async def _serve(path: str) -> None:
    payloads = _Payloads()

    async def unary(request: bytes, context) -> bytes:
        return payloads.get(U64.unpack_from(request)[0])

    async def upload(request_iterator, context) -> bytes:
        total = 0
        async for chunk in request_iterator:
            total += len(chunk)
        return U64.pack(total)

    async def download(request: bytes, context):
        for (n,) in U64.iter_unpack(request):
            yield payloads.get(n)

    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "Upload": grpc.stream_unary_rpc_method_handler(upload),
        "Download": grpc.unary_stream_rpc_method_handler(download),
    }
    server = grpc.aio.server(options=SERVER_OPTIONS)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Echo", handlers),))
    server.add_insecure_port("unix:" + path)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print("ready", flush=True)
    await stop.wait()
    await server.stop(1.0)


class EchoServer:
    """The echo server as a child process (``with EchoServer(path) as server``)."""

    def __init__(self, path: str, cpus: frozenset[int] | None = None) -> None:
        self.path = path
        self.cpus = cpus  # the CPUs it runs on (affinity.py); None: all
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "EchoServer":
        from affinity import preexec

        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), self.path],
                                     stdout=subprocess.PIPE, text=True, preexec_fn=preexec(self.cpus))
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"echo server did not start (exit {self.proc.poll()}): {line!r}")
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class EchoClient:
    """Calls of the echo server that move given byte counts (see the module docstring)."""

    def __init__(self, path: str) -> None:
        self.channel = grpc.insecure_channel("unix:" + path, options=CLIENT_OPTIONS)
        self._unary = self.channel.unary_unary("/bench.Echo/Unary")
        self._upload = self.channel.stream_unary("/bench.Echo/Upload")
        self._download = self.channel.unary_stream("/bench.Echo/Download")
        self._requests: dict[tuple[int, int], bytes] = {}

    def request(self, request_bytes: int, reply_bytes: int) -> bytes:
        """The request of a ``Unary`` call of these sizes (made once; time only ``call``)."""
        key = (request_bytes, reply_bytes)
        req = self._requests.get(key)
        if req is None:
            req = self._requests[key] = U64.pack(reply_bytes) + os.urandom(max(0, request_bytes - 8))
        return req

    def call(self, request: bytes) -> int:
        return len(self._unary(request))

    def upload(self, chunks: list[bytes]) -> int:
        return U64.unpack(self._upload(iter(chunks)))[0]

    def download(self, sizes: list[int]) -> int:
        return sum(len(c) for c in self._download(b"".join(U64.pack(n) for n in sizes)))

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.call(self.request(8, 0))
                return
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def close(self) -> None:
        self.channel.close()


if __name__ == "__main__":
    asyncio.run(_serve(sys.argv[1]))
