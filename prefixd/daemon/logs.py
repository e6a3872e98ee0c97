"""Logging fit for journald: one line per record, level first, tracebacks folded into it."""

from __future__ import annotations

import logging
import sys

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}


class OneLineFormatter(logging.Formatter):
    """``<level> <logger>: <message>`` with any traceback joined by `` | `` on the same line
    (journald adds the time and the pid; a multi-line record would become several entries)."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return text.replace("\r", "").replace("\n", " | ")


def setup_logging(level: str) -> None:
    """Route every ``prefixd`` logger to stderr, one line a record, at ``level``."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler.formatter, OneLineFormatter):
            root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(OneLineFormatter("%(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(_LEVELS.get(level, logging.INFO))
    logging.getLogger("grpc").setLevel(logging.WARNING)
