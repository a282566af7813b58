"""The HTTP/SSE bridge, version 2: one JSON, protobuf's JSON mapping, for browsers and web/.

Every request body is the gRPC request message in protobuf's JSON mapping (path parameters
override its fields); every response body is `MessageToDict` of the gRPC response, and every
SSE frame's data `MessageToDict` of the stream's message. A request authenticates with its
`Authorization` header (an API key or a token) or, without one, the console's session cookie
(services.gateway.http.signin). The routes, frames and rules are written down in docs/bridge-v2.md.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from google.protobuf import json_format
from google.protobuf.message import Message

from services.gateway.auth import Authenticator, KeyWatch
from services.gateway.http.common import (
    CallContext,
    conversation_stream,
    header,
    non_negative,
    read_body,
    run_stream,
    serve_sse,
    sse_frame,
    time_query,
)
from services.gateway.http.errors import error_body
from services.gateway.http.signin import credential
from services.gateway.live.run_list import LiveRuns
from services.gateway.live.streams import Streams
from tether import agent_spec
from tether.apikeys import Principal
from tether.errors import InvalidArgument, TetherError
from tether.limits import INT32_MAX, check_request
from tether.v1 import common_pb2, gateway_pb2
from tether.visibility import viewer_of

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_G = gateway_pb2
# (method, path, rpc, request type, whether the body is read): each a unary call whose path
# parameters fill the request's fields of the same name.
_UNARY: tuple[tuple[str, str, str, type[Message], bool], ...] = (
    ("POST", "/v2/messages", "SendMessage", _G.SendMessageRequest, True),
    ("GET", "/v2/runs/{run_id}/attempts", "GetRunAttempts", _G.GetRunAttemptsRequest, False),
    ("POST", "/v2/runs/{run_id}/cancel", "CancelRun", _G.CancelRunRequest, True),
    ("POST", "/v2/runs/{run_id}/retry", "RetryRun", _G.RetryRunRequest, True),
    ("GET", "/v2/runs/{run_id}/pending-question", "GetPendingQuestion",
     _G.GetPendingQuestionRequest, False),
    ("GET", "/v2/runs/{run_id}/pending-approval", "GetPendingApproval",
     _G.GetPendingApprovalRequest, False),
    ("GET", "/v2/runs/{run_id}/pending-connection", "GetPendingConnection",
     _G.GetPendingConnectionRequest, False),
    ("POST", "/v2/runs/{run_id}/answer", "AnswerQuestion", _G.AnswerQuestionRequest, True),
    ("POST", "/v2/runs/{run_id}/decision", "DecideApproval", _G.DecideApprovalRequest, True),
    ("POST", "/v2/runs/{run_id}/connection", "CompleteConnection",
     _G.CompleteConnectionRequest, True),
    ("POST", "/v2/documents", "AddDocument", _G.AddDocumentRequest, True),
    ("DELETE", "/v2/documents/{document_id}", "RemoveDocument", _G.RemoveDocumentRequest, False),
    ("POST", "/v2/secrets", "AddSecret", _G.AddSecretRequest, True),
    ("GET", "/v2/secrets", "ListSecrets", _G.ListSecretsRequest, False),
    ("DELETE", "/v2/secrets/{name}", "RemoveSecret", _G.RemoveSecretRequest, False),
    ("POST", "/v2/channels", "AddChannel", _G.AddChannelRequest, True),
    ("POST", "/v2/tenants/{tenant_id}", "SetTenant", _G.SetTenantRequest, True),
    ("GET", "/v2/channels", "ListChannels", _G.ListChannelsRequest, False),
    ("GET", "/v2/channels/{channel_id}", "GetChannel", _G.GetChannelRequest, False),
    ("DELETE", "/v2/channels/{channel_id}", "RemoveChannel", _G.RemoveChannelRequest, False),
    ("POST", "/v2/channels/{channel_id}/rotate-secret", "RotateChannelSecret",
     _G.RotateChannelSecretRequest, True),
    ("POST", "/v2/webhooks/subscriptions", "AddWebhook", _G.AddWebhookRequest, True),
    ("GET", "/v2/webhooks/subscriptions", "ListWebhooks", _G.ListWebhooksRequest, False),
    ("DELETE", "/v2/webhooks/subscriptions/{subscription_id}", "RemoveWebhook",
     _G.RemoveWebhookRequest, False),
    ("POST", "/v2/webhooks/deliveries/{delivery_id}/redeliver", "RedeliverWebhook",
     _G.RedeliverWebhookRequest, True),
    ("POST", "/v2/agents", "ApplyAgent", _G.ApplyAgentRequest, True),
    ("GET", "/v2/agents", "ListAgents", _G.ListAgentsRequest, False),
    ("GET", "/v2/agents/{name}/versions", "ListAgentVersions", _G.ListAgentVersionsRequest,
     False),
    ("POST", "/v2/agents/{name}/rollback", "RollbackAgent", _G.RollbackAgentRequest, True),
    ("POST", "/v2/agents/{name}/default", "SetDefaultAgent", _G.SetDefaultAgentRequest, True),
    ("DELETE", "/v2/agents/{name}", "RemoveAgent", _G.RemoveAgentRequest, False),
    ("GET", "/v2/tools", "ListTools", _G.ListToolsRequest, False),
    ("POST", "/v2/agents/{name}/render", "RenderAgent", _G.RenderAgentRequest, True),
    ("POST", "/v2/schedules", "AddSchedule", _G.AddScheduleRequest, True),
    ("GET", "/v2/schedules", "ListSchedules", _G.ListSchedulesRequest, False),
    ("POST", "/v2/schedules/{schedule_id}/pause", "PauseSchedule", _G.PauseScheduleRequest,
     True),
    ("POST", "/v2/schedules/{schedule_id}/resume", "ResumeSchedule", _G.ResumeScheduleRequest,
     True),
    ("DELETE", "/v2/schedules/{schedule_id}", "RemoveSchedule", _G.RemoveScheduleRequest,
     False),
)  # fmt: skip
# RPCs whose success creates something: 201.
_CREATES = frozenset({"AddDocument", "AddSecret", "AddChannel", "AddWebhook", "AddSchedule"})


def to_json(message: Message) -> dict[str, Any]:
    """A message in protobuf's JSON mapping, as every v2 body and frame carries it."""
    data: dict[str, Any] = json_format.MessageToDict(message)
    return data


def _flag(request: web.Request, name: str, default: bool) -> bool:
    value = request.query.get(name)
    if value is None:
        return default
    if value not in ("true", "false", "1", "0"):
        raise InvalidArgument(f"{name} must be true or false; got {value[:40]!r}")
    return value in ("true", "1")


def _statuses(request: web.Request) -> list[common_pb2.RunStatus.ValueType]:
    statuses = []
    for name in request.query.getall("status", []):
        known = common_pb2.RunStatus.keys()
        if name not in known or name == "RUN_STATUS_UNSPECIFIED":
            raise InvalidArgument(
                f"unknown status {name[:40]!r}; use RUN_STATUS_QUEUED, RUN_STATUS_RUNNING, ..."
            )
        statuses.append(common_pb2.RunStatus.Value(name))
    return statuses


def _error_frame(exc: TetherError) -> bytes:
    """v2's last frame of a stream ended early: the cursor to resume from beside the error."""
    data = error_body(exc)
    resume = exc.details.get("resume")
    if resume is not None:
        data["resume"] = str(resume)
    return sse_frame("error", data)


def _run_frame(item: gateway_pb2.StreamRunResponse) -> bytes:
    if item.HasField("snapshot"):
        return sse_frame("snapshot", to_json(item))
    seq = item.event.seq
    return sse_frame(item.event.type, to_json(item), str(seq) if seq else None)


def _conversation_frame(item: gateway_pb2.StreamConversationResponse) -> bytes:
    event_id = item.cursor if item.event.seq else None
    return sse_frame(item.event.type, to_json(item), event_id)


def _runs_frame(item: gateway_pb2.StreamRunsResponse) -> bytes:
    if item.HasField("page"):
        return sse_frame("runs", to_json(item.page))
    if item.HasField("run"):
        return sse_frame("run", to_json(item))
    return b": keepalive\n\n"  # a comment: every SSE reader skips it


class BridgeV2:
    """Routes /v2 requests to the gateway's servicer and streams."""

    def __init__(
        self, servicer: Any, streams: Streams, live_runs: LiveRuns, auth: Authenticator
    ) -> None:
        self._servicer = servicer
        self._streams = streams
        self._live_runs = live_runs
        self._auth = auth

    def add_routes(self, app: web.Application) -> None:
        """Add the /v2 call and stream routes to `app`."""
        router = app.router
        router.add_get("/v2/runs", self.list_runs)
        router.add_get("/v2/runs/live", self.live_runs)
        router.add_get("/v2/runs/{run_id}", self.get_run)
        router.add_get("/v2/runs/{run_id}/events", self.run_events)
        router.add_get("/v2/conversations/{conversation_id}/events", self.conversation_events)
        router.add_get("/v2/documents", self.list_documents)
        # Before /v2/agents/{name}: the schema's path is not an agent's.
        router.add_get("/v2/agents/schema", self.agent_schema)
        router.add_get("/v2/agents/{name}", self.get_agent)
        router.add_get(
            "/v2/webhooks/subscriptions/{subscription_id}/deliveries", self.webhook_deliveries
        )
        for method, path, rpc, request_type, has_body in _UNARY:
            router.add_route(method, path, self._unary(rpc, request_type, has_body=has_body))

    @staticmethod
    def _context(request: web.Request) -> CallContext:
        return CallContext(request, credential(request))

    async def _call(self, rpc: str, message: Message, request: web.Request) -> web.Response:
        response = await getattr(self._servicer, rpc)(message, self._context(request))
        created = rpc in _CREATES or (rpc == "ApplyAgent" and response.created)
        return web.json_response(to_json(response), status=201 if created else 200)

    def _unary(self, rpc: str, request_type: type[Message], *, has_body: bool) -> Handler:
        async def handle(request: web.Request) -> web.StreamResponse:
            message = request_type()
            if has_body:
                await read_body(request, message)
            for name, value in request.match_info.items():
                setattr(message, name, value)
            if rpc == "SendMessage" and not message.event_id:  # type: ignore[attr-defined]
                message.event_id = header(request, "Idempotency-Key")  # type: ignore[attr-defined]
            return await self._call(rpc, message, request)

        return handle

    async def get_run(self, request: web.Request) -> web.Response:
        message = gateway_pb2.GetRunRequest(
            run_id=request.match_info["run_id"],
            include_superseded=_flag(request, "includeSuperseded", False),
        )
        return await self._call("GetRun", message, request)

    async def list_runs(self, request: web.Request) -> web.Response:
        query = request.query
        message = gateway_pb2.ListRunsRequest(
            statuses=_statuses(request),
            conversation_id=query.get("conversationId", ""),
            page_size=non_negative(query.get("pageSize", "0"), "pageSize", INT32_MAX),
            page_token=query.get("pageToken", ""),
            tree_root_run_id=query.get("treeRootRunId", ""),
        )
        time_query(query, "createdAfter", message.created_after)
        return await self._call("ListRuns", message, request)

    async def list_documents(self, request: web.Request) -> web.Response:
        query = request.query
        message = gateway_pb2.ListDocumentsRequest(
            page_size=non_negative(query.get("pageSize", "0"), "pageSize", INT32_MAX),
            page_token=query.get("pageToken", ""),
        )
        return await self._call("ListDocuments", message, request)

    async def get_agent(self, request: web.Request) -> web.Response:
        message = gateway_pb2.GetAgentRequest(name=request.match_info["name"])
        version = request.query.get("version")
        if version is not None:
            message.version = non_negative(version, "version", INT32_MAX)
        return await self._call("GetAgent", message, request)

    async def webhook_deliveries(self, request: web.Request) -> web.Response:
        message = gateway_pb2.ListWebhookDeliveriesRequest(
            subscription_id=request.match_info["subscription_id"],
            page_size=non_negative(request.query.get("pageSize", "0"), "pageSize", INT32_MAX),
        )
        return await self._call("ListWebhookDeliveries", message, request)

    async def agent_schema(self, request: web.Request) -> web.Response:
        """The agent document's JSON Schema. Public, as a published format is: it holds no
        tenant's data, and an editor or a CI job validates documents with it before holding a
        key."""
        return web.json_response(agent_spec.schema())

    # -- streams --------------------------------------------------------------------------------

    async def _open(self, request: web.Request, method: str) -> tuple[Principal, KeyWatch]:
        metadata = self._context(request).metadata()
        principal = await self._auth.authenticate(metadata, method)
        return principal, KeyWatch(self._auth, metadata, method)

    async def run_events(self, request: web.Request) -> web.StreamResponse:
        principal, key_watch = await self._open(request, "StreamRun")
        deltas = _flag(request, "deltas", True)
        items = run_stream(
            request, self._streams, viewer_of(principal), key_watch, include_deltas=deltas
        )
        return await serve_sse(
            request, items, _run_frame, wait_for_first=True, error_frame=_error_frame
        )

    async def conversation_events(self, request: web.Request) -> web.StreamResponse:
        principal, key_watch = await self._open(request, "StreamConversation")
        deltas = _flag(request, "deltas", True)
        items = conversation_stream(
            request, self._streams, viewer_of(principal), key_watch, include_deltas=deltas
        )
        return await serve_sse(
            request, items, _conversation_frame, wait_for_first=False, error_frame=_error_frame
        )

    async def live_runs(self, request: web.Request) -> web.StreamResponse:
        principal, key_watch = await self._open(request, "StreamRuns")
        query = request.query
        opened = gateway_pb2.StreamRunsRequest(
            statuses=_statuses(request),
            conversation_id=query.get("conversationId", ""),
            page_size=non_negative(query.get("pageSize", "0"), "pageSize", INT32_MAX),
        )
        check_request(opened)
        items = self._live_runs.items(viewer_of(principal), opened, key_watch=key_watch)
        return await serve_sse(
            request, items, _runs_frame, wait_for_first=True, error_frame=_error_frame
        )
