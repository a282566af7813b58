"""`UnsettledCall` through the one path: the model reads its message under its code, and the
effects record stays open, so the next call of the same input fires again under the same key
(where a `ToolError` would have been recorded and replayed)."""

from __future__ import annotations

from tether.domain import EffectState
from tether.testing.tools import MemoryEffects, ToolKit
from tether.tools import (
    RiskCategory,
    ToolContext,
    ToolDefinition,
    ToolOutput,
    ToolSpec,
    UnsettledCall,
)

SPEC = ToolSpec(
    name="send_parcel",
    description="Send a parcel.",
    input_schema={"type": "object", "properties": {"to": {"type": "string"}}, "required": ["to"]},
    risk=RiskCategory.PUBLISH,
    writes_externally=True,
)


async def test_an_unsettled_call_is_read_by_the_model_and_left_open_for_the_retry() -> None:
    keys: list[str | None] = []

    async def handler(ctx: ToolContext, input: dict[str, object]) -> ToolOutput:
        keys.append(ctx.idempotency_key)
        if len(keys) == 1:
            raise UnsettledCall("the courier did not answer; it may have been sent", "unknown")
        return ToolOutput("sent")

    effects = MemoryEffects()
    kit = ToolKit(ToolDefinition(SPEC, handler), approval="grant", effects=effects)
    first = await kit.call({"to": "Lyon"})
    assert (first.is_error, first.error_code) == (True, "unknown")
    assert first.content == "the courier did not answer; it may have been sent"
    assert first.idempotency_key is not None
    assert effects.state(first.idempotency_key) is EffectState.IN_PROGRESS
    again = await kit.call({"to": "Lyon"})
    assert (again.content, again.replayed, again.fired) == ("sent", False, 1)
    assert keys == [first.idempotency_key] * 2, "fired again under the same key"
    assert effects.state(first.idempotency_key) is EffectState.DONE
