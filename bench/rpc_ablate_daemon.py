"""The daemon ``bench/rpc_ablate.py`` measures with a part of a gsp request taken out.

Run as ``python bench/rpc_ablate_daemon.py serve ...`` (the arguments of ``prefixd serve``) with
``$PREFIXD_ABLATE`` set to what is taken out:

- ``engine``: ``Open`` and ``Release`` check the session as the daemon does and answer at
  once, without the engine or the log: ``Open``'s reply is a sequence of the prompt's length
  with a block table of the right size (slot numbers not real), ``Release``'s the empty reply.
  What is left is the daemon's gRPC serving: the server and its options, the event loop, the
  handlers' wrapper, sessions, and the protobuf messages.
- ``wait``: ``Release`` runs at durability ``index`` whatever the client asked: the engine does
  all its work (the host write-through, the records into the log, which the committer commits
  in groups as ever) but the reply does not wait for the log's fsync.

The handlers are replaced before the daemon starts; nothing of ``prefixd`` changes on disk.

NOTE: a benchmark tool, never a way to run a daemon: with ``engine`` nothing is cached, and
with ``wait`` an acknowledged commit may be lost to a crash.
"""

from __future__ import annotations

import os
import runpy
import sys

ABLATIONS = ("engine", "wait")


def install(what: str) -> None:
    from prefixd.api import prefixd_pb2 as pb
    from prefixd.daemon import service
    from prefixd.daemon.rpc_call import rpc

    cls = service.PrefixCacheService
    if what == "engine":
        @rpc
        async def Open(self, request, context):
            session = self._session(request.session_id)
            tokens = service.tokens_of(request.tokens)
            n = len(tokens) // 4
            blocks = -(-n // session.layout.block_size)
            return pb.OpenReply(sequence=pb.SequenceReply(
                seq_id=1 + self.core.calls["Open"], num_tokens=n, cached_tokens=0,
                block_table=service.table_bytes(range(blocks)), num_indexed=0))

        @rpc
        async def Release(self, request, context):
            self._session(request.session_id)
            return pb.ReleaseReply()

        cls.Open, cls.Release = Open, Release
    elif what == "wait":
        inner = cls.Release

        async def Release(self, request, context):
            request.durability = "index"
            return await inner(self, request, context)

        cls.Release = Release
    else:
        raise SystemExit(f"PREFIXD_ABLATE must be one of {', '.join(ABLATIONS)}, got {what!r}")


if __name__ == "__main__":
    install(os.environ.get("PREFIXD_ABLATE", ""))
    sys.argv[0] = "prefixd.daemon.cli"
    runpy.run_module("prefixd.daemon.cli", run_name="__main__", alter_sys=True)
