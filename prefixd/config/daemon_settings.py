"""``DaemonConfig``: the ``[daemon]`` table of the config file, and where things go by default.

One TOML file configures the whole daemon: ``[engine]`` is ``EngineConfig`` (pools, sync,
policies, tenants), ``[daemon]`` is this::

    [daemon]
    socket = "/run/prefixd/prefixd.sock"  # the first tenant's socket; others sit beside it
    lease_s = 10.0                        # a session with no KeepAlive ping this long ends
    max_message_bytes = 67108864          # per gRPC message, both ways
    max_concurrent_calls = 1024           # per socket; past it: RESOURCE_EXHAUSTED
    log_level = "info"
    shutdown_grace_s = 10.0               # SIGTERM: in-flight calls get this long

    [daemon.limits]                       # RESOURCE_EXHAUSTED past them
    sequences_per_session = 4096
    sequences_per_tenant = 16384
    blocks_per_session = 4194304
    blocks_per_tenant = 16777216
    pools_per_tenant = 16                 # one pool per KV layout attached with
    max_block_bytes = 67108864            # the largest KV block (bytes) a layout may have

    [daemon.events]                       # KV events for routers (SubscribeEvents)
    ring_size = 65536                     # events kept per tenant for a replay-from
    subscriber_queue = 4096               # events one subscriber may lag before it is cut off

    [daemon.kv_events]                    # the same on ZMQ, vLLM's format (kv_events_settings)
    endpoint = ""                         # "" off; "tcp://127.0.0.1:5557", "ipc:///run/..."

    [daemon.metrics]                      # Prometheus exposition (prefixd.daemon.metrics_http)
    listen = ""                           # "" off; "127.0.0.1:9464" (loopback only) or
                                          #   "unix:/run/prefixd/metrics.sock"

    [[daemon.sockets]]                    # optional, per tenant: path, owner, group, mode
    tenant = "default"
    path = "/run/prefixd/prefixd.sock"
    owner = ""                            # user name or uid; "" keeps the daemon's
    group = ""
    mode = "0660"

Every tenant of ``[[engine.tenants]]`` gets a socket: the one listed here, or
``<socket dir>/<tenant>.sock`` (the first tenant: ``socket`` itself). Defaults need no file
(``prefixd.config.paths``): state in ``$XDG_STATE_HOME/prefixd`` (or ``~/.local/state/prefixd``),
socket ``$XDG_RUNTIME_DIR/prefixd/prefixd.sock`` (or ``<state dir>/prefixd.sock``).
``prefixd.config.toml_reader`` reads the file.
"""

from __future__ import annotations

import dataclasses
import os

from prefixd.config.engine_settings import EngineConfig
from prefixd.config.errors import ConfigError
from prefixd.config.kv_events_settings import KVEventsConfig
from prefixd.config.paths import default_socket

LOG_LEVELS = ("debug", "info", "warning", "error")
SOCKET_MAX = 107  # sun_path holds 108 bytes with the terminating NUL
LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one session and one tenant may hold (RESOURCE_EXHAUSTED past them; the daemon's
    ``prefixd.daemon.sessions`` enforces them)."""

    sequences_per_session: int = 4096
    sequences_per_tenant: int = 16384
    blocks_per_session: int = 1 << 22
    blocks_per_tenant: int = 1 << 24
    # NOTE: every new layout a client attaches with makes a pool (files, a log, memory) that
    # lives on and is opened at every start: a tenant gets a few, not one per request.
    pools_per_tenant: int = 16
    # NOTE: one block is the unit every tier allocates and evicts; a layout whose block is
    # larger than this is refused at Attach before any budget is looked at.
    max_block_bytes: int = 64 << 20


@dataclasses.dataclass(frozen=True)
class TenantSocket:
    """Where one tenant's socket lives and who may open it."""

    tenant: str
    path: str
    owner: str = ""
    group: str = ""
    mode: int = 0o660

    def __post_init__(self) -> None:
        if not os.path.isabs(self.path):
            raise ConfigError(f"daemon.sockets: path {self.path!r} of tenant {self.tenant!r} must "
                              f"be absolute")
        if len(os.fsencode(self.path)) > SOCKET_MAX:
            raise ConfigError(f"socket path {self.path!r} is {len(os.fsencode(self.path))} bytes; "
                              f"a Unix socket path holds at most {SOCKET_MAX}: choose a shorter one")
        if not isinstance(self.mode, int) or not 0 <= self.mode <= 0o777:
            raise ConfigError(f"daemon.sockets: mode of tenant {self.tenant!r} must be an octal "
                              f"string like \"0660\", got {self.mode!r}")


@dataclasses.dataclass(frozen=True)
class MetricsConfig:
    """Where the Prometheus endpoint listens: ``""`` (off, the default), ``"HOST:PORT"`` with
    a loopback HOST (``127.0.0.1``, ``localhost``, ``[::1]``), or ``"unix:/abs/path"``.

    NOTE: off by default: a fixed default port would make two daemons on one host (or a test
    suite's daemons) fight over it; the sample config shows the line to turn it on. Loopback
    only: the numbers name tenants and models, and the unit denies other addresses anyway.
    """

    listen: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.listen, str):
            raise ConfigError(f"daemon.metrics.listen must be a string, got {self.listen!r}")
        if self.listen:
            self.address()  # validates

    def address(self) -> tuple[str, int] | str:
        """``(host, port)`` for TCP, the socket path for ``unix:``.

        Raises ConfigError: not one of the forms above.
        """
        listen = self.listen
        if listen.startswith("unix:"):
            path = listen[5:]
            if not os.path.isabs(path) or len(os.fsencode(path)) > SOCKET_MAX:
                raise ConfigError(f"daemon.metrics.listen: {listen!r} needs an absolute socket "
                                  f"path of at most {SOCKET_MAX} bytes after unix:")
            return path
        host, sep, port = listen.rpartition(":")
        host = host.strip("[]")
        if not sep or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"daemon.metrics.listen must be \"\" (off), \"127.0.0.1:PORT\" or "
                              f"\"unix:/path\", got {listen!r}")
        if host not in LOOPBACK:
            raise ConfigError(f"daemon.metrics.listen: {host!r} is not a loopback address; the "
                              f"endpoint listens on {', '.join(LOOPBACK)} only (put a proxy in "
                              f"front to reach it from elsewhere)")
        return host, int(port)


@dataclasses.dataclass(frozen=True)
class EventsConfig:
    """The KV-event journal (``prefixd.daemon.event_journal``): ``ring_size`` events kept per
    tenant for a subscriber that reconnects with ``from_sequence_number``; a subscriber more
    than ``subscriber_queue`` events behind is ended RESOURCE_EXHAUSTED (it resumes from the
    ring). Memory, per tenant: ``ring_size + subscriber_queue`` events (the second part is a
    replay's slack: ``EventJournal``), each holding its run's hashes (~50 bytes a block, a
    Python ``bytes`` each) and, for a commit's ``stored``, its token ids (4 bytes a token):
    ~1.1 KB an event with gsp requests (``bench/engine.py``'s), so ~75 MB at the defaults."""

    ring_size: int = 65536
    subscriber_queue: int = 4096

    def __post_init__(self) -> None:
        for key, low, high in (("ring_size", 16, 1 << 24), ("subscriber_queue", 1, 1 << 20)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ConfigError(f"daemon.events.{key} must be an integer in {low}..{high}, "
                                  f"got {value!r}")


@dataclasses.dataclass(frozen=True)
class DaemonConfig:
    """Every daemon setting and its default (see the module docstring for the TOML form)."""

    socket: str | None = None  # None: the default place (``default_socket``)
    lease_s: float = 10.0
    max_message_bytes: int = 64 << 20
    max_concurrent_calls: int = 1024
    log_level: str = "info"
    shutdown_grace_s: float = 10.0
    limits: Limits = Limits()
    sockets: tuple[TenantSocket, ...] = ()
    metrics: MetricsConfig = MetricsConfig()
    events: EventsConfig = EventsConfig()
    kv_events: KVEventsConfig = KVEventsConfig()

    def __post_init__(self) -> None:
        for key in ("lease_s", "shutdown_grace_s"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"daemon.{key} must be a number of seconds > 0, got {value!r}")
        for key in ("max_message_bytes", "max_concurrent_calls"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"daemon.{key} must be an integer >= 1, got {value!r}")
        if self.max_message_bytes < 1 << 16:
            raise ConfigError(f"daemon.max_message_bytes must be at least 65536, got "
                              f"{self.max_message_bytes}")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"daemon.log_level must be one of {', '.join(LOG_LEVELS)}, got "
                              f"{self.log_level!r}")
        for key in ("sequences_per_session", "sequences_per_tenant", "blocks_per_session",
                    "blocks_per_tenant", "pools_per_tenant", "max_block_bytes"):
            value = getattr(self.limits, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"daemon.limits.{key} must be an integer >= 1, got {value!r}")

    def socket_paths(self, engine: EngineConfig, state_dir: str) -> list[TenantSocket]:
        """One socket per configured tenant, in tenant order.

        Raises ConfigError: a socket names an unknown tenant, or two tenants share a path.
        """
        first = self.socket or default_socket(state_dir)
        explicit = {s.tenant: s for s in self.sockets}
        names = [t.name for t in engine.tenants]
        for tenant in explicit:
            if tenant not in names:
                raise ConfigError(f"[[daemon.sockets]] names tenant {tenant!r}, which is not in "
                                  f"[[engine.tenants]] ({', '.join(names)})")
        out = []
        for i, name in enumerate(names):
            if name in explicit:
                out.append(explicit[name])
            else:
                path = first if i == 0 else os.path.join(os.path.dirname(first), f"{name}.sock")
                out.append(TenantSocket(name, path))
        paths = [s.path for s in out]
        if len(set(paths)) != len(paths):
            raise ConfigError(f"two tenants share a socket path in {paths}: give each its own")
        return out
