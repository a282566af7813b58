"""The HTTP/SSE bridge, version 1: the gateway's calls and events over plain HTTP.

Deprecated: removed in 0.3.0 (tests/unit/test_removals.py fails once `version` reaches it with
this bridge still here); bridge v2 (bridge_v2.py) serves every call and stream it serves.

Nothing here decides anything: every request goes through the same servicer methods and the
same streams as gRPC, so authentication, tenancy and errors mean the same. Routes::

    GET  /v1/runs/{run_id}/events              SSE (Last-Event-ID or ?after=SEQ; ?deltas=0)
    GET  /v1/conversations/{conversation_id}/events   SSE (Last-Event-ID or ?cursor=)
    POST /v1/messages                          SendMessage (Idempotency-Key may give event_id)
    GET  /v1/runs                              ListRuns (?status=&conversation_id=&page_size=
                                               &page_token=&created_after=RFC 3339 time
                                               &tree_root_run_id=)
    GET  /v1/runs/{run_id}                     GetRun (?superseded=1: include_superseded)
    GET  /v1/runs/{run_id}/attempts            GetRunAttempts
    POST /v1/runs/{run_id}/cancel              CancelRun
    POST /v1/runs/{run_id}/retry               RetryRun
    GET  /v1/runs/{run_id}/pending-question    GetPendingQuestion (and -approval, -connection)
    POST /v1/runs/{run_id}/answer              AnswerQuestion (and /decision, /connection)
    POST /v1/keys                              CreateApiKey (JSON body as the gRPC request)
    POST /v1/keys/{key_id}/revoke              RevokeApiKey
    POST /v1/documents                         AddDocument (JSON body {"title", "content"})
    GET  /v1/documents                         ListDocuments (?page_size=&page_token=)
    DELETE /v1/documents/{document_id}         RemoveDocument
    DELETE /v1/tenants/{tenant_id}             DeleteTenant (the platform operator)

SSE frames: `event:` is the stable type name, `data:` the event as JSON (`tether.transport`),
and every durable event has `id:` (its seq; for a conversation, the cursor), so a reconnecting
EventSource resumes with Last-Event-ID. The first frame is `event: snapshot`. A stream ended
early (slow client, gateway stopping) sends `event: error` with the cursor to resume from.
Callers authenticate with `Authorization: Bearer <key>` (the platform operator names the tenant
it reads in with `Tether-Tenant: <tenant>`); errors are JSON
`{"error": {"status", "code", "message"}}` with the HTTP status of the gRPC code, malformed HTTP
included (`services.gateway.http.errors`).
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
    authorization_header,
    conversation_stream,
    header,
    non_negative,
    read_body,
    run_stream,
    serve_sse,
    sse_frame,
    time_query,
)
from services.gateway.live.streams import Streams
from tether.apikeys import Principal
from tether.convert import disposition_name, status_to_proto
from tether.errors import InvalidArgument
from tether.limits import INT32_MAX
from tether.states import RunStatus
from tether.transport import event_to_json, run_to_json, snapshot_to_json
from tether.v1 import events_pb2, gateway_pb2
from tether.visibility import viewer_of

_INTERACTIONS: tuple[tuple[str, str, str, type[Message]], ...] = (
    ("GET", "pending-question", "GetPendingQuestion", gateway_pb2.GetPendingQuestionRequest),
    ("GET", "pending-approval", "GetPendingApproval", gateway_pb2.GetPendingApprovalRequest),
    ("GET", "pending-connection", "GetPendingConnection", gateway_pb2.GetPendingConnectionRequest),
    ("POST", "answer", "AnswerQuestion", gateway_pb2.AnswerQuestionRequest),
    ("POST", "decision", "DecideApproval", gateway_pb2.DecideApprovalRequest),
    ("POST", "connection", "CompleteConnection", gateway_pb2.CompleteConnectionRequest),
)


def _deltas(request: web.Request) -> bool:
    """v1's `?deltas=`: anything but 0 or false keeps them."""
    return request.query.get("deltas", "1") not in ("0", "false")


def _message_json(message: Message) -> dict[str, Any]:
    data: dict[str, Any] = json_format.MessageToDict(message, preserving_proto_field_name=True)
    return data


def _event_frame(event: events_pb2.RunEvent, event_id: str | None = None) -> bytes:
    durable_id = event_id if event_id is not None else str(event.seq)
    return sse_frame(event.type, event_to_json(event), durable_id if event.seq else None)


def _run_frame(item: gateway_pb2.StreamRunResponse) -> bytes:
    if item.HasField("snapshot"):
        return sse_frame("snapshot", snapshot_to_json(item.snapshot.run, list(item.snapshot.parts)))
    return _event_frame(item.event)


def _conversation_frame(item: gateway_pb2.StreamConversationResponse) -> bytes:
    data = event_to_json(item.event)
    data["cursor"] = item.cursor
    return sse_frame(item.event.type, data, item.cursor if item.event.seq else None)


class BridgeV1:
    """Routes /v1 requests to the gateway's servicer and streams."""

    def __init__(self, servicer: Any, streams: Streams, auth: Authenticator) -> None:
        self._servicer = servicer
        self._streams = streams
        self._auth = auth

    def add_routes(self, app: web.Application) -> None:
        """Add the /v1 routes to `app`."""
        app.router.add_get("/v1/runs/{run_id}/events", self.run_events)
        app.router.add_get("/v1/conversations/{conversation_id}/events", self.conversation_events)
        app.router.add_post("/v1/messages", self.send_message)
        app.router.add_get("/v1/runs", self.list_runs)
        app.router.add_get("/v1/runs/{run_id}", self.get_run)
        app.router.add_get("/v1/runs/{run_id}/attempts", self.get_run_attempts)
        app.router.add_post("/v1/runs/{run_id}/cancel", self.cancel_run)
        app.router.add_post("/v1/runs/{run_id}/retry", self.retry_run)
        app.router.add_delete("/v1/tenants/{tenant_id}", self.delete_tenant)
        app.router.add_post("/v1/keys", self.create_key)
        app.router.add_post("/v1/keys/{key_id}/revoke", self.revoke_key)
        app.router.add_post("/v1/documents", self.add_document)
        app.router.add_get("/v1/documents", self.list_documents)
        app.router.add_delete("/v1/documents/{document_id}", self.remove_document)
        for method, path, rpc, request_type in _INTERACTIONS:
            app.router.add_route(
                method, f"/v1/runs/{{run_id}}/{path}", self._interaction(rpc, request_type)
            )

    def _key_watch(self, request: web.Request, method: str) -> KeyWatch:
        return KeyWatch(self._auth, {"authorization": authorization_header(request)}, method)

    async def _principal(self, request: web.Request, method: str) -> Principal:
        return await self._auth.authenticate(
            {"authorization": authorization_header(request)}, method
        )

    # -- unary ----------------------------------------------------------------------------------

    async def send_message(self, request: web.Request) -> web.Response:
        message = await read_body(request, gateway_pb2.SendMessageRequest())
        if not message.event_id:
            message.event_id = header(request, "Idempotency-Key")
        response = await self._servicer.SendMessage(message, CallContext(request))
        return web.json_response(
            {
                "disposition": disposition_name(response.disposition),
                "run": run_to_json(response.run),
            }
        )

    async def get_run(self, request: web.Request) -> web.Response:
        response = await self._servicer.GetRun(
            gateway_pb2.GetRunRequest(
                run_id=request.match_info["run_id"],
                include_superseded=request.query.get("superseded", "0") not in ("0", "false"),
            ),
            CallContext(request),
        )
        return web.json_response(snapshot_to_json(response.run, list(response.parts)))

    async def list_runs(self, request: web.Request) -> web.Response:
        query = request.query
        statuses = []
        for name in query.getall("status", []):
            try:
                statuses.append(status_to_proto(RunStatus(name)))
            except ValueError as exc:
                raise InvalidArgument(f"unknown status {name!r}") from exc
        listed = gateway_pb2.ListRunsRequest(
            statuses=statuses,
            conversation_id=query.get("conversation_id", ""),
            page_size=non_negative(query.get("page_size", "0"), "page_size", INT32_MAX),
            page_token=query.get("page_token", ""),
            tree_root_run_id=query.get("tree_root_run_id", ""),
        )
        time_query(query, "created_after", listed.created_after)
        response = await self._servicer.ListRuns(listed, CallContext(request))
        return web.json_response(
            {
                "runs": [run_to_json(run) for run in response.runs],
                "next_page_token": response.next_page_token,
            }
        )

    async def get_run_attempts(self, request: web.Request) -> web.Response:
        response = await self._servicer.GetRunAttempts(
            gateway_pb2.GetRunAttemptsRequest(run_id=request.match_info["run_id"]),
            CallContext(request),
        )
        return web.json_response(
            {
                "run": run_to_json(response.run),
                "attempts": [_message_json(a) for a in response.attempts],
                "turns": [_message_json(t) for t in response.turns],
                "lineage": [run_to_json(r) for r in response.lineage],
            }
        )

    async def retry_run(self, request: web.Request) -> web.Response:
        response = await self._servicer.RetryRun(
            gateway_pb2.RetryRunRequest(run_id=request.match_info["run_id"]),
            CallContext(request),
        )
        return web.json_response(
            {
                "disposition": disposition_name(response.disposition),
                "run": run_to_json(response.run),
            }
        )

    async def delete_tenant(self, request: web.Request) -> web.Response:
        response = await self._servicer.DeleteTenant(
            gateway_pb2.DeleteTenantRequest(tenant_id=request.match_info["tenant_id"]),
            CallContext(request),
        )
        return web.json_response(
            {
                "removed": {what: int(n) for what, n in response.removed.items()},
                "deleted": response.deleted,
                "pending": response.pending,
            }
        )

    async def cancel_run(self, request: web.Request) -> web.Response:
        message = await read_body(request, gateway_pb2.CancelRunRequest())
        message.run_id = request.match_info["run_id"]
        response = await self._servicer.CancelRun(message, CallContext(request))
        return web.json_response({"run": run_to_json(response.run), "changed": response.changed})

    async def create_key(self, request: web.Request) -> web.Response:
        message = await read_body(request, gateway_pb2.CreateApiKeyRequest())
        response = await self._servicer.CreateApiKey(message, CallContext(request))
        return web.json_response(_message_json(response))

    async def revoke_key(self, request: web.Request) -> web.Response:
        message = gateway_pb2.RevokeApiKeyRequest(key_id=request.match_info["key_id"])
        response = await self._servicer.RevokeApiKey(message, CallContext(request))
        return web.json_response({"key_id": response.key_id, "revoked": response.revoked})

    async def add_document(self, request: web.Request) -> web.Response:
        message = await read_body(request, gateway_pb2.AddDocumentRequest())
        response = await self._servicer.AddDocument(message, CallContext(request))
        return web.json_response(_message_json(response), status=201)

    async def list_documents(self, request: web.Request) -> web.Response:
        query = request.query
        response = await self._servicer.ListDocuments(
            gateway_pb2.ListDocumentsRequest(
                page_size=non_negative(query.get("page_size", "0"), "page_size", INT32_MAX),
                page_token=query.get("page_token", ""),
            ),
            CallContext(request),
        )
        return web.json_response(
            {
                "documents": [_message_json(d) for d in response.documents],
                "next_page_token": response.next_page_token,
            }
        )

    async def remove_document(self, request: web.Request) -> web.Response:
        message = gateway_pb2.RemoveDocumentRequest(document_id=request.match_info["document_id"])
        response = await self._servicer.RemoveDocument(message, CallContext(request))
        return web.json_response(_message_json(response))

    def _interaction(
        self, rpc: str, request_type: type[Message]
    ) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handle(request: web.Request) -> web.Response:
            message: Any = await read_body(request, request_type())
            message.run_id = request.match_info["run_id"]
            response = await getattr(self._servicer, rpc)(message, CallContext(request))
            return web.json_response(_message_json(response))

        return handle

    # -- streams --------------------------------------------------------------------------------

    async def run_events(self, request: web.Request) -> web.StreamResponse:
        principal = await self._principal(request, "StreamRun")
        items = run_stream(
            request,
            self._streams,
            viewer_of(principal),
            self._key_watch(request, "StreamRun"),
            include_deltas=_deltas(request),
        )
        return await serve_sse(request, items, _run_frame, wait_for_first=True)

    async def conversation_events(self, request: web.Request) -> web.StreamResponse:
        principal = await self._principal(request, "StreamConversation")
        items = conversation_stream(
            request,
            self._streams,
            viewer_of(principal),
            self._key_watch(request, "StreamConversation"),
            include_deltas=_deltas(request),
        )
        return await serve_sse(request, items, _conversation_frame, wait_for_first=False)
