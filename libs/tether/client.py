"""`tether.client`: a small async Python client for the gateway.

A call that is safe to repeat (a send with its event id, a read, a cancel, a tenant's settings)
is retried with backoff while the gateway answers UNAVAILABLE, for up to `retry_for_s`, sending
the same event id every time (one logical send makes one run). One that is not (issuing a key,
answering, deciding, completing a connection) is never retried.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from datetime import datetime
from types import TracebackType
from typing import Any, Self, TypeVar

import grpc
from google.protobuf import json_format

from tether.client_address import load_stack, operator_from_env
from tether.client_agents import AgentCalls
from tether.convert import status_from_proto
from tether.retry import RetryPolicy
from tether.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tether.watch import ConversationWatch, RunWatch

log = logging.getLogger(__name__)

T = TypeVar("T")

RETRY_FOR_S = 30.0
"""How long an idempotent call keeps retrying UNAVAILABLE by default: past a restart or a
short outage, not forever."""

# 0.2 s doubling to 2 s (jittered): an outage of a few seconds costs at most ~2 s more.
OUTAGE_BACKOFF = RetryPolicy(initial_delay=0.2, max_delay=2.0)


def run_to_dict(run: common_pb2.Run) -> dict[str, Any]:
    """A run as stable JSON: ids, `status` spelled as in the state machine, times as RFC 3339."""
    data = json_format.MessageToDict(run, preserving_proto_field_name=True)
    status = status_from_proto(run.status)
    data["status"] = status.value if status else "unspecified"
    return data


class TetherClient(AgentCalls):
    """Async client of tether.v1.GatewayService.

    Build it with an address and key, or `TetherClient.from_env(stack=...)`, which reads a
    stack.json or TETHER_GATEWAY / TETHER_API_KEY.
    """

    def __init__(
        self, gateway: str, api_key: str, *, retry_for_s: float = RETRY_FOR_S, tenant: str = ""
    ) -> None:
        self._channel = grpc.aio.insecure_channel(gateway)
        self._metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {api_key}"),)
        if tenant:
            # The platform operator names the tenant it reads and retries runs in.
            self._metadata += (("tether-tenant", tenant),)
        self._retry_for_s = retry_for_s
        self.stub = gateway_pb2_grpc.GatewayServiceStub(self._channel)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """What every call presents: the key (and the operator's tenant)."""
        return self._metadata

    async def _idempotent(self, call: Callable[[], Awaitable[T]]) -> T:
        """`call()`, made again with backoff while it answers UNAVAILABLE, until
        `retry_for_s` would be exceeded (then its last UNAVAILABLE is raised)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._retry_for_s
        retries = 0
        while True:
            try:
                return await call()
            except grpc.aio.AioRpcError as exc:
                delay = OUTAGE_BACKOFF.backoff(retries)
                if exc.code() != grpc.StatusCode.UNAVAILABLE or loop.time() + delay > deadline:
                    raise
                log.info("%s: %s (retrying in %.1f s)", exc.code().name, exc.details(), delay)
            await asyncio.sleep(delay)
            retries += 1

    @classmethod
    def from_env(
        cls, stack: str | None = None, *, operator: bool = False, tenant: str = ""
    ) -> TetherClient:
        """From `stack` (a stack.json path), else TETHER_GATEWAY and TETHER_API_KEY. With
        `operator`, it speaks with the platform operator's credential instead of a key (the
        stack's `operator_credential`, else TETHER_OPERATOR_CREDENTIAL); with `tenant` too,
        as the operator within that tenant."""
        if operator or tenant:
            return cls(*operator_from_env(stack), tenant=tenant)
        if stack:
            return cls(*load_stack(stack))
        gateway, key = os.environ.get("TETHER_GATEWAY"), os.environ.get("TETHER_API_KEY")
        if not gateway or not key:
            raise ValueError(
                "no gateway: pass --stack <data-dir>/stack.json or set TETHER_GATEWAY and "
                "TETHER_API_KEY"
            )
        return cls(gateway, key)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the channel."""
        await self._channel.close()

    async def send(
        self,
        text: str,
        *,
        conversation_id: str,
        event_id: str,
        channel: str = "",
        priority: str = "",
    ) -> gateway_pb2.SendMessageResponse:
        """Send a chat message; returns the disposition and the run. `event_id` names this
        logical send: retried through an outage with it, and sent again later with it, the
        message makes one run. `priority` ("high", "normal" or "low"; "" is normal) orders the
        run among its tenant's queued runs, and needs a key holding runs:priority."""
        request = gateway_pb2.SendMessageRequest(
            text=text,
            conversation_id=conversation_id,
            event_id=event_id,
            channel=channel,
            priority=priority,
        )

        async def send_once() -> gateway_pb2.SendMessageResponse:
            response: gateway_pb2.SendMessageResponse = await self.stub.SendMessage(
                request, metadata=self._metadata
            )
            return response

        # Without an event id a repeat is a second message, not the same one.
        return await (self._idempotent(send_once) if event_id else send_once())

    async def get_run(self, run_id: str) -> gateway_pb2.GetRunResponse:
        """A run and its parts."""
        response: gateway_pb2.GetRunResponse = await self._idempotent(
            lambda: self.stub.GetRun(
                gateway_pb2.GetRunRequest(run_id=run_id), metadata=self._metadata
            )
        )
        return response

    async def list_runs(self, **filters: Any) -> gateway_pb2.ListRunsResponse:
        """One page of runs, newest first."""
        response: gateway_pb2.ListRunsResponse = await self._idempotent(
            lambda: self.stub.ListRuns(
                gateway_pb2.ListRunsRequest(**filters), metadata=self._metadata
            )
        )
        return response

    async def get_run_attempts(self, run_id: str) -> gateway_pb2.GetRunAttemptsResponse:
        """A run's attempts, model turns and lineage."""
        response: gateway_pb2.GetRunAttemptsResponse = await self._idempotent(
            lambda: self.stub.GetRunAttempts(
                gateway_pb2.GetRunAttemptsRequest(run_id=run_id), metadata=self._metadata
            )
        )
        return response

    async def retry_run(self, run_id: str) -> gateway_pb2.RetryRunResponse:
        """Retry a failed or cancelled run (retried through an outage: a repeat answers the
        retry the first made, attached)."""
        response: gateway_pb2.RetryRunResponse = await self._idempotent(
            lambda: self.stub.RetryRun(
                gateway_pb2.RetryRunRequest(run_id=run_id), metadata=self._metadata
            )
        )
        return response

    async def delete_tenant(self, tenant_id: str) -> gateway_pb2.DeleteTenantResponse:
        """One step of deleting a tenant (the platform operator); repeat until `deleted`."""
        response: gateway_pb2.DeleteTenantResponse = await self._idempotent(
            lambda: self.stub.DeleteTenant(
                gateway_pb2.DeleteTenantRequest(tenant_id=tenant_id), metadata=self._metadata
            )
        )
        return response

    async def set_tenant(
        self, request: gateway_pb2.SetTenantRequest
    ) -> gateway_pb2.SetTenantResponse:
        """Set a tenant's weight in fair leases and its cap (the platform operator)."""
        response: gateway_pb2.SetTenantResponse = await self._idempotent(
            lambda: self.stub.SetTenant(request, metadata=self._metadata)
        )
        return response

    async def cancel(self, run_id: str, reason: str = "") -> gateway_pb2.CancelRunResponse:
        """Cancel a run (retried through an outage: a repeated cancel changes nothing more)."""
        response: gateway_pb2.CancelRunResponse = await self._idempotent(
            lambda: self.stub.CancelRun(
                gateway_pb2.CancelRunRequest(run_id=run_id, reason=reason), metadata=self._metadata
            )
        )
        return response

    def watch(
        self,
        run_id: str,
        *,
        after_seq: int = 0,
        include_deltas: bool = False,
        give_up_after_s: float | None = 60.0,
    ) -> RunWatch:
        """The run's stream (`async for item in ...`), reconnecting by itself from its cursor
        until the run's terminal event; see `tether.watch`."""
        return RunWatch(
            self.stub,
            self._metadata,
            run_id,
            after_seq=after_seq,
            include_deltas=include_deltas,
            give_up_after_s=give_up_after_s,
        )

    def watch_conversation(
        self, conversation_id: str, *, cursor: str = "", include_deltas: bool = False
    ) -> ConversationWatch:
        """Every run of a conversation (`async for item in ...`), reconnecting by itself."""
        return ConversationWatch(
            self.stub, self._metadata, conversation_id, cursor=cursor, include_deltas=include_deltas
        )

    async def create_key(
        self,
        tenant_id: str,
        principal_id: str,
        scopes: list[str] | None = None,
        *,
        expires_at: datetime | None = None,
    ) -> gateway_pb2.CreateApiKeyResponse:
        """Issue an API key (a keys:admin key: in its own tenant, with scopes it holds; the
        operator: anywhere). An empty `tenant_id` means the caller's own."""
        request = gateway_pb2.CreateApiKeyRequest(
            tenant_id=tenant_id, principal_id=principal_id, scopes=scopes or []
        )
        if expires_at is not None:
            request.expires_at.FromDatetime(expires_at)
        response: gateway_pb2.CreateApiKeyResponse = await self.stub.CreateApiKey(
            request, metadata=self._metadata
        )
        return response

    async def revoke_key(self, key_id: str) -> gateway_pb2.RevokeApiKeyResponse:
        """Revoke an API key; it stops working within 5 seconds, open streams included."""
        response: gateway_pb2.RevokeApiKeyResponse = await self.stub.RevokeApiKey(
            gateway_pb2.RevokeApiKeyRequest(key_id=key_id), metadata=self._metadata
        )
        return response

    async def add_document(self, title: str, content: str) -> gateway_pb2.AddDocumentResponse:
        """Store a knowledge document for the tenant's runs (not retried: a repeat would store
        a second copy)."""
        response: gateway_pb2.AddDocumentResponse = await self.stub.AddDocument(
            gateway_pb2.AddDocumentRequest(title=title, content=content), metadata=self._metadata
        )
        return response

    async def list_documents(
        self, *, page_size: int = 0, page_token: str = ""
    ) -> gateway_pb2.ListDocumentsResponse:
        """One page of the tenant's documents, newest first, without their text."""
        response: gateway_pb2.ListDocumentsResponse = await self._idempotent(
            lambda: self.stub.ListDocuments(
                gateway_pb2.ListDocumentsRequest(page_size=page_size, page_token=page_token),
                metadata=self._metadata,
            )
        )
        return response

    async def remove_document(self, document_id: str) -> gateway_pb2.RemoveDocumentResponse:
        """Remove one of the tenant's documents."""
        response: gateway_pb2.RemoveDocumentResponse = await self.stub.RemoveDocument(
            gateway_pb2.RemoveDocumentRequest(document_id=document_id), metadata=self._metadata
        )
        return response

    async def add_secret(self, name: str, value: str) -> gateway_pb2.AddSecretResponse:
        """Seal a named secret of the tenant (not retried: a repeat is ALREADY_EXISTS)."""
        response: gateway_pb2.AddSecretResponse = await self.stub.AddSecret(
            gateway_pb2.AddSecretRequest(name=name, value=value), metadata=self._metadata
        )
        return response

    async def list_secrets(self) -> gateway_pb2.ListSecretsResponse:
        """The tenant's secrets by name, never their values."""
        response: gateway_pb2.ListSecretsResponse = await self._idempotent(
            lambda: self.stub.ListSecrets(gateway_pb2.ListSecretsRequest(), metadata=self._metadata)
        )
        return response

    async def remove_secret(self, name: str) -> gateway_pb2.RemoveSecretResponse:
        """Remove one of the tenant's secrets."""
        response: gateway_pb2.RemoveSecretResponse = await self.stub.RemoveSecret(
            gateway_pb2.RemoveSecretRequest(name=name), metadata=self._metadata
        )
        return response

    async def add_channel(
        self, request: gateway_pb2.AddChannelRequest
    ) -> gateway_pb2.AddChannelResponse:
        """Connect a channel (not retried: a repeat is ALREADY_EXISTS)."""
        response: gateway_pb2.AddChannelResponse = await self.stub.AddChannel(
            request, metadata=self._metadata
        )
        return response

    async def list_channels(self) -> gateway_pb2.ListChannelsResponse:
        """The tenant's channel connections, never their secrets."""
        response: gateway_pb2.ListChannelsResponse = await self._idempotent(
            lambda: self.stub.ListChannels(
                gateway_pb2.ListChannelsRequest(), metadata=self._metadata
            )
        )
        return response

    async def get_channel(self, channel_id: str) -> gateway_pb2.GetChannelResponse:
        """One channel connection, never its secrets."""
        response: gateway_pb2.GetChannelResponse = await self._idempotent(
            lambda: self.stub.GetChannel(
                gateway_pb2.GetChannelRequest(channel_id=channel_id), metadata=self._metadata
            )
        )
        return response

    async def remove_channel(self, channel_id: str) -> gateway_pb2.RemoveChannelResponse:
        """Remove a channel connection."""
        response: gateway_pb2.RemoveChannelResponse = await self.stub.RemoveChannel(
            gateway_pb2.RemoveChannelRequest(channel_id=channel_id), metadata=self._metadata
        )
        return response

    async def rotate_channel_secret(
        self, channel_id: str, secret: str, grace_seconds: int | None
    ) -> gateway_pb2.RotateChannelSecretResponse:
        """Replace a channel's verification secret (not retried: each call rotates)."""
        request = gateway_pb2.RotateChannelSecretRequest(channel_id=channel_id, secret=secret)
        if grace_seconds is not None:
            request.grace_seconds = grace_seconds
        response: gateway_pb2.RotateChannelSecretResponse = await self.stub.RotateChannelSecret(
            request, metadata=self._metadata
        )
        return response

    async def pending_question(self, run_id: str) -> gateway_pb2.GetPendingQuestionResponse:
        """The run's open question (unset once answered)."""
        response: gateway_pb2.GetPendingQuestionResponse = await self._idempotent(
            lambda: self.stub.GetPendingQuestion(
                gateway_pb2.GetPendingQuestionRequest(run_id=run_id), metadata=self._metadata
            )
        )
        return response

    async def answer(
        self, run_id: str, answers: dict[str, list[str]]
    ) -> gateway_pb2.AnswerQuestionResponse:
        """Answer the run's open question (values per question key)."""
        request = gateway_pb2.AnswerQuestionRequest(run_id=run_id)
        for key, values in answers.items():
            request.answers[key].values.extend(values)
        response: gateway_pb2.AnswerQuestionResponse = await self.stub.AnswerQuestion(
            request, metadata=self._metadata
        )
        return response

    async def pending_approval(self, run_id: str) -> gateway_pb2.GetPendingApprovalResponse:
        """The run's open approval (unset once decided)."""
        response: gateway_pb2.GetPendingApprovalResponse = await self._idempotent(
            lambda: self.stub.GetPendingApproval(
                gateway_pb2.GetPendingApprovalRequest(run_id=run_id), metadata=self._metadata
            )
        )
        return response

    async def decide(
        self, run_id: str, decision: str, always_scope: str = ""
    ) -> gateway_pb2.DecideApprovalResponse:
        """Decide the run's open approval."""
        response: gateway_pb2.DecideApprovalResponse = await self.stub.DecideApproval(
            gateway_pb2.DecideApprovalRequest(
                run_id=run_id, decision=decision, always_scope=always_scope
            ),
            metadata=self._metadata,
        )
        return response

    async def pending_connection(self, run_id: str) -> gateway_pb2.GetPendingConnectionResponse:
        """The run's open consent offer (unset once completed)."""
        response: gateway_pb2.GetPendingConnectionResponse = await self._idempotent(
            lambda: self.stub.GetPendingConnection(
                gateway_pb2.GetPendingConnectionRequest(run_id=run_id), metadata=self._metadata
            )
        )
        return response

    async def complete_connection(
        self, run_id: str, state: str, code: str
    ) -> gateway_pb2.CompleteConnectionResponse:
        """Complete consent with the state and code the provider redirected back with."""
        response: gateway_pb2.CompleteConnectionResponse = await self.stub.CompleteConnection(
            gateway_pb2.CompleteConnectionRequest(run_id=run_id, state=state, code=code),
            metadata=self._metadata,
        )
        return response
