"""Admission's gRPC edge: protobuf in, domain calls, protobuf out."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from services.admission.adapters import event_to_proto, normalise
from services.admission.retention import Retention
from services.admission.schedules import Actor, NewSchedule, Schedule, Schedules
from services.admission.service import Admitter, Disposition
from services.admission.stream import AdmitStreams, StreamTiming
from tether import telemetry
from tether.apikeys import OPERATOR_ID
from tether.convert import run_to_proto, timestamp
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

    def __init__(
        self,
        admitter: Admitter,
        retention: Retention,
        timing: StreamTiming,
        schedules: Schedules,
    ) -> None:
        self._admitter = admitter
        self._retention = retention
        self._schedules = schedules
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

    async def CreateSchedule(  # gRPC method name
        self, request: admission_pb2.CreateScheduleRequest, context: grpc.aio.ServicerContext
    ) -> admission_pb2.CreateScheduleResponse:
        new = NewSchedule.parse(
            agent=request.agent,
            cron=request.cron,
            timezone=request.timezone,
            message=request.message,
            overlap=request.overlap,
            catch_up=request.catch_up,
            catch_up_window_s=request.catch_up_window_seconds,
        )
        created = await self._schedules.create(_actor(request.actor), new)
        return admission_pb2.CreateScheduleResponse(schedule=schedule_to_proto(created))

    async def SearchSchedules(  # gRPC method name
        self, request: admission_pb2.SearchSchedulesRequest, context: grpc.aio.ServicerContext
    ) -> admission_pb2.SearchSchedulesResponse:
        if not request.tenant_id:
            raise InvalidArgument("tenant_id is required")
        found = await self._schedules.list(request.tenant_id)
        return admission_pb2.SearchSchedulesResponse(
            schedules=[schedule_to_proto(one) for one in found]
        )

    async def SetSchedulePaused(  # gRPC method name
        self, request: admission_pb2.SetSchedulePausedRequest, context: grpc.aio.ServicerContext
    ) -> admission_pb2.SetSchedulePausedResponse:
        moved = await self._schedules.set_paused(
            _actor(request.actor), request.schedule_id, request.paused
        )
        return admission_pb2.SetSchedulePausedResponse(schedule=schedule_to_proto(moved))

    async def DeleteSchedule(  # gRPC method name
        self, request: admission_pb2.DeleteScheduleRequest, context: grpc.aio.ServicerContext
    ) -> admission_pb2.DeleteScheduleResponse:
        await self._schedules.remove(_actor(request.actor), request.schedule_id)
        return admission_pb2.DeleteScheduleResponse(schedule_id=request.schedule_id)


def _actor(actor: admission_pb2.ScheduleActor) -> Actor:
    if not actor.tenant_id or not actor.principal_id:
        raise InvalidArgument("caller identity is missing; calls must come through the gateway")
    return Actor(actor.tenant_id, actor.principal_id, actor.key_id)


def schedule_to_proto(schedule: Schedule) -> common_pb2.Schedule:
    """The wire form of a schedule (its next fire time unset while paused)."""
    out = common_pb2.Schedule(
        schedule_id=schedule.schedule_id,
        agent=schedule.agent,
        cron=schedule.cron.expression,
        timezone=schedule.cron.timezone,
        message=schedule.message,
        overlap=schedule.overlap,
        catch_up=schedule.catch_up.policy,
        catch_up_window_seconds=schedule.catch_up.window_s,
        created_by=schedule.principal_id,
        created_at=timestamp(schedule.created_at),
        paused=schedule.paused,
        last_run_id=schedule.last_run_id or "",
    )
    if not schedule.paused:
        out.next_fire_at.FromDatetime(schedule.next_fire_at)
    if schedule.last_tick_at is not None:
        out.last_tick_at.FromDatetime(schedule.last_tick_at)
    return out


def _traceparent(context: grpc.aio.ServicerContext) -> str | None:
    """The trace context a new run is stored with: this call's own span while telemetry is on
    (every later span of the run descends from it), else the one its caller sent, if any."""
    if telemetry.on:
        return tracing.traceparent() or None
    return tracing.incoming(context) or None
