"""Admission's gRPC edge: protobuf in, domain calls, protobuf out."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from services.admission.adapters import event_to_proto, normalise
from services.admission.retention import Retention
from services.admission.service import Admitter, Disposition
from services.admission.stream import AdmitStreams, StreamTiming
from tether import telemetry
from tether.apikeys import OPERATOR_ID
from tether.convert import run_to_proto
from tether.errors import InvalidArgument
from tether.limits import check_request
from tether.telemetry import metrics, tracing
from tether.v1 import admission_pb2, admission_pb2_grpc, common_pb2
from tether.visibility import Viewer

# Admit's method name: a call on an AdmitStream is traced as an Admit.
_ADMIT = "tether.v1.AdmissionService/Admit"
_DISPOSITIONS = {
    Disposition.CREATED: common_pb2.DISPOSITION_CREATED,
    Disposition.ATTACHED: common_pb2.DISPOSITION_ATTACHED,
    Disposition.REPLAYED: common_pb2.DISPOSITION_REPLAYED,
    Disposition.RETRIED: common_pb2.DISPOSITION_RETRIED,
}


class AdmissionServicer(admission_pb2_grpc.AdmissionServiceServicer):
    """Implements tether.v1.AdmissionService."""

    def __init__(self, admitter: Admitter, retention: Retention, timing: StreamTiming) -> None:
        self._admitter = admitter
        self._retention = retention
        self.streams = AdmitStreams(self._streamed, timing)

    async def Admit(  # gRPC method name
        self, request: admission_pb2.AdmitRequest, context: grpc.aio.ServicerContext
    ) -> admission_pb2.AdmitResponse:
        return await self._admit(request, _traceparent(context))

    async def AdmitStream(  # gRPC method name
        self,
        request_iterator: AsyncIterator[admission_pb2.AdmitStreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[admission_pb2.AdmitStreamResponse]:
        async for response in self.streams.serve(request_iterator):
            yield response

    async def _streamed(
        self, request: admission_pb2.AdmitRequest, traceparent: str
    ) -> admission_pb2.AdmitResponse:
        """One call of an AdmitStream: Admit's own work, in a span of Admit's name continuing
        the caller's trace (the call's message carries it: a stream carries many calls)."""
        if not telemetry.on:
            return await self._admit(request, traceparent or None)
        with tracing.server_span(_ADMIT, traceparent):
            return await self._admit(request, tracing.traceparent() or None)

    async def _admit(
        self, request: admission_pb2.AdmitRequest, traceparent: str | None
    ) -> admission_pb2.AdmitResponse:
        check_request(request)
        event = normalise(request)
        outcome = await self._admitter.admit(event, traceparent=traceparent)
        if telemetry.on:
            metrics.admitted(outcome.disposition.value, event.tenant_id)
        return admission_pb2.AdmitResponse(
            disposition=_DISPOSITIONS[outcome.disposition],
            run=run_to_proto(outcome.run),
            event=event_to_proto(event),
        )

    async def ReclaimRun(  # gRPC method name
        self, request: admission_pb2.ReclaimRunRequest, context: grpc.aio.ServicerContext
    ) -> admission_pb2.ReclaimRunResponse:
        viewer = Viewer(request.tenant_id, request.principal_id, request.all_runs)
        actor = (
            {"kind": "key", "key_id": request.actor_key_id, "principal_id": request.principal_id}
            if request.actor_key_id
            else {"kind": OPERATOR_ID}
        )
        outcome = await self._admitter.retry(viewer, request.run_id, actor)
        return admission_pb2.ReclaimRunResponse(
            disposition=_DISPOSITIONS[outcome.disposition], run=run_to_proto(outcome.run)
        )

    async def DeleteTenantEvents(  # gRPC method name
        self, request: admission_pb2.DeleteTenantEventsRequest, context: grpc.aio.ServicerContext
    ) -> admission_pb2.DeleteTenantEventsResponse:
        if not request.tenant_id:
            raise InvalidArgument("tenant_id is required")
        removed, remaining = await self._retention.delete_tenant(request.tenant_id)
        return admission_pb2.DeleteTenantEventsResponse(removed=removed, remaining=remaining)


def _traceparent(context: grpc.aio.ServicerContext) -> str | None:
    """The trace context a new run is stored with: this call's own span while telemetry is on
    (every later span of the run descends from it), else the one its caller sent, if any."""
    if telemetry.on:
        return tracing.traceparent() or None
    return tracing.incoming(context) or None
