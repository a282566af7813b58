"""The orchestrator's gRPC edge: run reads, the facts interactions may know and cancel requests;
the worker-facing calls are in `worker_edge.py`."""

from __future__ import annotations

import json
from datetime import UTC

import grpc

from services.orchestrator.agent_render import AgentRenders
from services.orchestrator.agents import Agents
from services.orchestrator.catalog import ToolCatalog
from services.orchestrator.channel_statuses import channel_statuses_of
from services.orchestrator.execution import Execution
from services.orchestrator.knowledge import Knowledge
from services.orchestrator.model_limit_edge import model_limit_writes
from services.orchestrator.rate_limits import ModelLimits
from services.orchestrator.repositories import channel_statuses as statuses_repo
from services.orchestrator.repositories.agents import Published, Version
from services.orchestrator.retention import Retention
from services.orchestrator.service import Runs
from services.orchestrator.webhooks import Subscriptions
from services.orchestrator.webhooks_edge import WebhookRpcs
from services.orchestrator.work import Work, WorkSettings
from services.orchestrator.worker_edge import ExecutionServicer, lease_response
from tether.convert import (
    attempt_to_proto,
    document_to_proto,
    event_to_proto,
    part_to_proto,
    run_to_proto,
    status_from_proto,
    status_to_proto,
    turn_to_proto,
)
from tether.convert.catalog import cataloged_to_proto
from tether.convert.configs import routing_to_proto
from tether.convert.deliveries import delivery_to_proto
from tether.domain import Run, RunRouting
from tether.errors import InvalidArgument
from tether.states import RunStatus
from tether.targets import TargetPolicy
from tether.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc
from tether.visibility import Viewer


def _statuses(values: list[int]) -> list[RunStatus]:
    out = []
    for value in values:
        status = status_from_proto(value)
        if status is None:
            raise InvalidArgument(f"unknown run status filter {value}")
        out.append(status)
    return out


def _routed(run: Run, routing: RunRouting | None) -> common_pb2.Run:
    """`run` showing the routing decision it is pinned to, when it has one."""
    message = run_to_proto(run)
    if routing is not None:
        message.routing.CopyFrom(routing_to_proto(routing))
    return message


def _actor(actor: orchestrator_pb2.AgentActor) -> dict[str, str]:
    return {"key_id": actor.key_id, "principal_id": actor.principal_id}


def _agent_version(found: Version) -> common_pb2.AgentVersion:
    message = common_pb2.AgentVersion(
        name=found.name,
        version=found.version,
        spec=found.written,
        normalised=json.dumps(found.normalised, sort_keys=True),
        digest=found.digest,
    )
    message.created_at.FromDatetime(found.created_at.astimezone(UTC))
    return message


def _agent_summary(found: Published, default: bool) -> common_pb2.AgentSummary:
    message = common_pb2.AgentSummary(
        name=found.name, published_version=found.published_version, default=default
    )
    message.updated_at.FromDatetime(found.updated_at.astimezone(UTC))
    return message


def _viewer(
    request: orchestrator_pb2.LookupRunRequest
    | orchestrator_pb2.SearchRunsRequest
    | orchestrator_pb2.ReadEventsRequest
    | orchestrator_pb2.RequestCancellationRequest
    | orchestrator_pb2.LookupAttemptsRequest,
) -> Viewer:
    return Viewer(request.tenant_id, request.principal_id, request.all_runs)


class OrchestratorServicer(
    WebhookRpcs, ExecutionServicer, orchestrator_pb2_grpc.OrchestratorServiceServicer
):
    """Implements tether.v1.OrchestratorService."""

    def __init__(
        self,
        runs: Runs,
        execution: Execution,
        work: WorkSettings,
        retention: Retention,
        webhooks: Subscriptions,
        target_policy: TargetPolicy | None = None,
        model_limits: ModelLimits | None = None,
    ) -> None:
        WebhookRpcs.__init__(self, webhooks)
        self._runs = runs
        # Model rate limits (TETHER_MODEL_LIMITS): None, the workers reserve nothing.
        self.model_limits = model_limits
        # Handled even with no limits kept: a worker's reservation may reach this replica after
        # a reconnect from one that keeps them.
        writes = {**self._work_writes(), **model_limit_writes(model_limits)}
        self._execution = execution
        self._knowledge = Knowledge(execution.engine)
        self._retention = retention
        self._catalog = ToolCatalog(execution.engine)
        self._agents = Agents(execution.engine, self._catalog, target_policy)
        self.work = Work(
            execution.engine,
            execution.claims,
            lease_response,
            execution.attempts.release,
            writes,
            replica_id=execution.publisher.wake_marker,
            lease_ttl_s=work.lease_ttl_s,
            keepalive_interval_s=work.keepalive_interval_s,
            progress_deadline_s=work.progress_deadline_s,
            announce=self._catalog.announce,
            let_go=None if model_limits is None else model_limits.let_go,
            leases_held_for=None if model_limits is None else model_limits.leases_held_for,
        )
        self._renders = AgentRenders(
            execution.engine, self._agents, self._knowledge, self.work, work.render_timeout_s
        )

    async def LookupRun(
        self, request: orchestrator_pb2.LookupRunRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.LookupRunResponse:
        view = await self._runs.lookup(
            _viewer(request), request.run_id, include_superseded=request.include_superseded
        )
        run = _routed(view.run, view.routing)
        if view.delivery is not None:
            run.delivery.CopyFrom(delivery_to_proto(view.delivery))
        if view.held_by_cap is not None:
            run.waiting_for.CopyFrom(
                common_pb2.WaitingFor(reason="tenant_concurrency", cap=view.held_by_cap)
            )
        elif view.run.status == RunStatus.QUEUED.value:
            agent_cap = await self._execution.claims.held.cap_reached(
                view.run.tenant_id, view.run.run_id
            )
            if agent_cap is not None:
                run.waiting_for.CopyFrom(
                    common_pb2.WaitingFor(reason="agent_concurrency", cap=agent_cap)
                )
        return orchestrator_pb2.LookupRunResponse(
            run=run, parts=[part_to_proto(p) for p in view.parts]
        )

    async def LookupRunFacts(
        self, request: orchestrator_pb2.LookupRunFactsRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.LookupRunFactsResponse:
        asker = request.WhichOneof("asker")
        if asker == "viewer":
            viewer = request.viewer
            held_epoch = request.held_epoch if request.HasField("held_epoch") else None
            run, lease_held = await self._runs.facts(
                Viewer(viewer.tenant_id, viewer.principal_id, viewer.all_runs),
                request.run_id,
                held_epoch,
            )
            # Only the lease holder's interactions need the policy and the secrets.
            approval_policy, secrets = "", tuple[str, ...]()
        elif asker == "lease_epoch":
            run, approval_policy, secrets = await self._runs.leased(
                request.run_id, request.lease_epoch
            )
            lease_held = True  # the read itself is fenced by the lease
        else:
            raise InvalidArgument("name who asks: a viewer or a lease_epoch")
        return orchestrator_pb2.LookupRunFactsResponse(
            tenant_id=run.tenant_id,
            session_id=run.session_id,
            owner_principal_id=run.owner_principal_id or "",
            status=status_to_proto(run.status),
            lease_epoch=run.lease_epoch,
            waiting_interaction_id=run.waiting_interaction_id or "",
            lease_held=lease_held,
            approval_policy=approval_policy,
            secret_names=secrets,
        )

    async def LookupBinding(
        self, request: orchestrator_pb2.LookupBindingRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.LookupBindingResponse:
        """Deprecated (see the proto): the previous release's interactions replicas ask this."""
        run = await self._runs.visible(Viewer(request.tenant_id, "", True), request.run_id)
        return orchestrator_pb2.LookupBindingResponse(
            status=status_to_proto(run.status),
            waiting_interaction_id=run.waiting_interaction_id or "",
            lease_epoch=run.lease_epoch,
        )

    async def SearchRuns(
        self, request: orchestrator_pb2.SearchRunsRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.SearchRunsResponse:
        if request.page_size < 0:
            raise InvalidArgument("page_size must not be negative")
        found, token = await self._runs.search(
            _viewer(request),
            statuses=_statuses(list(request.statuses)),
            conversation_id=request.conversation_id,
            page_size=request.page_size,
            page_token=request.page_token,
            created_after=(
                request.created_after.ToDatetime(tzinfo=UTC)
                if request.HasField("created_after")
                else None
            ),
            tree_root_run_id=request.tree_root_run_id,
        )
        return orchestrator_pb2.SearchRunsResponse(
            runs=[_routed(run, routing) for run, routing in found],
            next_page_token=token,
        )

    async def LookupAttempts(
        self, request: orchestrator_pb2.LookupAttemptsRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.LookupAttemptsResponse:
        record = await self._runs.execution_record(_viewer(request), request.run_id)
        return orchestrator_pb2.LookupAttemptsResponse(
            run=run_to_proto(record.run),
            attempts=[attempt_to_proto(a) for a in record.attempts],
            turns=[turn_to_proto(t) for t in record.turns],
            lineage=[run_to_proto(r) for r in record.lineage],
        )

    async def DeleteTenantRuns(
        self, request: orchestrator_pb2.DeleteTenantRunsRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.DeleteTenantRunsResponse:
        if not request.tenant_id:
            raise InvalidArgument("tenant_id is required")
        removed, remaining = await self._retention.delete_tenant(request.tenant_id)
        return orchestrator_pb2.DeleteTenantRunsResponse(removed=removed, remaining=remaining)

    async def RecordChannelStatuses(
        self,
        request: orchestrator_pb2.RecordChannelStatusesRequest,
        context: grpc.aio.ServicerContext,
    ) -> orchestrator_pb2.RecordChannelStatusesResponse:
        tenant_id, channel_id, statuses = channel_statuses_of(request)
        async with self._execution.engine.begin() as conn:
            recorded = await statuses_repo.record(conn, tenant_id, channel_id, statuses)
        return orchestrator_pb2.RecordChannelStatusesResponse(recorded=recorded)

    async def ReadEvents(
        self, request: orchestrator_pb2.ReadEventsRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.ReadEventsResponse:
        if request.after_seq < 0 or request.limit < 0:
            raise InvalidArgument("after_seq and limit must not be negative")
        sliced = await self._runs.read_events(
            _viewer(request),
            request.run_id,
            request.after_seq,
            request.limit,
            request.include_state,
        )
        response = orchestrator_pb2.ReadEventsResponse(
            events=[
                event_to_proto(e.run_id, e.seq, e.type, e.payload, e.created_at, format=e.format)
                for e in sliced.events
            ],
            has_more=sliced.has_more,
        )
        if sliced.view is not None:
            response.run.CopyFrom(run_to_proto(sliced.view.run))
            if sliced.view.delivery is not None:
                response.run.delivery.CopyFrom(delivery_to_proto(sliced.view.delivery))
            response.parts.extend(part_to_proto(p) for p in sliced.view.parts)
        return response

    async def RequestCancellation(
        self,
        request: orchestrator_pb2.RequestCancellationRequest,
        context: grpc.aio.ServicerContext,
    ) -> orchestrator_pb2.RequestCancellationResponse:
        outcome = await self._runs.request_cancellation(
            _viewer(request), request.run_id, request.reason
        )
        return orchestrator_pb2.RequestCancellationResponse(
            run=run_to_proto(outcome.run), changed=outcome.changed
        )

    async def StoreDocument(
        self, request: orchestrator_pb2.StoreDocumentRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.StoreDocumentResponse:
        row = await self._knowledge.add(
            request.tenant_id, request.principal_id, request.title, request.content
        )
        return orchestrator_pb2.StoreDocumentResponse(document=document_to_proto(row))

    async def FindDocuments(
        self, request: orchestrator_pb2.FindDocumentsRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.FindDocumentsResponse:
        rows, token = await self._knowledge.page(
            request.tenant_id, request.page_size, request.page_token
        )
        return orchestrator_pb2.FindDocumentsResponse(
            documents=[document_to_proto(r) for r in rows], next_page_token=token
        )

    async def DeleteDocument(
        self, request: orchestrator_pb2.DeleteDocumentRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.DeleteDocumentResponse:
        await self._knowledge.remove(request.tenant_id, request.document_id)
        return orchestrator_pb2.DeleteDocumentResponse()

    async def PublishAgent(
        self, request: orchestrator_pb2.PublishAgentRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.PublishAgentResponse:
        base = request.base_version if request.HasField("base_version") else None
        applied = await self._agents.apply(
            request.actor.tenant_id, request.spec, _actor(request.actor), base
        )
        return orchestrator_pb2.PublishAgentResponse(
            name=applied.name, version=applied.version, created=applied.created
        )

    async def LookupAgent(
        self, request: orchestrator_pb2.LookupAgentRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.LookupAgentResponse:
        version = request.version if request.HasField("version") else None
        shown = await self._agents.show(request.tenant_id, request.name, version)
        return orchestrator_pb2.LookupAgentResponse(
            agent=_agent_version(shown.version),
            published_version=shown.published_version,
            default=shown.default,
        )

    async def SearchAgents(
        self, request: orchestrator_pb2.SearchAgentsRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.SearchAgentsResponse:
        listed = await self._agents.listed(request.tenant_id)
        return orchestrator_pb2.SearchAgentsResponse(
            agents=[_agent_summary(one.agent, one.default) for one in listed]
        )

    async def LookupAgentVersions(
        self,
        request: orchestrator_pb2.LookupAgentVersionsRequest,
        context: grpc.aio.ServicerContext,
    ) -> orchestrator_pb2.LookupAgentVersionsResponse:
        found = await self._agents.versions(request.tenant_id, request.name)
        return orchestrator_pb2.LookupAgentVersionsResponse(
            versions=[_agent_version(v) for v in found]
        )

    async def RepublishAgent(
        self, request: orchestrator_pb2.RepublishAgentRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.RepublishAgentResponse:
        if request.to_version < 1:
            raise InvalidArgument("to_version must be a version number, 1 or more")
        applied = await self._agents.rollback(
            request.actor.tenant_id,
            request.name,
            request.to_version,
            _actor(request.actor),
            base_version=request.base_version if request.HasField("base_version") else None,
        )
        return orchestrator_pb2.RepublishAgentResponse(name=applied.name, version=applied.version)

    async def ChooseDefaultAgent(
        self,
        request: orchestrator_pb2.ChooseDefaultAgentRequest,
        context: grpc.aio.ServicerContext,
    ) -> orchestrator_pb2.ChooseDefaultAgentResponse:
        await self._agents.set_default(request.actor.tenant_id, request.name, _actor(request.actor))
        return orchestrator_pb2.ChooseDefaultAgentResponse(name=request.name)

    async def DeleteAgent(
        self, request: orchestrator_pb2.DeleteAgentRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.DeleteAgentResponse:
        version = await self._agents.remove(
            request.actor.tenant_id, request.name, _actor(request.actor)
        )
        return orchestrator_pb2.DeleteAgentResponse(name=request.name, version=version)

    async def ListCatalogTools(
        self, request: orchestrator_pb2.ListCatalogToolsRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.ListCatalogToolsResponse:
        return orchestrator_pb2.ListCatalogToolsResponse(
            tools=[cataloged_to_proto(t) for t in await self._catalog.listed()]
        )

    async def AgentRender(
        self, request: orchestrator_pb2.AgentRenderRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.AgentRenderResponse:
        rendered = await self._renders.render(
            request.tenant_id,
            request.name,
            request.message,
            version=request.version if request.HasField("version") else None,
            source=request.source,
            channel=request.channel,
            actor_id=request.actor_id,
        )
        return orchestrator_pb2.AgentRenderResponse(
            agent=rendered.agent,
            version=rendered.version,
            request_json=json.dumps(rendered.request, ensure_ascii=False),
            estimated_input_tokens=rendered.estimated_input_tokens,
            estimated_cost_micros=rendered.estimated_cost_micros,
            routed_agent=rendered.routed_agent,
            routed_version=rendered.routed_version,
            warnings=rendered.warnings,
        )
