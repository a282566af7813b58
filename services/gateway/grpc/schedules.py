"""The gateway's schedule RPCs: a tenant's recurring runs, which admission owns and fires. Every
call authenticates first and names the caller's tenant and principal, never the body's; a
schedule is added only for an agent the tenant has (the orchestrator owns agents: asked here,
before admission stores anything)."""

from __future__ import annotations

import grpc

from services.gateway.grpc.callers import Callers
from tether.apikeys import Principal
from tether.errors import InvalidArgument, NotFound
from tether.v1 import (
    admission_pb2,
    admission_pb2_grpc,
    gateway_pb2,
    orchestrator_pb2,
    orchestrator_pb2_grpc,
)


def _actor(principal: Principal) -> admission_pb2.ScheduleActor:
    return admission_pb2.ScheduleActor(
        tenant_id=principal.tenant_id,
        principal_id=principal.principal_id,
        key_id=principal.key_id,
    )


class ScheduleRpcs:
    """Implements the schedules part of tether.v1.GatewayService."""

    def __init__(
        self,
        callers: Callers,
        admission: admission_pb2_grpc.AdmissionServiceStub,
        orchestrator: orchestrator_pb2_grpc.OrchestratorServiceStub,
    ) -> None:
        self._callers = callers
        self._admission = admission
        self._orchestrator = orchestrator

    async def AddSchedule(
        self, request: gateway_pb2.AddScheduleRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.AddScheduleResponse:
        principal = await self._callers.authenticated(context, "AddSchedule", request)
        try:
            await self._orchestrator.LookupAgent(
                orchestrator_pb2.LookupAgentRequest(
                    tenant_id=principal.tenant_id, name=request.agent
                )
            )
        except NotFound:
            raise InvalidArgument(
                f"agent {request.agent!r} does not exist in this tenant; apply it first "
                "(tether agents apply) or name one of `tether agents list`",
                details={"field": "agent"},
            ) from None
        created = await self._admission.CreateSchedule(
            admission_pb2.CreateScheduleRequest(
                actor=_actor(principal),
                agent=request.agent,
                cron=request.cron,
                timezone=request.timezone,
                message=request.message,
                overlap=request.overlap,
                catch_up=request.catch_up,
                catch_up_window_seconds=request.catch_up_window_seconds,
            )
        )
        return gateway_pb2.AddScheduleResponse(
            schedule_id=created.schedule.schedule_id, schedule=created.schedule
        )

    async def ListSchedules(
        self, request: gateway_pb2.ListSchedulesRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.ListSchedulesResponse:
        principal = await self._callers.authenticated(context, "ListSchedules", request)
        found = await self._admission.SearchSchedules(
            admission_pb2.SearchSchedulesRequest(tenant_id=principal.tenant_id)
        )
        return gateway_pb2.ListSchedulesResponse(schedules=found.schedules)

    async def PauseSchedule(
        self, request: gateway_pb2.PauseScheduleRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.PauseScheduleResponse:
        principal = await self._callers.authenticated(context, "PauseSchedule", request)
        moved = await self._admission.SetSchedulePaused(
            admission_pb2.SetSchedulePausedRequest(
                actor=_actor(principal), schedule_id=request.schedule_id, paused=True
            )
        )
        return gateway_pb2.PauseScheduleResponse(schedule=moved.schedule)

    async def ResumeSchedule(
        self, request: gateway_pb2.ResumeScheduleRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.ResumeScheduleResponse:
        principal = await self._callers.authenticated(context, "ResumeSchedule", request)
        moved = await self._admission.SetSchedulePaused(
            admission_pb2.SetSchedulePausedRequest(
                actor=_actor(principal), schedule_id=request.schedule_id, paused=False
            )
        )
        return gateway_pb2.ResumeScheduleResponse(schedule=moved.schedule)

    async def RemoveSchedule(
        self, request: gateway_pb2.RemoveScheduleRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.RemoveScheduleResponse:
        principal = await self._callers.authenticated(context, "RemoveSchedule", request)
        await self._admission.DeleteSchedule(
            admission_pb2.DeleteScheduleRequest(
                actor=_actor(principal), schedule_id=request.schedule_id
            )
        )
        return gateway_pb2.RemoveScheduleResponse(schedule_id=request.schedule_id)
