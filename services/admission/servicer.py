"""Admission's gRPC edge: protobuf in, domain calls, protobuf out."""

from __future__ import annotations

import grpc

from services.admission.adapters import event_to_proto, normalise
from services.admission.service import Admitter, Disposition
from tether import telemetry
from tether.convert import run_to_proto
from tether.limits import check_request
from tether.telemetry import metrics, tracing
from tether.v1 import admission_pb2, admission_pb2_grpc, common_pb2

_DISPOSITIONS = {
    Disposition.CREATED: common_pb2.DISPOSITION_CREATED,
    Disposition.ATTACHED: common_pb2.DISPOSITION_ATTACHED,
    Disposition.REPLAYED: common_pb2.DISPOSITION_REPLAYED,
    Disposition.RETRIED: common_pb2.DISPOSITION_RETRIED,
}


class AdmissionServicer(admission_pb2_grpc.AdmissionServiceServicer):
    """Implements tether.v1.AdmissionService."""

    def __init__(self, admitter: Admitter) -> None:
        self._admitter = admitter

    async def Admit(  # gRPC method name
        self, request: admission_pb2.AdmitRequest, context: grpc.aio.ServicerContext
    ) -> admission_pb2.AdmitResponse:
        check_request(request)
        event = normalise(request)
        outcome = await self._admitter.admit(event, traceparent=_traceparent(context))
        if telemetry.on:
            metrics.admitted(outcome.disposition.value, event.tenant_id)
        return admission_pb2.AdmitResponse(
            disposition=_DISPOSITIONS[outcome.disposition],
            run=run_to_proto(outcome.run),
            event=event_to_proto(event),
        )


def _traceparent(context: grpc.aio.ServicerContext) -> str | None:
    """The trace context a new run is stored with: this call's own span while telemetry is on
    (every later span of the run descends from it), else the one its caller sent, if any."""
    if telemetry.on:
        return tracing.traceparent() or None
    return tracing.incoming(context) or None
