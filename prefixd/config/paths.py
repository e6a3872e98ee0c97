"""Where prefixd puts things when nothing says otherwise: the daemon's state directory and
socket (the XDG base directories), and the socket a client looks for.

The daemon (``prefixd serve`` without ``--state-dir`` / ``--socket``) and the client
(``prefixctl`` without ``--socket``) both read these, so the two always agree.
"""

from __future__ import annotations

import os

SOCKET_ENV = "PREFIXD_SOCKET"


def default_state_dir() -> str:
    """``$XDG_STATE_HOME/prefixd``, else ``~/.local/state/prefixd``."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "prefixd")


def default_socket(state_dir: str) -> str:
    """The daemon's first socket: ``$XDG_RUNTIME_DIR/prefixd/prefixd.sock``, else
    ``<state_dir>/prefixd.sock``."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return os.path.join(runtime, "prefixd", "prefixd.sock")
    return os.path.join(state_dir, "prefixd.sock")


def client_socket() -> str:
    """Where a client looks for the daemon: ``$PREFIXD_SOCKET`` (a daemon started with
    ``--socket``), else where ``prefixd serve`` listens by default (``default_socket`` of
    ``default_state_dir``)."""
    explicit = os.environ.get(SOCKET_ENV)
    if explicit:
        return explicit
    return default_socket(default_state_dir())
