"""The gateway's knowledge RPCs: a tenant uploads, lists and removes the documents its runs
retrieve from. Every call authenticates first and names the
caller's tenant (and, for an upload, principal), never the body's."""

from __future__ import annotations

import grpc

from services.gateway.grpc.callers import Callers
from tether.v1 import gateway_pb2, orchestrator_pb2, orchestrator_pb2_grpc


class DocumentRpcs:
    """Implements the knowledge part of tether.v1.GatewayService."""

    def __init__(
        self, callers: Callers, orchestrator: orchestrator_pb2_grpc.OrchestratorServiceStub
    ) -> None:
        self._callers = callers
        self._orchestrator = orchestrator

    async def AddDocument(
        self, request: gateway_pb2.AddDocumentRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.AddDocumentResponse:
        principal = await self._callers.authenticated(context, "AddDocument", request)
        stored = await self._orchestrator.StoreDocument(
            orchestrator_pb2.StoreDocumentRequest(
                tenant_id=principal.tenant_id,
                principal_id=principal.principal_id,
                title=request.title,
                content=request.content,
            )
        )
        return gateway_pb2.AddDocumentResponse(document=stored.document)

    async def ListDocuments(
        self, request: gateway_pb2.ListDocumentsRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.ListDocumentsResponse:
        principal = await self._callers.authenticated(context, "ListDocuments", request)
        page = await self._orchestrator.FindDocuments(
            orchestrator_pb2.FindDocumentsRequest(
                tenant_id=principal.tenant_id,
                page_size=request.page_size,
                page_token=request.page_token,
            )
        )
        return gateway_pb2.ListDocumentsResponse(
            documents=page.documents, next_page_token=page.next_page_token
        )

    async def RemoveDocument(
        self, request: gateway_pb2.RemoveDocumentRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.RemoveDocumentResponse:
        principal = await self._callers.authenticated(context, "RemoveDocument", request)
        await self._orchestrator.DeleteDocument(
            orchestrator_pb2.DeleteDocumentRequest(
                tenant_id=principal.tenant_id, document_id=request.document_id
            )
        )
        return gateway_pb2.RemoveDocumentResponse(document_id=request.document_id)
