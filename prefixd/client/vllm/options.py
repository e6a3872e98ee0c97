"""The connector's settings, from ``kv_connector_extra_config`` (keys in the package docstring)."""

from __future__ import annotations

import dataclasses

from prefixd.client.breaker import DEFAULT_REQUEST_TIMEOUT_MS

DURABILITIES = ("index", "crash", "power")
KNOWN_KEYS = ("prefixd.socket", "prefixd.durability", "prefixd.model_id", "prefixd.timeout_s",
              "prefixd.request_timeout_ms", "prefixd.retry_s", "prefixd.log_level")


@dataclasses.dataclass(frozen=True)
class ConnectorOptions:
    """Validated on construction.

    ``socket``: the daemon's Unix socket. ``durability``: what a commit waits for
    (``index``, ``crash``, ``power``; DESIGN.md "What an acknowledgement promises").
    ``model_id``: the pool's model id (None: the model vLLM was given). ``timeout_s``: deadline
    of Attach (made off vLLM's threads) and of the worker's wait for it at start.
    ``request_timeout_ms``: deadline of every call on vLLM's engine thread (Open, Commit,
    Release, the worker's lease checks); a miss trips the session's breaker (every call a miss
    at once until a background probe sees the daemon answer). ``retry_s``: the most seconds
    between two attempts to attach while no daemon answers. ``log_level``: the level of the handler the
    connector adds to its logger when nothing else handles it ("" adds none).

    Raises:
        ValueError: a missing socket, an unknown key or durability, a non-positive time.
    """

    socket: str
    durability: str = "crash"
    model_id: str | None = None
    timeout_s: float = 30.0
    request_timeout_ms: float = DEFAULT_REQUEST_TIMEOUT_MS
    retry_s: float = 2.0
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if not self.socket:
            raise ValueError("kv_connector_extra_config needs 'prefixd.socket': the path of the prefixd "
                             "daemon's Unix socket (prefixctl status --socket PATH checks it)")
        if self.durability not in DURABILITIES:
            raise ValueError(f"'prefixd.durability' must be one of {DURABILITIES}, got {self.durability!r}")
        if not self.request_timeout_ms > 0:
            raise ValueError(f"'prefixd.request_timeout_ms' must be > 0, got {self.request_timeout_ms!r}")
        if not self.timeout_s > 0 or not self.retry_s > 0:
            raise ValueError(f"'prefixd.timeout_s' and 'prefixd.retry_s' must be > 0, got "
                             f"{self.timeout_s!r} and {self.retry_s!r}")

    @classmethod
    def from_extra_config(cls, extra: dict | None) -> "ConnectorOptions":
        """From vLLM's ``kv_connector_extra_config`` (keys not starting with ``prefixd.`` are
        left to others, unknown ``prefixd.`` keys are refused: a typo must not pass silently)."""
        extra = dict(extra or {})
        unknown = sorted(k for k in extra if k.startswith("prefixd.") and k not in KNOWN_KEYS)
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config keys {unknown}; known: {list(KNOWN_KEYS)}")
        model_id = extra.get("prefixd.model_id")
        return cls(socket=str(extra.get("prefixd.socket") or ""),
                   durability=str(extra.get("prefixd.durability", "crash")),
                   model_id=str(model_id) if model_id else None,
                   timeout_s=float(extra.get("prefixd.timeout_s", 30.0)),
                   request_timeout_ms=float(extra.get("prefixd.request_timeout_ms", DEFAULT_REQUEST_TIMEOUT_MS)),
                   retry_s=float(extra.get("prefixd.retry_s", 2.0)),
                   log_level=str(extra.get("prefixd.log_level", "INFO")))
