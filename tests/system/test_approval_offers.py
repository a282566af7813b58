"""What an approval offers is the orchestrator's to say (the run's pinned agent's approval
policy), never the lease holder's: a worker cannot widen the decisions or the allow-always
scopes a person is offered by sending a policy of its own."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from tests.system.execution_support import ExecStack, exec_stack, wait_for_status
from tether.client import TetherClient
from tether.runtime.rpc import internal_channel
from tether.v1 import (
    common_pb2,
    interactions_pb2,
    interactions_pb2_grpc,
    orchestrator_pb2,
    orchestrator_pb2_grpc,
)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(
    pg_server_url: str, template_db: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ExecStack]:
    run_dir = Path(tmp_path_factory.mktemp("approval_offers"))
    async with exec_stack(pg_server_url, template_db, redis_url, run_dir, workers=1) as running:
        yield running


@pytest.mark.slow  # a stack of its own: about 20 s
async def test_a_worker_cannot_widen_allow_always_by_sending_its_own_policy(
    stack: ExecStack,
) -> None:
    tenant = await stack.tenant()
    text = "widen the offer"
    await stack.services.stop("worker")  # this test is the lease holder
    try:
        run_id = await tenant.send(text)
        async with (
            internal_channel(stack.addr("orchestrator"), stack.credentials["worker"]) as orch,
            internal_channel(stack.addr("interactions"), stack.credentials["worker"]) as inter,
        ):
            orchestrator = orchestrator_pb2_grpc.OrchestratorServiceStub(orch)
            store = interactions_pb2_grpc.InteractionsServiceStub(inter)
            lease = (
                await orchestrator.ClaimRun(
                    orchestrator_pb2.ClaimRunRequest(worker_id="t", wait_ms=5000)
                )
            ).lease
            assert lease.run_id == run_id
            request = interactions_pb2.RequestApprovalRequest(
                run_id=run_id,
                epoch=lease.epoch,
                tool_call_id="toolu_w",
                tool_name="publish_post",
                risk_category="publish",
                idempotency_key="w",
                # The tenant's policy allows allow-always for the principal only.
                approval_policy=json.dumps({"always_allow_scopes": ["principal", "tenant"]}),
            )
            request.input.update({"text": "wide"})
            approval = await store.RequestApproval(request)
            await orchestrator.ParkRun(
                orchestrator_pb2.ParkRunRequest(
                    run_id=run_id,
                    epoch=lease.epoch,
                    status=common_pb2.RUN_STATUS_WAITING_FOR_APPROVAL,
                    interaction_id=approval.interaction_id,
                )
            )
        await wait_for_status(stack.db_url, run_id, "waiting-for-approval")
        async with TetherClient(stack.addr("gateway"), tenant.api_key) as tc:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await tc.decide(run_id, "allow-always", "tenant")
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        await stack.start_worker()
