"""The approval gate inside the registry fails closed, and the three connection gaps read
differently."""

from __future__ import annotations

from typing import Any

from services.worker.tools.base import GAP_MESSAGES, Authorization, CallContext, ConnectionGap
from services.worker.tools.demo import DemoProvider
from services.worker.tools.registry import ToolErrorCode, ToolRegistry
from tether.domain import EffectState


class NoEffects:
    """Fails the test if the gate lets a gated call reach its effects record."""

    async def begin(self, key: str, tool_name: str) -> tuple[EffectState, dict[str, Any] | None]:
        raise AssertionError("a refused call must not reach the effects record")

    async def finish(self, key: str, result: dict[str, Any]) -> None:
        raise AssertionError("a refused call must not reach the effects record")


CALL = CallContext(tenant_id="t", run_id="run_a", root_run_id="run_a", tool_call_id="toolu_1")


async def _publish(authorization: Authorization | None) -> str | None:
    registry = ToolRegistry(DemoProvider().tools({}))
    result = await registry.execute(
        "publish_post",
        {"text": "hi"},
        CALL,
        effects=NoEffects(),
        allowlist=["publish_post"],
        max_inline_bytes=1000,
        output_ref="out_1",
        authorization=authorization,
    )
    assert result.is_error
    return result.error_code


async def test_a_gated_tool_executed_directly_is_refused() -> None:
    assert await _publish(None) == ToolErrorCode.APPROVAL_REQUIRED


async def test_an_authorization_for_another_tool_does_not_authorise_this_one() -> None:
    other = Authorization("approval", "int_1", "get_time", "run_a")
    assert await _publish(other) == ToolErrorCode.APPROVAL_REQUIRED


async def test_an_authorization_from_another_run_does_not_travel() -> None:
    foreign = Authorization("approval", "int_1", "publish_post", "run_b")
    assert await _publish(foreign) == ToolErrorCode.APPROVAL_REQUIRED


def test_three_gaps_three_different_sentences() -> None:
    messages = {
        str(
            ConnectionGap(
                provider="github",
                gap=gap,
                scopes=["repo"],
                credential_ref="connection:github/alice",
            )
        )
        for gap in GAP_MESSAGES
    }
    assert len(messages) == 3
    assert all("connection:github/alice" in m for m in messages)
