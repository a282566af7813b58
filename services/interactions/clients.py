"""The interactions service's outbound adapters: the orchestrator (bindings, resume, expire)
over gRPC and an OAuth token endpoint over HTTP."""

from __future__ import annotations

from typing import Any

import grpc
import httpx2
from google.protobuf import json_format

from services.interactions.service import Binding
from tether.convert import EVENT_FIELDS, status_from_proto, status_to_proto
from tether.errors import FailedPrecondition, Unavailable, from_rpc_error
from tether.v1 import common_pb2, events_pb2, orchestrator_pb2, orchestrator_pb2_grpc


def _event(type_: str, payload: dict[str, Any]) -> events_pb2.RunEvent:
    event = events_pb2.RunEvent(type=type_)
    json_format.ParseDict(payload, getattr(event, EVENT_FIELDS[type_]))
    return event


class GrpcResumer:
    """Learns what runs wait on, and resumes and expires them, through the orchestrator."""

    def __init__(self, stub: orchestrator_pb2_grpc.OrchestratorServiceStub) -> None:
        self._stub = stub

    async def binding(self, tenant_id: str, run_id: str) -> Binding:
        """What the run is parked on, and its lease."""
        try:
            response = await self._stub.LookupBinding(
                orchestrator_pb2.LookupBindingRequest(tenant_id=tenant_id, run_id=run_id)
            )
        except grpc.aio.AioRpcError as exc:
            error = from_rpc_error(exc)
            if isinstance(error, Unavailable):
                # Nothing was resolved: which pause the run is on is the orchestrator's to say.
                raise Unavailable(
                    "the orchestrator is unreachable, so the run's pause cannot be resolved "
                    "now; nothing was recorded, try again shortly"
                ) from exc
            raise error from exc
        status = status_from_proto(response.status)
        return Binding(
            status.value if status is not None else "",
            response.waiting_interaction_id,
            response.lease_epoch,
        )

    async def resume(
        self,
        tenant_id: str,
        run_id: str,
        from_status: str,
        event: tuple[str, dict[str, Any]],
        interaction_id: str,
    ) -> bool:
        """Queue a run parked on `interaction_id` once."""
        try:
            response = await self._stub.ResumeRun(
                orchestrator_pb2.ResumeRunRequest(
                    tenant_id=tenant_id,
                    run_id=run_id,
                    from_status=status_to_proto(from_status),
                    event=_event(*event),
                    interaction_id=interaction_id,
                )
            )
        except grpc.aio.AioRpcError as exc:
            # The resolution is stored; the sweep delivers it once the orchestrator is back.
            raise from_rpc_error(exc) from exc
        return bool(response.resumed)

    async def expire(
        self,
        tenant_id: str,
        run_id: str,
        from_status: str,
        error: dict[str, Any],
        event: tuple[str, dict[str, Any]],
        interaction_id: str,
    ) -> bool:
        """Fail a run whose pause on `interaction_id` expired."""
        try:
            response = await self._stub.ExpireWaitingRun(
                orchestrator_pb2.ExpireWaitingRunRequest(
                    tenant_id=tenant_id,
                    run_id=run_id,
                    from_status=status_to_proto(from_status),
                    error=common_pb2.ErrorInfo(
                        code=error["code"],
                        message=error["message"],
                        retryable=bool(error.get("retryable")),
                    ),
                    event=_event(*event),
                    interaction_id=interaction_id,
                )
            )
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from exc
        return bool(response.expired)


class HttpTokenExchange:
    """Exchanges authorisation codes at an OAuth token endpoint."""

    def __init__(self, token_urls: dict[str, str], client_id: str) -> None:
        self._urls = token_urls
        self._client_id = client_id

    async def exchange(self, provider: str, code: str) -> tuple[str, float, list[str]]:
        """(access token, lifetime s, scopes) for `code`."""
        url = self._urls.get(provider)
        if url is None:
            raise Unavailable(f"no token endpoint is configured for {provider}")
        try:
            async with httpx2.AsyncClient(timeout=10.0) as client:
                response = await client.post(
                    url,
                    data={
                        "grant_type": "authorization_code",
                        "code": code,
                        "client_id": self._client_id,
                    },
                )
        except httpx2.HTTPError as exc:
            raise Unavailable(f"the {provider} token endpoint is unreachable") from exc
        if response.status_code >= 400:
            raise FailedPrecondition(
                f"the {provider} token endpoint refused the code; start the consent again",
                code="oauth_code_refused",
            )
        body = response.json()
        return (
            str(body["access_token"]),
            float(body.get("expires_in", 3600)),
            str(body.get("scope", "")).split(),
        )
