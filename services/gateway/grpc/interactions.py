"""The gateway's interaction RPCs: read a pending question, approval or connection, and
resolve it. Every call authenticates first and carries the
caller's tenant, principal and whether its key holds runs:all, never the body's: the
interactions service shows a run only to whom tether.visibility lets see it."""

from __future__ import annotations

import grpc

from services.gateway.grpc.callers import Callers
from tether.errors import InvalidArgument
from tether.v1 import gateway_pb2, interactions_pb2, interactions_pb2_grpc
from tether.visibility import viewer_of


class InteractionRpcs:
    """Implements the interaction part of tether.v1.GatewayService."""

    def __init__(
        self, callers: Callers, interactions: interactions_pb2_grpc.InteractionsServiceStub
    ) -> None:
        self._callers = callers
        self._interactions = interactions

    async def GetPendingQuestion(
        self, request: gateway_pb2.GetPendingQuestionRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.GetPendingQuestionResponse:
        principal = await self._callers.authenticated(context, "GetPendingQuestion", request)
        found = await self._interactions.FindPendingQuestion(
            interactions_pb2.FindPendingQuestionRequest(
                **viewer_of(principal).fields(),
                run_id=request.run_id,
            )
        )
        response = gateway_pb2.GetPendingQuestionResponse()
        if found.HasField("question"):
            response.question.CopyFrom(found.question)
        return response

    async def AnswerQuestion(
        self, request: gateway_pb2.AnswerQuestionRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.AnswerQuestionResponse:
        principal = await self._callers.authenticated(context, "AnswerQuestion", request)
        if not request.answers:
            raise InvalidArgument("answers are required, keyed by question key")
        recorded = await self._interactions.RecordAnswers(
            interactions_pb2.RecordAnswersRequest(
                **viewer_of(principal).fields(),
                run_id=request.run_id,
                answers=request.answers,
            )
        )
        return gateway_pb2.AnswerQuestionResponse(
            interaction_id=recorded.interaction_id, resumed=recorded.resumed
        )

    async def GetPendingApproval(
        self, request: gateway_pb2.GetPendingApprovalRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.GetPendingApprovalResponse:
        principal = await self._callers.authenticated(context, "GetPendingApproval", request)
        found = await self._interactions.FindPendingApproval(
            interactions_pb2.FindPendingApprovalRequest(
                **viewer_of(principal).fields(),
                run_id=request.run_id,
            )
        )
        response = gateway_pb2.GetPendingApprovalResponse()
        if found.HasField("approval"):
            response.approval.CopyFrom(found.approval)
        return response

    async def DecideApproval(
        self, request: gateway_pb2.DecideApprovalRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.DecideApprovalResponse:
        principal = await self._callers.authenticated(context, "DecideApproval", request)
        decided = await self._interactions.RecordDecision(
            interactions_pb2.RecordDecisionRequest(
                **viewer_of(principal).fields(),
                run_id=request.run_id,
                decision=request.decision,
                always_scope=request.always_scope,
            )
        )
        return gateway_pb2.DecideApprovalResponse(
            interaction_id=decided.interaction_id,
            resumed=decided.resumed,
            grant_id=decided.grant_id,
        )

    async def GetPendingConnection(
        self,
        request: gateway_pb2.GetPendingConnectionRequest,
        context: grpc.aio.ServicerContext,
    ) -> gateway_pb2.GetPendingConnectionResponse:
        principal = await self._callers.authenticated(context, "GetPendingConnection", request)
        found = await self._interactions.FindPendingConnection(
            interactions_pb2.FindPendingConnectionRequest(
                **viewer_of(principal).fields(),
                run_id=request.run_id,
            )
        )
        response = gateway_pb2.GetPendingConnectionResponse()
        if found.HasField("connection"):
            response.connection.CopyFrom(found.connection)
        return response

    async def CompleteConnection(
        self,
        request: gateway_pb2.CompleteConnectionRequest,
        context: grpc.aio.ServicerContext,
    ) -> gateway_pb2.CompleteConnectionResponse:
        principal = await self._callers.authenticated(context, "CompleteConnection", request)
        done = await self._interactions.ConfirmConnection(
            interactions_pb2.ConfirmConnectionRequest(
                **viewer_of(principal).fields(),
                run_id=request.run_id,
                state=request.state,
                code=request.code,
            )
        )
        return gateway_pb2.CompleteConnectionResponse(resumed=done.resumed)
