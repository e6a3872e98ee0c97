"""``[daemon.kv_events]``: KV events on ZMQ in vLLM's wire format, for KV-aware routers::

    [daemon.kv_events]                    # off unless endpoint is set
    endpoint = "tcp://127.0.0.1:5557"     # the first tenant's PUB socket ("ipc:///run/...")
    replay_endpoint = "tcp://127.0.0.1:5567"  # its ROUTER for replays ("" none)
    topic = ""                            # "" the tenant's name
    buffer_batches = 10000                # batches kept per tenant for a replay
    hwm = 10000                           # batches one subscriber's queue holds (ZMQ SNDHWM)

Every tenant gets its own publisher (its own sockets, sequence numbers and replay buffer), so
no tenant's events reach another's subscribers. The endpoints above are the first tenant's
(in ``[[engine.tenants]]`` order); tenant ``i`` gets the tcp port plus ``i`` (as vLLM offsets
its data-parallel ranks), or for ``ipc://`` / ``inproc://`` the path with ``_<tenant>``
appended. See ``prefixd.daemon.kv_publisher`` and docs/events.md.
"""

from __future__ import annotations

import dataclasses

from prefixd.config.errors import ConfigError

SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclasses.dataclass(frozen=True)
class TenantEndpoints:
    """One tenant's publisher: where it binds and the topic of its messages."""

    tenant: str
    endpoint: str
    replay_endpoint: str  # "" none
    topic: str


@dataclasses.dataclass(frozen=True)
class KVEventsConfig:
    """The ZMQ publisher's settings (see the module docstring); off while ``endpoint`` is ""."""

    endpoint: str = ""
    replay_endpoint: str = ""
    topic: str = ""
    buffer_batches: int = 10000
    hwm: int = 10000

    def __post_init__(self) -> None:
        for key in ("endpoint", "replay_endpoint", "topic"):
            if not isinstance(getattr(self, key), str):
                raise ConfigError(f"daemon.kv_events.{key} must be a string, got "
                                  f"{getattr(self, key)!r}")
        for key in ("endpoint", "replay_endpoint"):
            value = getattr(self, key)
            if value:
                _check_endpoint(f"daemon.kv_events.{key}", value)
        if self.replay_endpoint and not self.endpoint:
            raise ConfigError("daemon.kv_events.replay_endpoint is set but endpoint is not: set "
                              "endpoint (the PUB socket) too, or neither")
        for key in ("buffer_batches", "hwm"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1 << 20:
                raise ConfigError(f"daemon.kv_events.{key} must be an integer in 1..{1 << 20}, "
                                  f"got {value!r}")

    @property
    def enabled(self) -> bool:
        return bool(self.endpoint)

    def tenants(self, names: list[str]) -> list[TenantEndpoints]:
        """Each tenant's endpoints and topic, in ``names``' order (the first gets them as set).

        Raises ConfigError: two tenants (or a PUB and a ROUTER) would share an endpoint.
        """
        out = [TenantEndpoints(name, _offset(self.endpoint, i, name),
                               _offset(self.replay_endpoint, i, name) if self.replay_endpoint
                               else "", self.topic or name)
               for i, name in enumerate(names)]
        bound = [e.endpoint for e in out] + [e.replay_endpoint for e in out if e.replay_endpoint]
        if len(set(bound)) != len(bound):
            raise ConfigError(f"daemon.kv_events: the tenants' endpoints overlap ({bound}): "
                              f"tenant i binds the tcp port plus i, so leave a gap of at least "
                              f"{len(names)} ports between endpoint and replay_endpoint")
        return out


def _check_endpoint(key: str, value: str) -> None:
    if not value.startswith(SCHEMES):
        raise ConfigError(f"{key} must start with one of {', '.join(SCHEMES)}, got {value!r}")
    if value.startswith("tcp://"):
        host, sep, port = value[6:].rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"{key} must be \"tcp://HOST:PORT\" with a port in 1..65535 (the "
                              f"daemon binds it), got {value!r}")
    elif len(value.split("://", 1)[1]) == 0:
        raise ConfigError(f"{key} {value!r} names no path")


def _offset(endpoint: str, index: int, tenant: str) -> str:
    """Tenant ``index``'s endpoint: the tcp port plus ``index``, else ``_<tenant>`` appended."""
    if index == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        if int(port) + index > 65535:
            raise ConfigError(f"daemon.kv_events: tenant {tenant!r} would bind port "
                              f"{int(port) + index} (the port of {endpoint!r} plus {index}): "
                              f"choose a lower port")
        return f"{base}:{int(port) + index}"
    return f"{endpoint}_{tenant}"
