"""What the gateway makes of an AdmitStream that failed to open: admission's own refusals as
they are, a replica without the stream as a reason to call unary, anything else an outage."""

from __future__ import annotations

import grpc
from grpc.aio import Metadata

from services.gateway.grpc.admissions import _Unimplemented, refusal
from tether.errors import CODE_METADATA_KEY, FailedPrecondition, Unauthenticated, Unavailable


def _failed(code: grpc.StatusCode, details: str, error_code: str = "") -> grpc.aio.AioRpcError:
    trailers = Metadata((CODE_METADATA_KEY, error_code)) if error_code else Metadata()
    return grpc.aio.AioRpcError(code, Metadata(), trailers, details)


def test_admissions_own_refusals_keep_their_status_and_words() -> None:
    mismatch = refusal(
        _failed(
            grpc.StatusCode.FAILED_PRECONDITION,
            "the gateway speaks AdmitStream protocol 2 and this admission replica speaks 1",
            "protocol_version_mismatch",
        )
    )
    assert isinstance(mismatch, FailedPrecondition)
    assert mismatch.code == "protocol_version_mismatch" and "protocol 2" in mismatch.message
    unknown = refusal(_failed(grpc.StatusCode.UNAUTHENTICATED, "who are you", "unauthenticated"))
    assert isinstance(unknown, Unauthenticated)


def test_a_replica_without_the_stream_means_unary_calls() -> None:
    assert isinstance(refusal(_failed(grpc.StatusCode.UNIMPLEMENTED, "")), _Unimplemented)


def test_what_admission_did_not_choose_is_an_outage_never_an_internal_error() -> None:
    # grpc's client reports a write racing the server's early end as INTERNAL (grpc#36066).
    for code, details in (
        (grpc.StatusCode.INTERNAL, "Internal error from Core"),
        (grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses"),
        (grpc.StatusCode.CANCELLED, "Received RST_STREAM"),
    ):
        outage = refusal(_failed(code, details))
        assert isinstance(outage, Unavailable), code
        assert outage.code == "dependency_unavailable"
        assert "the admission service is unreachable" in outage.message
