"""Typed exceptions of the client library, one per gRPC status the daemon answers with.

Every failure a ``Session`` call raises is a :class:`PrefixdError` carrying the daemon's message
(which says what to do) and the status code. The classes follow the README's "Errors" table:

============================  ====================  =============================================
status                        exception             typical cause
============================  ====================  =============================================
INVALID_ARGUMENT              InvalidArgument       bad tokens, wrong layout, bad KV shape/dtype
NOT_FOUND                     NotFound              unknown (or another tenant's) session/sequence
RESOURCE_EXHAUSTED            ResourceExhausted     pool full of referenced blocks, quota, size
FAILED_PRECONDITION           FailedPrecondition    wrong state: a shared block, a stale epoch
UNAVAILABLE                   Unavailable           daemon recovering, stopping, or not running
DATA_LOSS                     DataLoss              the daemon's log or disk failed
DEADLINE_EXCEEDED             DeadlineExceeded      the call's timeout passed
anything else                 PrefixdError          (INTERNAL: a daemon bug; see its log)
============================  ====================  =============================================

Two more come from the client itself: :class:`SharedBlockError` (a mapped write that would
touch a committed block, refused before any byte moves) and :class:`DaemonRestarted` (the
daemon restarted under a call that cannot be safely retried; the session has already
re-attached and reclaimed its sequences when it is raised).

NOTE: ``InvalidArgument`` is also a ``ValueError`` and ``NotFound`` a ``LookupError``, so callers
that already catch the builtin kinds keep working.
"""

from __future__ import annotations

import grpc


class PrefixdError(Exception):
    """A refused or failed call: ``code`` is the gRPC status, ``message`` the daemon's text."""

    code: grpc.StatusCode | None = None

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        name = self.code.name if self.code is not None else "CLIENT"
        return f"{name}: {self.message}"


class InvalidArgument(PrefixdError, ValueError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(PrefixdError, LookupError):
    code = grpc.StatusCode.NOT_FOUND


class ResourceExhausted(PrefixdError):
    """The pool is full of referenced blocks, a quota is reached, or a message is too large.
    An engine queues or preempts and tries again; nothing already granted was taken away."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(PrefixdError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class SharedBlockError(FailedPrecondition):
    """A write would change a committed (shared) block; refused locally on the mapped path and
    by the daemon (FAILED_PRECONDITION) on the rpc path."""


class Unavailable(PrefixdError):
    code = grpc.StatusCode.UNAVAILABLE


class DataLoss(PrefixdError):
    code = grpc.StatusCode.DATA_LOSS


class DeadlineExceeded(PrefixdError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class MappingError(PrefixdError):
    """A pool descriptor could not be mapped (missing file, permission, another file under the
    path, CUDA handle without CUDA). The session falls back to the KV rpcs."""


class DaemonRestarted(PrefixdError):
    """The daemon restarted (or ended the session) under a call that is not safe to repeat.

    When this is raised the session has already attached again and reclaimed its sequences:
    ``reclaimed`` lists the live ``Sequence`` objects, each updated in place (new id and block
    table; ``num_tokens`` cut back to what survived, ``lost`` when nothing did). Redo the work
    of the failed call against them.
    """

    code = grpc.StatusCode.UNAVAILABLE

    def __init__(self, message: str, reclaimed: list | None = None) -> None:
        super().__init__(message)
        self.reclaimed = list(reclaimed or [])


_BY_CODE: dict[grpc.StatusCode, type[PrefixdError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DATA_LOSS: DataLoss,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
}


def from_status(code: grpc.StatusCode, message: str) -> PrefixdError:
    """The typed exception for a status and its message."""
    kind = _BY_CODE.get(code, PrefixdError)
    return kind(message or f"the daemon answered {code.name} without a message", code)


def from_rpc_error(exc: grpc.RpcError) -> PrefixdError:
    """The typed exception for a failed call (``grpc.RpcError`` raised by a stub)."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return from_status(code or grpc.StatusCode.UNKNOWN, details or "")
