"""`tether.testing.tools.ToolKit` runs a tool through the worker's own path (`ToolCalls`,
`tether.tools.path.execute`) with memory behind the ports: the schema refuses before any gate, a
gated tool meets the chosen decision, a write replays under its idempotency key, a missing
connection pauses, a cancel stops the work and leaves the effect open for the retry."""

from __future__ import annotations

import asyncio
from typing import Annotated

from tether.domain import EffectState
from tether.testing.tools import MemoryEffects, ToolKit
from tether.tools import ConnectionGap, RiskCategory, ToolContext, ToolError, tool

SENT: list[tuple[str | None, str]] = []
STARTED = asyncio.Event()
RELEASE = asyncio.Event()


@tool
async def lookup(sku: Annotated[str, "The item's SKU"], quantity: int = 1) -> str:
    """Looks an item up."""
    return f"{quantity} x {sku}: in stock"


@tool(risk=RiskCategory.PUBLISH, writes_externally=True)
async def announce(ctx: ToolContext, text: str, copies: int = 1) -> str:
    """Announces text to the world."""
    SENT.append((ctx.idempotency_key, text))
    return f"announced {text!r} x{copies}"


@tool(writes_externally=True, description="Writes once released, cancellably.")
async def slow_write(ctx: ToolContext, label: str) -> str:
    STARTED.set()
    await RELEASE.wait()
    return f"written {label}"


@tool(description="Lists calendar events through the democal connection.")
async def calendar(ctx: ToolContext) -> str:
    assert ctx.connections is not None
    token = await ctx.connections.token("democal", ["calendar.read"])
    return f"events read with {token}"


@tool(description="Refuses.")
async def refuses() -> str:
    raise ToolError("no such order; order ids look like ORD-1234")


@tool(description="Too slow for its timeout.", timeout_s=0.05)
async def too_slow(ctx: ToolContext) -> str:
    await ctx.cancelled.wait()  # returns once the path cancels it at its timeout
    return "never"


async def test_a_read_tool_runs_without_approval() -> None:
    outcome = await ToolKit(lookup).call({"sku": "A-1", "quantity": 2.0})
    assert (outcome.content, outcome.is_error, outcome.fired) == ("2 x A-1: in stock", False, 1)
    assert outcome.approval is None and outcome.idempotency_key is None


async def test_a_bad_input_is_refused_with_the_schemas_words_before_any_gate() -> None:
    kit = ToolKit(announce, approval="allow-once")
    outcome = await kit.call({"text": 5, "extra": True})
    assert outcome.error_code == "tool_invalid_input" and outcome.fired == 0
    assert outcome.content == (
        "invalid input for tool announce: input.extra: is not an allowed property; "
        "input.text: must be of type string"
    )
    assert outcome.approval is None, "nobody is asked to approve a call that cannot succeed"


async def test_a_gated_tool_pauses_for_approval_until_someone_decides() -> None:
    outcome = await ToolKit(announce).call({"text": "hello"})
    assert outcome.paused == "paused for approval of announce" and outcome.fired == 0
    assert outcome.approval is not None and outcome.approval.input == {"text": "hello"}
    assert outcome.approval.summary == "Run announce(text='hello')"


async def test_allow_once_runs_the_stored_input_once_and_a_retry_replays() -> None:
    SENT.clear()
    kit = ToolKit(announce, approval="allow-once")
    first = await kit.call({"text": "launch", "copies": 2.0})
    assert first.approval is not None and first.approval.input == {"text": "launch", "copies": 2}
    assert (first.content, first.fired, first.replayed) == ("announced 'launch' x2", 1, False)
    assert first.idempotency_key is not None and first.idempotency_key.startswith("eff_")
    again = await kit.call({"copies": 2, "text": "launch"})
    assert (again.content, again.fired, again.replayed) == ("announced 'launch' x2", 0, True)
    assert again.idempotency_key == first.idempotency_key
    assert [(first.idempotency_key, "launch")] == SENT
    assert kit.effects.state(first.idempotency_key) is EffectState.DONE


async def test_deny_and_expiry_do_not_run_and_a_grant_needs_no_approval() -> None:
    denied = await ToolKit(announce, approval="deny").call({"text": "no"})
    assert (denied.error_code, denied.fired) == ("approval_deny", 0)
    assert denied.content == "the approval for announce was denied; it did not run"
    expired = await ToolKit(announce, approval="expired").call({"text": "late"})
    assert (expired.error_code, expired.fired) == ("approval_expired", 0)
    granted = await ToolKit(announce, approval="grant").call({"text": "standing"})
    assert (granted.is_error, granted.fired, granted.approval) == (False, 1, None)


async def test_a_tool_error_is_a_result_the_model_reads() -> None:
    outcome = await ToolKit(refuses).call({})
    assert (outcome.error_code, outcome.content) == (
        "tool_error",
        "no such order; order ids look like ORD-1234",
    )


async def test_a_missing_connection_pauses_and_a_connected_one_is_used() -> None:
    paused = await ToolKit(calendar).call({})
    assert paused.paused == "paused for connection democal" and not paused.is_error
    connected = await ToolKit(calendar, connections={"democal": "tok_123"}).call({})
    assert connected.content == "events read with tok_123"
    kit = ToolKit(calendar, connections={"democal": "tok_old"}, gaps={"democal": "expired"})
    assert (await kit.call({})).paused == "paused for connection democal"
    assert [gap.gap for gap in kit.desk.offers] == ["expired"]


async def test_a_gap_nobody_can_close_ends_the_run() -> None:
    outcome = await ToolKit(calendar, consent=False).call({})
    assert outcome.ends_run and outcome.error_code == "connection_absent"
    assert outcome.content == str(
        ConnectionGap(
            provider="democal", gap="absent", scopes=[], credential_ref="conn_kit_democal"
        )
    )


async def test_a_cancel_stops_the_work_and_leaves_the_effect_open_for_the_retry() -> None:
    effects = MemoryEffects()
    STARTED.clear()
    RELEASE.clear()
    cancelled = await ToolKit(slow_write, effects=effects).call({"label": "a"}, cancel=True)
    assert STARTED.is_set() and cancelled.cancelled and cancelled.saw_cancel
    assert cancelled.idempotency_key is not None
    assert effects.state(cancelled.idempotency_key) is EffectState.IN_PROGRESS
    # The retry fires again under the same key (the external system deduplicates on it).
    RELEASE.set()
    retried = await ToolKit(slow_write, effects=effects).call({"label": "a"})
    assert (retried.content, retried.fired, retried.replayed) == ("written a", 1, False)
    assert retried.idempotency_key == cancelled.idempotency_key


async def test_a_timeout_cancels_the_tool_and_says_so() -> None:
    outcome = await ToolKit(too_slow).call({})
    assert (outcome.error_code, outcome.content) == (
        "tool_timeout",
        "tool too_slow timed out after 0.05s",
    )
