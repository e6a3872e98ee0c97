"""Failures as gRPC statuses: every error the engine raises on purpose maps to one code with a
message a person can act on (the README's "Errors" table lists them).

Handlers raise ``RpcFailure`` for what they check themselves, and let the engine's typed errors
through; ``status_of`` turns either into ``(code, message)``. Anything else is a bug: it is logged
with its traceback and answered INTERNAL, and the daemon keeps serving.
"""

from __future__ import annotations

import logging

import grpc

from prefixd.cache.errors import InvalidTokens, OutOfBlocks, UnknownSequence
from prefixd.config.errors import ConfigError
from prefixd.engine.errors import DurabilityError, SharedBlockError, UnknownTenantError
from prefixd.storage.errors import StorageError
from prefixd.wal.errors import WalClosedError, WalError, WalFailedError, WalNoSpaceError

log = logging.getLogger(__name__)

Code = grpc.StatusCode


class RpcFailure(Exception):
    """A refusal with its gRPC status code; the message goes to the client as is."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        self.code = code
        self.message = message
        super().__init__(f"{code.name}: {message}")


def invalid(message: str) -> RpcFailure:
    return RpcFailure(Code.INVALID_ARGUMENT, message)


def not_found(message: str) -> RpcFailure:
    return RpcFailure(Code.NOT_FOUND, message)


def exhausted(message: str) -> RpcFailure:
    return RpcFailure(Code.RESOURCE_EXHAUSTED, message)


def precondition(message: str) -> RpcFailure:
    return RpcFailure(Code.FAILED_PRECONDITION, message)


def unavailable(message: str) -> RpcFailure:
    return RpcFailure(Code.UNAVAILABLE, message)


# Most specific first: the first isinstance match wins.
_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (RpcFailure, Code.UNKNOWN),  # placeholder; its own code is used
    (OutOfBlocks, Code.RESOURCE_EXHAUSTED),
    (UnknownSequence, Code.NOT_FOUND),
    (InvalidTokens, Code.INVALID_ARGUMENT),
    (SharedBlockError, Code.FAILED_PRECONDITION),
    (UnknownTenantError, Code.NOT_FOUND),
    (ConfigError, Code.INVALID_ARGUMENT),
    (WalClosedError, Code.UNAVAILABLE),
    (WalNoSpaceError, Code.RESOURCE_EXHAUSTED),  # a checkpoint not taken; the log is intact
    (WalFailedError, Code.DATA_LOSS),
    (DurabilityError, Code.DATA_LOSS),
    (WalError, Code.DATA_LOSS),
    (StorageError, Code.DATA_LOSS),
    (ValueError, Code.INVALID_ARGUMENT),
    (TypeError, Code.INVALID_ARGUMENT),
)


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status to answer for ``exc``; an unexpected one is logged with its traceback."""
    if isinstance(exc, RpcFailure):
        return exc.code, exc.message
    for kind, code in _CODES[1:]:
        if isinstance(exc, kind):
            if code is Code.DATA_LOSS:
                log.error("storage or log failure error=%r", exc)
                return code, (f"{exc}: the daemon can no longer make this pool durable; see its "
                              f"log, fix the disk and restart it")
            return code, str(exc)
    log.error("internal error (a bug) error=%r", exc, exc_info=exc)
    return Code.INTERNAL, f"internal error ({type(exc).__name__}): see the daemon's log"
