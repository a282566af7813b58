"""One small error hierarchy with stable codes.

Adapters translate foreign exceptions (asyncpg, redis, anthropic, grpc) into these where they meet
them; one server interceptor (`tether.runtime.rpc.server`) maps them to gRPC status codes, so a
caller's mistake is never reported as INTERNAL.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import grpc


class TetherError(Exception):
    """Base of every error Tether reports to a caller.

    `code` is stable and machine-readable; `message` is for a person; `details` carries
    structured context (never secrets) that travels in the gRPC trailing metadata.
    """

    status: ClassVar[grpc.StatusCode] = grpc.StatusCode.INTERNAL
    default_code: ClassVar[str] = "internal"

    def __init__(
        self, message: str, *, code: str | None = None, details: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code or self.default_code
        self.details: dict[str, Any] = dict(details or {})


class InvalidArgument(TetherError):
    """The request is malformed; sending it again unchanged will fail again."""

    status = grpc.StatusCode.INVALID_ARGUMENT
    default_code = "invalid_argument"


class NotFound(TetherError):
    """The thing does not exist, or belongs to another tenant (the two are indistinguishable)."""

    status = grpc.StatusCode.NOT_FOUND
    default_code = "not_found"


class AlreadyExists(TetherError):
    """The request conflicts with something already stored (e.g. same key, different content)."""

    status = grpc.StatusCode.ALREADY_EXISTS
    default_code = "already_exists"


class FailedPrecondition(TetherError):
    """The system is not in a state that allows this (e.g. a stale lease epoch)."""

    status = grpc.StatusCode.FAILED_PRECONDITION
    default_code = "failed_precondition"


class Aborted(TetherError):
    """A conditional write whose condition no longer holds (e.g. an apply on a version that is
    no longer the published one); nothing changed. Read again, then decide."""

    status = grpc.StatusCode.ABORTED
    default_code = "aborted"


class PermissionDenied(TetherError):
    """The caller is known but may not do this."""

    status = grpc.StatusCode.PERMISSION_DENIED
    default_code = "permission_denied"


class Unauthenticated(TetherError):
    """The caller did not prove who it is."""

    status = grpc.StatusCode.UNAUTHENTICATED
    default_code = "unauthenticated"


class ResourceExhausted(TetherError):
    """A quota or limit was reached."""

    status = grpc.StatusCode.RESOURCE_EXHAUSTED
    default_code = "resource_exhausted"


class Unavailable(TetherError):
    """A dependency is down; retrying later may succeed."""

    status = grpc.StatusCode.UNAVAILABLE
    default_code = "unavailable"

    @classmethod
    def outage(cls, dependency: str) -> Unavailable:
        """A dependency outage, in words a caller can act on: what is down, and that the same
        call may be retried (an idempotent one, with the same event id, makes one run)."""
        return cls(
            f"{dependency} is unreachable right now; the call may be retried once it is back",
            code="dependency_unavailable",
            details={"dependency": dependency},
        )


class StoredFormatTooNew(Unavailable):
    """Stored data this release cannot read whole: a newer release wrote it (a newer format, or
    a field this one does not know). Refused rather than read with a field dropped; a replica of
    the newer release reads it, so the call may be retried once the rollout is through."""

    default_code = "stored_format_too_new"


class StaleLease(FailedPrecondition):
    """A worker wrote with a lease epoch that is no longer current; it must abandon the attempt."""

    default_code = "stale_lease"


_BY_STATUS: dict[grpc.StatusCode, type[TetherError]] = {
    cls.status: cls
    for cls in (
        InvalidArgument,
        NotFound,
        AlreadyExists,
        FailedPrecondition,
        Aborted,
        PermissionDenied,
        Unauthenticated,
        ResourceExhausted,
        Unavailable,
    )
}

CODE_METADATA_KEY = "tether-error-code"


def from_status(status: grpc.StatusCode, message: str, code: str = "") -> TetherError:
    """The TetherError a service answered with: its gRPC status, its words, its stable code."""
    if code == StaleLease.default_code:
        return StaleLease(message or "stale lease", code=code)
    cls = _BY_STATUS.get(status, TetherError)
    if status in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        cls = Unavailable
    return cls(message or status.name, code=code or None)


def from_rpc_error(exc: grpc.aio.AioRpcError, service: str = "") -> TetherError:
    """Rebuild a TetherError from a failed call to another Tether service (named `service`,
    e.g. "admission": an UNAVAILABLE that service did not choose itself, such as a refused
    connection, means the service itself is unreachable)."""
    code = ""
    for key, value in exc.trailing_metadata() or ():
        if key == CODE_METADATA_KEY and isinstance(value, str):
            code = value
    unanswered = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    if service and not code and exc.code() in unanswered:
        return Unavailable.outage(f"the {service} service")
    return from_status(exc.code(), exc.details() or "", code)


_STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def from_status_number(number: int, message: str, code: str = "") -> TetherError:
    """The TetherError a stream message carries as a gRPC status code's number (a Work
    stream's acknowledgement, an AdmitStream's answer), its words and its stable code."""
    return from_status(_STATUS_BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN), message, code)
