"""The interactions service's outbound adapters: the orchestrator (run lookups, resume,
expire) over gRPC and an OAuth token endpoint over HTTP."""

from __future__ import annotations

import httpx2

from services.interactions.domain import RunFacts
from tether.convert import error_to_proto, event_to_wire, status_from_proto, status_to_proto
from tether.domain import Event, RunError
from tether.errors import FailedPrecondition, TetherError, Unavailable
from tether.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from tether.visibility import Viewer

# The name the channel's interceptor gives the orchestrator when it does not answer.
ORCHESTRATOR = "the orchestrator service"


class GrpcOrchestrator:
    """Learns what interactions may know of runs, and resumes and expires them, through the
    orchestrator (the one authority over runs)."""

    def __init__(self, stub: orchestrator_pb2_grpc.OrchestratorServiceStub) -> None:
        self._stub = stub

    async def visible_run(
        self, viewer: Viewer, run_id: str, *, held_epoch: int | None = None
    ) -> RunFacts:
        """The run, if the viewer may see it; NotFound (the same as absent) otherwise. With
        `held_epoch`, the orchestrator also says whether that lease is live."""
        asker = orchestrator_pb2.RunViewer(**viewer.fields())
        return await self._lookup(
            orchestrator_pb2.LookupRunFactsRequest(
                run_id=run_id, viewer=asker, held_epoch=held_epoch
            )
        )

    async def leased_run(self, run_id: str, epoch: int) -> RunFacts:
        """The run, if `epoch` is its live lease; StaleLease otherwise."""
        return await self._lookup(
            orchestrator_pb2.LookupRunFactsRequest(run_id=run_id, lease_epoch=epoch)
        )

    async def _lookup(self, request: orchestrator_pb2.LookupRunFactsRequest) -> RunFacts:
        try:
            response = await self._stub.LookupRunFacts(request)
        except Unavailable as exc:
            if exc.details.get("dependency") != ORCHESTRATOR:
                raise  # it answered, naming what it lacks (e.g. its database)
            # The orchestrator did not answer. Nothing was done: what a run is, is the
            # orchestrator's to say.
            raise Unavailable(
                f"the orchestrator is unreachable, so run {request.run_id!r} cannot be "
                "checked now; nothing was recorded, try again shortly"
            ) from exc
        status = status_from_proto(response.status)
        if status is None:
            raise TetherError(f"the orchestrator gave no status for run {request.run_id!r}")
        if response.HasField("lease_held"):
            lease_held = response.lease_held
        else:
            # An orchestrator of the previous release, which ignores held_epoch. Taking the
            # lease asked about as live only defers a sweep's decision to a later round; taking
            # it as lapsed could orphan an interaction whose worker is about to park on it.
            lease_held = request.HasField("held_epoch") or request.HasField("lease_epoch")
        return RunFacts(
            tenant_id=response.tenant_id,
            session_id=response.session_id,
            owner_principal_id=response.owner_principal_id or None,
            status=status,
            waiting_interaction_id=response.waiting_interaction_id,
            lease_held=lease_held,
            approval_policy=response.approval_policy,
            secret_names=tuple(response.secret_names),
        )

    async def resume(
        self,
        tenant_id: str,
        run_id: str,
        from_status: str,
        event: Event,
        interaction_id: str,
    ) -> bool:
        """Queue a run parked on `interaction_id` once."""
        # A failure leaves the resolution stored; the sweep delivers it once the orchestrator
        # is back.
        response = await self._stub.ResumeRun(
            orchestrator_pb2.ResumeRunRequest(
                tenant_id=tenant_id,
                run_id=run_id,
                from_status=status_to_proto(from_status),
                event=event_to_wire(event),
                interaction_id=interaction_id,
            )
        )
        return bool(response.resumed)

    async def expire(
        self,
        tenant_id: str,
        run_id: str,
        from_status: str,
        error: RunError,
        event: Event,
        interaction_id: str,
    ) -> bool:
        """Fail a run whose pause on `interaction_id` expired."""
        response = await self._stub.ExpireWaitingRun(
            orchestrator_pb2.ExpireWaitingRunRequest(
                tenant_id=tenant_id,
                run_id=run_id,
                from_status=status_to_proto(from_status),
                error=error_to_proto(error),
                event=event_to_wire(event),
                interaction_id=interaction_id,
            )
        )
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
