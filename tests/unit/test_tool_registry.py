"""The tool registry: allowlist, schema validation, timeouts, failures, cancellation, the inline
cap, idempotency keys, the effects record and entry-point loading.

The effects record is the in-memory `MemoryEffects` below, which follows the port's contract
(first begin -> BEGUN, then IN_PROGRESS until finished, then DONE with the result); the real
record lives in the orchestrator.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime, timedelta
from importlib.metadata import EntryPoint
from typing import Any

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

import services.worker.tools.registry as registry_module
from services.worker.tools import (
    CallContext,
    EffectState,
    InputSchema,
    RiskCategory,
    SchemaError,
    Tool,
    ToolContext,
    ToolError,
    ToolErrorCode,
    ToolOutput,
    ToolRegistry,
    ToolResult,
    ToolSpec,
    check_schema,
    idempotency_key,
    normalize,
    truncate_inline,
    validate,
)
from services.worker.tools.base import Authorization
from services.worker.tools.demo import DemoProvider, big_text
from tether.testing.eventually import eventually

CALL = CallContext(tenant_id="ten_1", run_id="run_2", root_run_id="run_1", tool_call_id="toolu_1")
REF = "out_0123"
OBJECT: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
DEMO_NAMES = [
    "get_time",
    "publish_post",
    "slow_task",
    "big_output",
    "fail_tool",
    "calendar_list_events",
]


class MemoryEffects:
    """The effects record in memory, for these tests only."""

    def __init__(self) -> None:
        self.states: dict[str, tuple[EffectState, dict[str, Any] | None]] = {}
        self.begins: list[tuple[str, str]] = []
        self.finishes: list[tuple[str, dict[str, Any]]] = []
        self.finish_gate: asyncio.Event | None = None
        self.finish_entered = asyncio.Event()

    async def begin(self, key: str, tool_name: str) -> tuple[EffectState, dict[str, Any] | None]:
        self.begins.append((key, tool_name))
        current = self.states.get(key)
        if current is None:
            self.states[key] = (EffectState.IN_PROGRESS, None)
            return EffectState.BEGUN, None
        return current

    async def finish(self, key: str, result: dict[str, Any]) -> None:
        self.finish_entered.set()
        if self.finish_gate is not None:
            await self.finish_gate.wait()
        self.finishes.append((key, result))
        self.states[key] = (EffectState.DONE, result)


Behaviour = Callable[[ToolContext, dict[str, Any]], Awaitable[ToolOutput]]


class ScriptedTool:
    """A tool whose `run` is a given coroutine function; remembers every call."""

    def __init__(self, spec: ToolSpec, behaviour: Behaviour) -> None:
        self.spec = spec
        self._behaviour = behaviour
        self.calls: list[tuple[ToolContext, dict[str, Any]]] = []

    async def run(self, ctx: ToolContext, input: dict[str, Any]) -> ToolOutput:
        self.calls.append((ctx, input))
        return await self._behaviour(ctx, input)


class Observed:
    """Wraps a tool: signals when it starts and remembers whether it was cancelled."""

    def __init__(self, inner: Tool) -> None:
        self.inner = inner
        self.started = asyncio.Event()
        self.cancelled = False

    @property
    def spec(self) -> ToolSpec:
        return self.inner.spec

    async def run(self, ctx: ToolContext, input: dict[str, Any]) -> ToolOutput:
        self.started.set()
        try:
            return await self.inner.run(ctx, input)
        except asyncio.CancelledError:
            self.cancelled = True
            raise


def returning(content: str, *, is_error: bool = False) -> Behaviour:
    async def behaviour(ctx: ToolContext, input: dict[str, Any]) -> ToolOutput:
        return ToolOutput(content, is_error=is_error)

    return behaviour


def raising(exc: BaseException) -> Behaviour:
    async def behaviour(ctx: ToolContext, input: dict[str, Any]) -> ToolOutput:
        raise exc

    return behaviour


async def forever(ctx: ToolContext, input: dict[str, Any]) -> ToolOutput:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


def spec(name: str, *, external: bool = False, timeout_s: float = 5.0) -> ToolSpec:
    return ToolSpec(
        name=name,
        description=f"{name} for tests",
        input_schema={
            "type": "object",
            "properties": {"text": {"type": "string"}},
            "additionalProperties": False,
        },
        risk=RiskCategory.PUBLISH if external else RiskCategory.READ,
        timeout_s=timeout_s,
        writes_externally=external,
    )


def demo_tools(**settings: str) -> list[Tool]:
    return list(DemoProvider().tools(settings))


async def execute(
    registry: ToolRegistry,
    name: str,
    input: dict[str, Any],
    *,
    effects: MemoryEffects | None = None,
    allowlist: Sequence[str] | None = None,
    max_inline_bytes: int = 100_000,
    call: CallContext = CALL,
) -> ToolResult:
    return await registry.execute(
        name,
        input,
        call,
        effects=effects if effects is not None else MemoryEffects(),
        allowlist=registry.names if allowlist is None else allowlist,
        max_inline_bytes=max_inline_bytes,
        output_ref=REF,
        # These tests are about effects and limits; the approval gate has its own tests.
        authorization=Authorization("grant", "grt_test", name, call.run_id),
    )


# Construction and specs -------------------------------------------------------------------------


def test_specs_follow_the_allowlist_order_and_skip_unknown_names(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = ToolRegistry(demo_tools())
    with caplog.at_level(logging.WARNING, logger=registry_module.__name__):
        params = registry.specs(["fail_tool", "nope", "get_time", "fail_tool"])
    assert [param["name"] for param in params] == ["fail_tool", "get_time"]
    assert set(params[0]) == {"name", "description", "input_schema"}
    assert params[1]["input_schema"]["type"] == "object"
    assert "'nope'" in caplog.text
    assert registry.specs([]) == []


def test_duplicate_names_are_refused() -> None:
    with pytest.raises(ValueError, match="get_time"):
        ToolRegistry([*demo_tools(), *demo_tools()])


def test_a_schema_keyword_the_validator_does_not_enforce_is_refused_at_construction() -> None:
    # jsonschema ignores a keyword it does not know: a typo would leave the input unchecked.
    bad = ToolSpec(
        name="patterned",
        description="",
        input_schema={"type": "object", "properties": {"a": {"type": "string", "patern": "x"}}},
    )
    with pytest.raises(SchemaError, match=r"patterned\.input_schema\.a: .*'patern'"):
        ToolRegistry([ScriptedTool(bad, returning("x"))])


def test_the_input_schema_must_describe_an_object() -> None:
    bad = ToolSpec(name="stringly", description="", input_schema={"type": "string"})
    with pytest.raises(ValueError, match="type object"):
        ToolRegistry([ScriptedTool(bad, returning("x"))])


# Refusals before the tool runs ------------------------------------------------------------------


async def test_a_tool_outside_the_allowlist_is_refused_without_running() -> None:
    tool = ScriptedTool(spec("echo"), returning("hi"))
    registry = ToolRegistry([tool])
    result = await execute(registry, "echo", {}, allowlist=["other"])
    assert result == ToolResult(
        content="tool echo is not available to this agent",
        is_error=True,
        error_code=ToolErrorCode.NOT_ALLOWED,
    )
    assert tool.calls == []


async def test_an_allowlisted_but_unregistered_tool_is_unknown() -> None:
    result = await execute(ToolRegistry([]), "ghost", {}, allowlist=["ghost"])
    assert (result.is_error, result.error_code) == (True, "tool_unknown")


async def test_a_tool_not_allowlisted_is_refused_even_when_unknown() -> None:
    result = await execute(ToolRegistry([]), "ghost", {}, allowlist=[])
    assert result.error_code == "tool_not_allowed"


@pytest.mark.parametrize(
    ("arguments", "reason"),
    [
        ({}, "input.text: is required"),
        ({"text": ""}, "input.text: must be at least 1 characters long"),
        ({"text": "x" * 2001}, "input.text: must be at most 2000 characters long"),
        ({"text": 7}, "input.text: must be of type string"),
        ({"text": "hi", "extra": 1}, "input.extra: is not an allowed property"),
    ],
)
async def test_invalid_input_is_refused_before_the_effect_or_the_tool(
    arguments: dict[str, Any], reason: str
) -> None:
    observed = Observed(demo_tools()[1])
    effects = MemoryEffects()
    result = await execute(ToolRegistry([observed]), "publish_post", arguments, effects=effects)
    assert result.is_error
    assert result.error_code == "tool_invalid_input"
    assert result.content == f"invalid input for tool publish_post: {reason}"
    assert not observed.started.is_set()
    assert effects.begins == []


async def test_integral_floats_reach_an_integer_field_as_ints() -> None:
    # Input that crossed protobuf Struct has only floats.
    observed = Observed(demo_tools()[3])  # big_output
    result = await execute(ToolRegistry([observed]), "big_output", {"bytes": 3.0})
    assert result == ToolResult(content=big_text(3), is_error=False)
    fractional = await execute(ToolRegistry(demo_tools()), "big_output", {"bytes": 3.5})
    assert (
        fractional.content
        == "invalid input for tool big_output: input.bytes: must be of type integer"
    )


async def test_an_integral_float_and_its_int_name_the_same_effect() -> None:
    counted = ToolSpec(
        name="counted",
        description="",
        input_schema={"type": "object", "properties": {"n": {"type": "integer"}}},
        writes_externally=True,
    )
    tool = ScriptedTool(counted, returning("ok"))
    registry = ToolRegistry([tool])
    effects = MemoryEffects()
    first = await execute(registry, "counted", {"n": 5.0}, effects=effects)
    again = await execute(registry, "counted", {"n": 5}, effects=effects)
    assert first.idempotency_key == again.idempotency_key
    assert again.replayed
    assert [arguments for _, arguments in tool.calls] == [{"n": 5}]
    assert type(tool.calls[0][1]["n"]) is int


async def test_every_violation_is_named_up_to_a_limit() -> None:
    many = ToolSpec(name="many", description="", input_schema=OBJECT)
    registry = ToolRegistry([ScriptedTool(many, returning("x"))])
    result = await execute(registry, "many", {f"f{i}": i for i in range(7)})
    assert result.content.count("is not an allowed property") == 5
    assert result.content.endswith("; and 2 more")


# Running ----------------------------------------------------------------------------------------


async def test_a_read_tool_runs_without_an_effect_or_a_key() -> None:
    tool = ScriptedTool(spec("echo"), returning("hi"))
    effects = MemoryEffects()
    result = await execute(ToolRegistry([tool]), "echo", {"text": "x"}, effects=effects)
    assert result == ToolResult(content="hi", is_error=False)
    assert effects.begins == []
    [(ctx, arguments)] = tool.calls
    assert ctx == CALL.with_key(None)
    assert arguments == {"text": "x"}


async def test_get_time_returns_the_current_utc_time() -> None:
    before = datetime.now().astimezone()
    result = await execute(ToolRegistry(demo_tools()), "get_time", {})
    moment = datetime.fromisoformat(result.content)
    assert moment.utcoffset() == timedelta(0)
    assert before <= moment <= datetime.now().astimezone()


async def test_a_tool_that_overruns_its_timeout_is_reported_as_timed_out() -> None:
    registry = ToolRegistry(demo_tools(TETHER_TOOL_SLOW_TASK_TIMEOUT_S="0.05"))
    result = await execute(registry, "slow_task", {"seconds": 600})
    assert result == ToolResult(
        content="tool slow_task timed out after 0.05s", is_error=True, error_code="tool_timeout"
    )


async def test_slow_task_finishes_within_its_timeout() -> None:
    result = await execute(ToolRegistry(demo_tools()), "slow_task", {"seconds": 0})
    assert result == ToolResult(content="done", is_error=False)


async def test_a_tool_error_becomes_an_error_result_with_its_message() -> None:
    result = await execute(ToolRegistry(demo_tools()), "fail_tool", {})
    assert result == ToolResult(
        content="this tool always fails", is_error=True, error_code="tool_error"
    )


async def test_an_error_output_a_tool_returns_carries_the_tool_error_code() -> None:
    tool = ScriptedTool(spec("sad"), returning("not found", is_error=True))
    result = await execute(ToolRegistry([tool]), "sad", {})
    assert (result.content, result.is_error, result.error_code) == ("not found", True, "tool_error")


async def test_a_crash_names_the_exception_type_only_and_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tool = ScriptedTool(spec("broken"), raising(KeyError("secret-token")))
    with caplog.at_level(logging.ERROR, logger=registry_module.__name__):
        result = await execute(ToolRegistry([tool]), "broken", {})
    assert result == ToolResult(
        content="tool broken failed unexpectedly (KeyError)",
        is_error=True,
        error_code="tool_crashed",
    )
    [record] = caplog.records
    assert record.exc_info is not None
    assert record.exc_info[0] is KeyError


async def test_a_timeout_raised_by_the_tool_itself_is_a_crash_not_a_timeout() -> None:
    tool = ScriptedTool(spec("own_timeout"), raising(TimeoutError()))
    result = await execute(ToolRegistry([tool]), "own_timeout", {})
    assert result.error_code == "tool_crashed"
    assert result.content == "tool own_timeout failed unexpectedly (TimeoutError)"


async def test_cancelling_the_caller_cancels_the_tool_and_propagates() -> None:
    observed = Observed(demo_tools()[2])  # slow_task
    registry = ToolRegistry([observed])
    task = asyncio.create_task(execute(registry, "slow_task", {"seconds": 600}))
    await observed.started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert observed.cancelled


# The inline cap ---------------------------------------------------------------------------------


def marker(total: int) -> str:
    return f"\n[truncated: {total} bytes total; full output stored as {REF}]"


@pytest.mark.parametrize(
    ("content", "limit", "kept"),
    [
        ("abc", 3, "abc"),  # exactly at the limit: untouched
        ("abcd", 3, "abc"),
        ("aé", 3, "aé"),  # é is 2 bytes: 3 bytes fit exactly
        ("aéb", 2, "a"),  # the cut would split é
        ("a€", 3, "a"),  # € is 3 bytes
        ("a€", 2, "a"),
        ("😀😀", 7, "😀"),  # 4-byte characters
        ("😀", 0, ""),
        ("", 0, ""),
    ],
)
def test_truncation_cuts_on_a_character_boundary(content: str, limit: int, kept: str) -> None:
    inline, truncated = truncate_inline(content, limit, REF)
    total = len(content.encode())
    if total <= limit:
        assert (inline, truncated) == (content, False)
    else:
        assert (inline, truncated) == (kept + marker(total), True)


@given(content=st.text(), limit=st.integers(min_value=0, max_value=64))
def test_truncation_keeps_the_longest_prefix_that_fits(content: str, limit: int) -> None:
    inline, truncated = truncate_inline(content, limit, REF)
    total = len(content.encode())
    assert truncated == (total > limit)
    if not truncated:
        assert inline == content
        return
    kept = inline.removesuffix(marker(total))
    assert kept != inline
    assert content.startswith(kept)
    assert len(kept.encode()) <= limit
    assert len(content[: len(kept) + 1].encode()) > limit


async def test_big_output_exactly_at_the_limit_stays_inline() -> None:
    registry = ToolRegistry(demo_tools())
    result = await execute(registry, "big_output", {"bytes": 1000}, max_inline_bytes=1000)
    assert result == ToolResult(content=big_text(1000), is_error=False)
    assert len(result.content.encode()) == 1000


async def test_big_output_one_byte_over_the_limit_is_cut_and_kept_whole_aside() -> None:
    registry = ToolRegistry(demo_tools())
    result = await execute(registry, "big_output", {"bytes": 1001}, max_inline_bytes=1000)
    assert result.truncated
    assert result.content == big_text(1000) + marker(1001)
    assert result.full_content == big_text(1001)
    assert not result.is_error


async def test_multibyte_output_is_cut_through_the_registry() -> None:
    tool = ScriptedTool(spec("accents"), returning("é" * 10))  # 20 bytes
    result = await execute(ToolRegistry([tool]), "accents", {}, max_inline_bytes=9)
    assert result.content == "é" * 4 + marker(20)
    assert result.full_content == "é" * 10


async def test_a_negative_limit_is_a_caller_bug() -> None:
    with pytest.raises(ValueError, match="max_inline_bytes"):
        await execute(ToolRegistry(demo_tools()), "get_time", {}, max_inline_bytes=-1)


# Idempotency keys -------------------------------------------------------------------------------

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
arguments_strategy = st.dictionaries(st.text(max_size=8), json_values, max_size=6)


@given(arguments=arguments_strategy, data=st.data())
def test_the_key_ignores_argument_order(arguments: dict[str, Any], data: st.DataObject) -> None:
    shuffled = dict(data.draw(st.permutations(list(arguments.items()))))
    first = idempotency_key("ten", "root", "tool", arguments)
    assert first == idempotency_key("ten", "root", "tool", shuffled)
    assert re.fullmatch(r"eff_[0-9a-f]{64}", first)


@given(left=arguments_strategy, right=arguments_strategy)
def test_different_arguments_give_different_keys(
    left: dict[str, Any], right: dict[str, Any]
) -> None:
    assume(left != right)
    assert idempotency_key("ten", "root", "tool", left) != idempotency_key(
        "ten", "root", "tool", right
    )


def test_every_part_of_the_identity_changes_the_key() -> None:
    base = idempotency_key("ten", "root", "tool", {"a": 1})
    variants = {
        idempotency_key("ten2", "root", "tool", {"a": 1}),
        idempotency_key("ten", "root2", "tool", {"a": 1}),
        idempotency_key("ten", "root", "tool2", {"a": 1}),
        idempotency_key("ten", "root", "tool", {"a": 2}),
        # The parts are list items, so moving text across a boundary is a different key.
        idempotency_key("tenr", "oot", "tool", {"a": 1}),
    }
    assert base not in variants
    assert len(variants) == 5


def test_the_key_is_stable_across_processes() -> None:
    # A fixed vector: a change here orphans every stored effect record.
    assert idempotency_key("ten_1", "run_1", "publish_post", {"text": "héllo"}) == (
        "eff_"
        + hashlib.sha256('["ten_1","run_1","publish_post",{"text":"héllo"}]'.encode()).hexdigest()
    )


def test_a_lone_surrogate_in_the_arguments_still_hashes() -> None:
    assert idempotency_key("t", "r", "n", {"text": "\ud800"}) != idempotency_key(
        "t", "r", "n", {"text": "\ud801"}
    )


# The effects record -----------------------------------------------------------------------------


def external_tool(
    name: str = "post", behaviour: Behaviour | None = None, **kw: Any
) -> ScriptedTool:
    return ScriptedTool(spec(name, external=True, **kw), behaviour or returning("posted 1"))


async def test_a_begun_effect_fires_once_and_is_finished_with_its_result() -> None:
    tool = external_tool()
    effects = MemoryEffects()
    result = await execute(ToolRegistry([tool]), "post", {"text": "hi"}, effects=effects)
    key = idempotency_key(CALL.tenant_id, CALL.root_run_id, "post", {"text": "hi"})
    assert result == ToolResult(content="posted 1", is_error=False, idempotency_key=key)
    assert effects.begins == [(key, "post")]
    assert effects.finishes == [(key, {"content": "posted 1", "is_error": False})]
    [(ctx, _)] = tool.calls
    assert ctx.idempotency_key == key


async def test_a_done_effect_is_replayed_without_firing_across_the_lineage() -> None:
    tool = external_tool()
    registry = ToolRegistry([tool])
    effects = MemoryEffects()
    first = await execute(registry, "post", {"text": "hi"}, effects=effects)
    resumed = CallContext("ten_1", "run_3", "run_1", "toolu_9")  # new run, same lineage
    again = await execute(registry, "post", {"text": "hi"}, effects=effects, call=resumed)
    assert len(tool.calls) == 1
    assert again.replayed
    assert (again.content, again.is_error, again.idempotency_key) == (
        first.content,
        False,
        first.idempotency_key,
    )
    assert len(effects.finishes) == 1


async def test_another_lineage_or_tenant_fires_anew() -> None:
    tool = external_tool()
    registry = ToolRegistry([tool])
    effects = MemoryEffects()
    await execute(registry, "post", {"text": "hi"}, effects=effects)
    await execute(
        registry, "post", {"text": "hi"}, effects=effects, call=CallContext("ten_1", "r", "r", "t")
    )
    await execute(
        registry, "post", {"text": "hi"}, effects=effects, call=CallContext("ten_2", "r", "r", "t")
    )
    assert len(tool.calls) == 3
    assert len({key for key, _ in effects.finishes}) == 3


async def test_an_in_progress_effect_fires_again_under_the_same_key() -> None:
    tool = external_tool()
    effects = MemoryEffects()
    key = idempotency_key(CALL.tenant_id, CALL.root_run_id, "post", {"text": "hi"})
    effects.states[key] = (EffectState.IN_PROGRESS, None)  # begun by a worker that died
    result = await execute(ToolRegistry([tool]), "post", {"text": "hi"}, effects=effects)
    assert not result.replayed
    [(ctx, _)] = tool.calls
    assert ctx.idempotency_key == key
    assert effects.states[key] == (EffectState.DONE, {"content": "posted 1", "is_error": False})


async def test_a_replayed_result_is_capped_like_a_fresh_one() -> None:
    effects = MemoryEffects()
    key = idempotency_key(CALL.tenant_id, CALL.root_run_id, "post", {})
    stored = {"content": "x" * 50, "is_error": False, "data": {"post_id": "p1"}}
    effects.states[key] = (EffectState.DONE, stored)
    tool = external_tool()
    result = await execute(ToolRegistry([tool]), "post", {}, effects=effects, max_inline_bytes=10)
    assert tool.calls == []
    assert result.replayed
    assert result.content == "x" * 10 + marker(50)
    assert result.full_content == "x" * 50
    assert result.data == {"post_id": "p1"}


@pytest.mark.parametrize(
    "stored", [None, {}, {"content": 1, "is_error": False}, {"content": "x", "is_error": "no"}]
)
async def test_an_unreadable_done_record_fails_closed_without_firing(
    stored: dict[str, Any] | None,
) -> None:
    effects = MemoryEffects()
    key = idempotency_key(CALL.tenant_id, CALL.root_run_id, "post", {})
    effects.states[key] = (EffectState.DONE, stored)
    tool = external_tool()
    result = await execute(ToolRegistry([tool]), "post", {}, effects=effects)
    assert tool.calls == []
    assert (result.is_error, result.replayed, result.error_code) == (
        True,
        True,
        "tool_effect_record_invalid",
    )


async def test_a_tool_error_is_a_recorded_outcome() -> None:
    tool = external_tool(behaviour=raising(ToolError("refused")))
    effects = MemoryEffects()
    result = await execute(ToolRegistry([tool]), "post", {}, effects=effects)
    assert result.error_code == "tool_error"
    assert [record for _, record in effects.finishes] == [
        {"content": "refused", "is_error": True, "error_code": "tool_error"}
    ]


async def test_a_crash_leaves_the_effect_open_and_a_retry_fires_with_the_same_key() -> None:
    outcomes: list[Behaviour] = [raising(ConnectionResetError()), returning("posted 1")]

    async def flaky(ctx: ToolContext, input: dict[str, Any]) -> ToolOutput:
        return await outcomes.pop(0)(ctx, input)

    tool = external_tool(behaviour=flaky)
    registry = ToolRegistry([tool])
    effects = MemoryEffects()
    crashed = await execute(registry, "post", {}, effects=effects)
    assert crashed.error_code == "tool_crashed"
    assert effects.finishes == []
    retried = await execute(registry, "post", {}, effects=effects)
    assert (retried.content, retried.replayed) == ("posted 1", False)
    assert [ctx.idempotency_key for ctx, _ in tool.calls] == [crashed.idempotency_key] * 2
    assert len(effects.finishes) == 1


async def test_a_timeout_leaves_the_effect_open() -> None:
    tool = external_tool(behaviour=forever, timeout_s=0.05)
    effects = MemoryEffects()
    result = await execute(ToolRegistry([tool]), "post", {}, effects=effects)
    assert result.error_code == "tool_timeout"
    assert effects.finishes == []
    assert [state for state, _ in effects.states.values()] == [EffectState.IN_PROGRESS]


async def test_cancelling_an_external_tool_leaves_the_effect_open() -> None:
    observed = Observed(external_tool(behaviour=forever))
    effects = MemoryEffects()
    task = asyncio.create_task(execute(ToolRegistry([observed]), "post", {}, effects=effects))
    await observed.started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert observed.cancelled
    assert effects.finishes == []


async def test_recording_the_outcome_survives_a_cancellation_arriving_meanwhile() -> None:
    effects = MemoryEffects()
    effects.finish_gate = asyncio.Event()
    task = asyncio.create_task(
        execute(ToolRegistry([external_tool()]), "post", {}, effects=effects)
    )
    await effects.finish_entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    effects.finish_gate.set()

    async def finished() -> bool:
        return len(effects.finishes) == 1

    await eventually(finished, what="the shielded finish")


# Demo publish_post without a ledger -------------------------------------------------------------


async def test_publish_post_without_a_ledger_keeps_posts_in_process_once_per_key() -> None:
    tools = demo_tools()
    registry = ToolRegistry(tools)
    effects = MemoryEffects()
    first = await execute(registry, "publish_post", {"text": "hi"}, effects=effects)
    assert re.fullmatch(r"published post post_[0-9a-f]{12} \(kept in-process: .*\)", first.content)
    # Even a lost effects record does not double the post: the key reaches the "system".
    again = await execute(registry, "publish_post", {"text": "hi"}, effects=MemoryEffects())
    assert again.content == first.content
    assert len(tools[1].local_posts) == 1  # type: ignore[attr-defined]  # PublishPost


async def test_publish_post_refuses_to_run_without_a_key() -> None:
    publish = demo_tools()[1]
    with pytest.raises(ToolError, match="idempotency key"):
        await publish.run(CALL.with_key(None), {"text": "hi"})


# Entry points -----------------------------------------------------------------------------------


def test_the_demo_provider_is_found_through_its_entry_point() -> None:
    registry = ToolRegistry.from_entry_points(settings={})
    assert set(DEMO_NAMES) <= set(registry.names)
    publish = registry.get("publish_post")
    assert publish is not None
    assert publish.spec.writes_externally
    assert publish.spec.risk is RiskCategory.PUBLISH
    assert registry.get("nope") is None


class ProviderClass:
    """An entry point may name a provider class: it is called with no arguments."""

    def tools(self, settings: Mapping[str, str]) -> Sequence[Tool]:
        return [ScriptedTool(spec(settings["NAME"]), returning("x"))]


def make_provider() -> ProviderClass:
    return ProviderClass()


NOT_A_PROVIDER = 42


def test_entry_points_may_name_a_provider_a_class_or_a_factory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    here = __name__
    points = {
        "objects": [EntryPoint("a", "services.worker.tools.demo:provider", "objects")],
        "classes": [EntryPoint("b", f"{here}:ProviderClass", "classes")],
        "factories": [EntryPoint("c", f"{here}:make_provider", "factories")],
        "broken": [EntryPoint("d", f"{here}:NOT_A_PROVIDER", "broken")],
    }
    monkeypatch.setattr(registry_module, "entry_points", lambda group: points[group])
    settings = {"NAME": "named"}
    assert ToolRegistry.from_entry_points("objects", settings=settings).names == DEMO_NAMES
    assert ToolRegistry.from_entry_points("classes", settings=settings).names == ["named"]
    assert ToolRegistry.from_entry_points("factories", settings=settings).names == ["named"]
    with pytest.raises(TypeError, match="'d'"):
        ToolRegistry.from_entry_points("broken", settings=settings)


# The schema subset ------------------------------------------------------------------------------

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 2, "maxLength": 4, "description": "a name"},
        "count": {"type": "integer", "minimum": 1, "maximum": 3},
        "ratio": {"type": "number", "minimum": 0, "maximum": 1},
        "flag": {"type": "boolean"},
        "mode": {"enum": ["a", 1, True]},
        "maybe": {"type": ["string", "null"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 2}},
        "nested": {
            "type": "object",
            "properties": {"id": {"type": "integer"}},
            "required": ["id"],
            "additionalProperties": {"type": "string"},
        },
    },
    "required": ["name"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    "instance",
    [
        {"name": "ab"},
        {"name": "abcd", "count": 3, "ratio": 0.5, "flag": False, "mode": "a", "maybe": None},
        {"name": "ab", "ratio": 1, "mode": True, "maybe": "x", "tags": ["ab", ""]},
        {"name": "ab", "mode": 1, "nested": {"id": 2, "other": "text"}},
    ],
)
def test_the_schema_subset_accepts(instance: dict[str, Any]) -> None:
    check_schema(SCHEMA)
    assert validate(SCHEMA, instance) == []


@pytest.mark.parametrize(
    ("instance", "reasons"),
    [
        ([], ["input: must be of type object"]),
        ({}, ["input.name: is required"]),
        ({"name": "a"}, ["input.name: must be at least 2 characters long"]),
        ({"name": "abcde"}, ["input.name: must be at most 4 characters long"]),
        ({"name": "ab", "count": 0}, ["input.count: must be >= 1"]),
        ({"name": "ab", "count": 4}, ["input.count: must be <= 3"]),
        ({"name": "ab", "count": 2.0}, ["input.count: must be of type integer"]),
        ({"name": "ab", "count": True}, ["input.count: must be of type integer"]),
        ({"name": "ab", "ratio": float("nan")}, ["input.ratio: must be of type number"]),
        ({"name": "ab", "ratio": False}, ["input.ratio: must be of type number"]),
        ({"name": "ab", "flag": 1}, ["input.flag: must be of type boolean"]),
        ({"name": "ab", "mode": "b"}, ["input.mode: must be one of ['a', 1, True]"]),
        ({"name": "ab", "mode": 1.5}, ["input.mode: must be one of ['a', 1, True]"]),
        ({"name": "ab", "maybe": 3}, ["input.maybe: must be of type string or null"]),
        (
            {"name": "ab", "tags": ["ok", "long"]},
            ["input.tags[1]: must be at most 2 characters long"],
        ),
        ({"name": "ab", "nested": {}}, ["input.nested.id: is required"]),
        ({"name": "ab", "nested": {"id": 1, "x": 2}}, ["input.nested.x: must be of type string"]),
        ({"name": "ab", "zzz": 1}, ["input.zzz: is not an allowed property"]),
        (
            {"count": 9, "flag": "no"},
            [
                "input.count: must be <= 3",
                "input.flag: must be of type boolean",
                "input.name: is required",
            ],
        ),
    ],
)
def test_the_schema_subset_refuses(instance: Any, reasons: list[str]) -> None:
    assert [str(v) for v in validate(SCHEMA, instance)] == reasons


def test_normalize_turns_integral_floats_into_ints_only_where_the_schema_says_integer() -> None:
    raw = {
        "count": 2.0,
        "ratio": 1.0,
        "name": 3.0,
        "nested": {"id": 4.0, "other": 5.0},
        "tags": [1.0],
        "undeclared": 6.0,
    }
    assert normalize(SCHEMA, raw) == raw  # equal as numbers ...
    normalized = normalize(SCHEMA, raw)
    kinds = {
        "count": type(normalized["count"]),
        "ratio": type(normalized["ratio"]),
        "name": type(normalized["name"]),
        "id": type(normalized["nested"]["id"]),
        "other": type(normalized["nested"]["other"]),
        "undeclared": type(normalized["undeclared"]),
    }
    # ... but only integer fields change kind.
    assert kinds == {
        "count": int,
        "ratio": float,
        "name": float,
        "id": int,
        "other": float,
        "undeclared": float,
    }
    assert type(raw["count"]) is float  # the input is left alone
    assert normalize({"type": "array", "items": {"type": "integer"}}, [1.0, 1.5]) == [1, 1.5]
    assert type(normalize({"type": ["integer", "null"]}, 2.0)) is int
    assert type(normalize({"type": ["integer", "number"]}, 2.0)) is float


def test_true_is_not_one_in_an_enum() -> None:
    assert validate({"enum": [1]}, True) != []
    assert validate({"enum": [True]}, 1) != []
    assert validate({"enum": [1]}, 1.0) == []


@pytest.mark.parametrize(
    ("schema", "match"),
    [
        ({"type": "object", "oneOf": []}, "oneOf"),
        ({"type": "object", "properties": {"a": {"format": "uri"}}}, r"input\.a: format 'uri'"),
        ({"type": "tuple"}, "invalid schema at '/type'"),
        ({"type": 3}, "invalid schema at '/type'"),
        ({"type": "object", "required": "a"}, "invalid schema at '/required'"),
        ({"type": "object", "properties": {"a": 1}}, "invalid schema at '/properties/a'"),
        ({"type": "array", "items": {"maxLenght": 2}}, r"input\.items: .*\['maxLenght'\]"),
        ({"type": "object", "additionalProperties": {"contentMediaType": "x"}}, "contentMediaType"),
    ],
)
def test_check_schema_refuses_what_it_cannot_enforce(schema: dict[str, Any], match: str) -> None:
    with pytest.raises(SchemaError, match=match):
        check_schema(schema)


# Keywords beyond the subset the worker once enforced by hand, now jsonschema's.
RICHER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "slug": {"type": "string", "pattern": "^[a-z-]+$"},
        "kind": {"const": "post"},
        "to": {"type": "string", "format": "email"},
        "tags": {"type": "array", "minItems": 1, "uniqueItems": True},
        "when": {"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 5}]},
    },
    "patternProperties": {"^x-": {"type": "string"}},
    "additionalProperties": False,
}


def test_keywords_beyond_the_old_subset_are_enforced_and_worded_for_the_model() -> None:
    check_schema(RICHER)
    good = {"slug": "a-b", "kind": "post", "to": "a@b.c", "tags": [1], "when": 3, "x-y": "z"}
    assert validate(RICHER, good) == []
    bad = {"slug": "A B", "kind": "page", "to": "nobody", "tags": [], "when": 1.5, "x-y": 1, "q": 0}
    assert [str(v) for v in validate(RICHER, bad)] == [
        "input.kind: 'post' was expected",
        "input.q: is not an allowed property",
        "input.slug: 'A B' does not match '^[a-z-]+$'",
        "input.tags: [] should be non-empty",
        "input.to: 'nobody' is not a 'email'",
        "input.when: 1.5 is not valid under any of the given schemas",
        "input.x-y: must be of type string",
    ]


def test_a_compiled_input_schema_answers_as_validate_does() -> None:
    compiled = InputSchema(SCHEMA)
    for instance in ({}, {"name": "ab", "count": 9, "zzz": 1}, {"name": "ok"}):
        assert compiled.violations(instance) == validate(SCHEMA, instance)
