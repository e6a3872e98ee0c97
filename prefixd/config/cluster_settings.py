"""``ClusterConfig``: the ``[engine.cluster]`` table, the optional Redis Cluster tier below disk.

::

    [engine.cluster]
    nodes = ["10.0.0.1:7000", "10.0.0.2:7000"]   # seed nodes of the Redis Cluster (host:port)
    timeout_ms = 5             # per batched round trip; a slower node is a miss, never a stall
    connect_timeout_ms = 50
    retry_after_s = 1.0        # a node that failed is skipped (a miss) this long
    write_policy = "all"       # "all" | "hits>=N" | "power"
    batch_blocks = 64          # blocks per pipelined write
    queue_mib = 256            # write-behind queue bound; full: blocks are dropped and counted

No ``[engine.cluster]`` table: no cluster tier at all (no thread, no ``redis`` import, no
fleet hashing). Values are checked in ``__post_init__``; a bad one raises ``ConfigError``
saying what to change (``prefixd.config.toml_reader`` reads the table).

Write policies (which committed blocks go to the cluster, written behind by one thread):

- ``all``: every block a commit indexes;
- ``hits>=N``: a block once an ``open`` has hit it N times (the popular prefixes only);
- ``power``: the blocks of commits made at ``power`` durability (the client's own mark of
  what is worth keeping).
"""

from __future__ import annotations

import dataclasses
import math
import re

from prefixd.config.errors import ConfigError

_HITS = re.compile(r"hits>=([0-9]{1,9})")
_NODE = re.compile(r"(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(?P<port>[0-9]{1,5})")
CLUSTER_KEYS = ("nodes", "timeout_ms", "connect_timeout_ms", "retry_after_s", "write_policy",
                "batch_blocks", "queue_mib")


def _positive(key: str, value, *, integer: bool = False) -> None:
    ok = (isinstance(value, int) if integer else isinstance(value, (int, float)))
    if (not ok or isinstance(value, bool) or not math.isfinite(value) or value <= 0):
        kind = "an integer" if integer else "a number"
        raise ConfigError(f"engine.cluster.{key} must be {kind} > 0, got {value!r}: "
                          f"set [engine.cluster] {key} = <{kind.split()[-1]}>")


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """The cluster tier's settings (see the module docstring for the TOML form).

    Attributes:
        nodes: seed nodes as ``"host:port"`` (any live one finds the rest of the cluster).
        timeout_ms, connect_timeout_ms: bounds of one batched round trip and of a connect.
        retry_after_s: how long a node that failed is treated as down (a miss) before a retry.
        write_policy: ``"all"``, ``"hits>=N"`` (N >= 1) or ``"power"``.
        batch_blocks: blocks per pipelined write of the write-behind thread.
        queue_mib: bound of the write-behind queue (KV bytes copied at commit); when full,
            blocks are dropped (counted), never waited for.
    """

    nodes: tuple[str, ...]
    timeout_ms: float = 5.0
    connect_timeout_ms: float = 50.0
    retry_after_s: float = 1.0
    write_policy: str = "all"
    batch_blocks: int = 64
    queue_mib: float = 256.0

    def __post_init__(self) -> None:
        nodes = self.nodes
        if isinstance(nodes, str) or not isinstance(nodes, (list, tuple)) or not nodes:
            raise ConfigError(f"engine.cluster.nodes must be a non-empty list of \"host:port\" "
                              f"strings, got {nodes!r}: set [engine.cluster] nodes = "
                              f"[\"127.0.0.1:7000\"]")
        for node in nodes:
            m = _NODE.fullmatch(node) if isinstance(node, str) else None
            if m is None or not 0 < int(m["port"]) < 65536:
                raise ConfigError(f"engine.cluster.nodes: {node!r} is not \"host:port\" (port "
                                  f"1..65535): write each node as \"10.0.0.1:7000\"")
        object.__setattr__(self, "nodes", tuple(nodes))
        for key in ("timeout_ms", "connect_timeout_ms", "retry_after_s", "queue_mib"):
            _positive(key, getattr(self, key))
        _positive("batch_blocks", self.batch_blocks, integer=True)
        self.min_hits  # noqa: B018 - validates write_policy

    @property
    def min_hits(self) -> int:
        """N of ``hits>=N``; 0 for ``all`` and ``power``."""
        policy = self.write_policy
        if policy in ("all", "power"):
            return 0
        m = _HITS.fullmatch(policy) if isinstance(policy, str) else None
        if m is None or int(m[1]) < 1:
            raise ConfigError(f"engine.cluster.write_policy must be \"all\", \"hits>=N\" (N >= 1) "
                              f"or \"power\", got {policy!r}: set [engine.cluster] write_policy "
                              f"= \"all\"")
        return int(m[1])
