"""The path of one tool call, after the approval gate: allowlist -> known tool -> input normalised
and checked against the schema -> authorization of a gated call -> effects record (tools that
write externally) -> run under the tool's timeout, cancellably -> record the result -> cap the
inline output.

Every expected failure becomes an error result with a stable `error_code` for the model; only
cancellation, a `ConnectionGap` and failures of the effects record itself propagate to the
caller. `tether.tools.calls` puts the approval gate and the connection pause in front of this;
the worker and the test kit (`tether.testing.tools`) both call through there.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from tether.domain import EffectState
from tether.tools.base import (
    GATED_RISKS,
    Authorization,
    CallContext,
    ConnectionGap,
    RiskCategory,
    Tool,
    ToolContext,
    ToolError,
    UnsettledCall,
)
from tether.tools.effects import EffectsPort, idempotency_key
from tether.tools.schema import InputSchema, normalize

log = logging.getLogger(__name__)

# Enough to fix several fields in one go without flooding the model's context.
MAX_REPORTED_VIOLATIONS = 5
_UTF8_CONTINUATION_MASK = 0xC0
_UTF8_CONTINUATION_BITS = 0x80


class ToolErrorCode(StrEnum):
    """Stable codes of the error results the path produces."""

    NOT_ALLOWED = "tool_not_allowed"
    UNKNOWN = "tool_unknown"
    INVALID_INPUT = "tool_invalid_input"
    TIMEOUT = "tool_timeout"
    ERROR = "tool_error"
    CRASHED = "tool_crashed"
    EFFECT_RECORD_INVALID = "tool_effect_record_invalid"
    APPROVAL_REQUIRED = "approval_required"


@dataclass(frozen=True)
class ToolResult:
    """The outcome of one call, ready for the model.

    `content` is what goes inline, at most `max_inline_bytes` of the output plus a marker line
    naming `output_ref` when it was cut; `full_content` is then the whole output, for the caller
    to store under that ref (None when nothing was cut). `replayed` means the effects record
    already held this call's result and the tool did not fire. `idempotency_key` is the key the
    call ran (or was replayed) under, None for tools that do not write externally. `ends_run`
    marks a result the run cannot go on from (a connection gap nobody can close).
    """

    content: str
    is_error: bool
    error_code: str | None = None
    full_content: str | None = None
    truncated: bool = False
    replayed: bool = False
    data: dict[str, Any] | None = None
    idempotency_key: str | None = None
    ends_run: bool = False


class PreparedTool:
    """A tool with its input schema checked and compiled, once (not per call)."""

    def __init__(self, tool: Tool) -> None:
        """Raises SchemaError on a schema the validator would not enforce whole (a typo'd
        keyword, an unchecked format), ValueError unless the schema has type object."""
        spec = tool.spec
        self.tool = tool
        self.spec = spec
        self.input = InputSchema(spec.input_schema, f"{spec.name}.input_schema")
        if spec.input_schema.get("type") != "object":
            raise ValueError(f"{spec.name}: input_schema must have type object")

    def check(self, input: dict[str, Any]) -> tuple[dict[str, Any], str]:
        """(normalised input, the problems with it or ""): worded for the model to fix."""
        normalised = normalize(self.spec.input_schema, input)
        violations = self.input.violations(normalised)
        reasons = "; ".join(str(v) for v in violations[:MAX_REPORTED_VIOLATIONS])
        more = len(violations) - MAX_REPORTED_VIOLATIONS
        if more > 0:
            reasons += f"; and {more} more"
        return normalised, reasons


class Catalog(Protocol):
    """Where the path finds a tool by name (the worker's registry, the test kit's one tool)."""

    def prepared(self, name: str) -> PreparedTool | None:
        """The tool named `name`, prepared, or None."""
        ...


@dataclass(frozen=True)
class _Outcome:
    content: str
    is_error: bool
    error_code: str | None = None
    data: dict[str, Any] | None = None

    def as_record(self) -> dict[str, Any]:
        record: dict[str, Any] = {"content": self.content, "is_error": self.is_error}
        if self.error_code is not None:
            record["error_code"] = self.error_code
        if self.data is not None:
            record["data"] = self.data
        return record

    @classmethod
    def from_record(cls, record: Mapping[str, Any] | None) -> _Outcome | None:
        if record is None:
            return None
        content, is_error = record.get("content"), record.get("is_error")
        error_code, data = record.get("error_code"), record.get("data")
        if not isinstance(content, str) or not isinstance(is_error, bool):
            return None
        if error_code is not None and not isinstance(error_code, str):
            return None
        if data is not None and not isinstance(data, dict):
            return None
        return cls(content, is_error, error_code, data)


async def execute(
    catalog: Catalog,
    name: str,
    input: dict[str, Any],
    call: CallContext,
    *,
    effects: EffectsPort,
    allowlist: Collection[str],
    max_inline_bytes: int,
    output_ref: str,
    authorization: Authorization | None = None,
) -> ToolResult:
    """Run one tool call; see the module docstring for the order of checks.

    A tool in a gated risk category runs only with an `authorization` for this tool and
    this run (a standing grant, or a claimed approval); without one it is refused, so the
    approval gate cannot be bypassed by executing the tool directly.

    For a tool that writes externally the result is recorded with `effects.finish` whenever
    the tool returned or raised ToolError. It is not recorded when the tool timed out or
    crashed: the external write may have happened, and the open record makes a retry fire
    again under the same key, which the external system deduplicates.

    Raises CancelledError when the caller is cancelled (the tool is cancelled with it, its
    `ctx.cancelled` set), ConnectionGap, and whatever `effects.begin`/`finish` raise: without
    the record, firing is not safe.
    """
    if max_inline_bytes < 0:
        raise ValueError("max_inline_bytes must not be negative")
    if name not in allowlist:
        return _refusal(ToolErrorCode.NOT_ALLOWED, f"tool {name} is not available to this agent")
    prepared = catalog.prepared(name)
    if prepared is None:
        return _refusal(ToolErrorCode.UNKNOWN, f"tool {name} is not registered")
    spec = prepared.spec
    # Normalized before the key is derived, so 5 and 5.0 name the same effect.
    input, problems = prepared.check(input)
    if problems:
        return _refusal(ToolErrorCode.INVALID_INPUT, f"invalid input for tool {name}: {problems}")

    refusal = _check_authorization(spec.name, spec.risk, call, authorization)
    if refusal is not None:
        return refusal

    key: str | None = None
    if spec.writes_externally:
        key = idempotency_key(call.tenant_id, call.root_run_id, name, input)
        state, stored = await effects.begin(key, name)
        if state is EffectState.DONE:
            return _replay(name, key, stored, max_inline_bytes, output_ref)
        if state is EffectState.IN_PROGRESS:
            log.warning(
                "effect %s of tool %s was begun and never finished; firing again under the "
                "same key (run %s)",
                key,
                name,
                call.run_id,
            )

    outcome, record = await _run(prepared.tool, call.with_key(key), input)
    if record and key is not None:
        # The tool has fired: losing its result to a cancellation arriving now would make
        # the retry fire again, so the write of the outcome runs to the end regardless.
        await asyncio.shield(effects.finish(key, outcome.as_record()))
    return _result(outcome, max_inline_bytes, output_ref, replayed=False, key=key)


def _replay(
    name: str, key: str, stored: dict[str, Any] | None, max_inline_bytes: int, output_ref: str
) -> ToolResult:
    outcome = _Outcome.from_record(stored)
    if outcome is None:
        # Fail closed: the effect happened, so firing again is wrong, and the stored
        # result cannot be shown; the model is told the action was already taken.
        log.error("effect %s of tool %s is done but its stored result is unreadable", key, name)
        outcome = _Outcome(
            f"tool {name} already ran for this call, but its result is unavailable",
            is_error=True,
            error_code=ToolErrorCode.EFFECT_RECORD_INVALID,
        )
    return _result(outcome, max_inline_bytes, output_ref, replayed=True, key=key)


def _check_authorization(
    name: str, risk: RiskCategory, call: CallContext, authorization: Authorization | None
) -> ToolResult | None:
    if risk not in GATED_RISKS:
        return None
    # Fail closed: no authorization, one for another tool, or one from another run.
    if authorization is None or authorization.tool_name != name:
        return _refusal(
            ToolErrorCode.APPROVAL_REQUIRED,
            f"tool {name} ({risk}) needs an approval before it can run",
        )
    if authorization.run_id != call.run_id:
        return _refusal(
            ToolErrorCode.APPROVAL_REQUIRED, f"the approval for tool {name} belongs to another run"
        )
    return None


def truncate_inline(content: str, max_inline_bytes: int, output_ref: str) -> tuple[str, bool]:
    """Cut `content` to at most `max_inline_bytes` UTF-8 bytes on a character boundary.

    Returns the inline text and whether it was cut; a cut text ends with the marker line
    `[truncated: N bytes total; full output stored as <output_ref>]`, which is not counted
    in the limit. Unencodable characters (lone surrogates) count as the "?" they become.
    """
    encoded = content.encode("utf-8", "replace")
    if len(encoded) <= max_inline_bytes:
        return content, False
    cut = max_inline_bytes
    # Back off while the first dropped byte continues a character the cut would split.
    while cut > 0 and encoded[cut] & _UTF8_CONTINUATION_MASK == _UTF8_CONTINUATION_BITS:
        cut -= 1
    kept = encoded[:cut].decode("utf-8")
    marker = f"\n[truncated: {len(encoded)} bytes total; full output stored as {output_ref}]"
    return kept + marker, True


async def _run(tool: Tool, ctx: ToolContext, input: dict[str, Any]) -> tuple[_Outcome, bool]:
    """Run the tool under its timeout; returns the outcome and whether to record it."""
    spec = tool.spec
    deadline = asyncio.timeout(spec.timeout_s)
    try:
        async with deadline:
            output = await tool.run(ctx, input)
    except asyncio.CancelledError:
        ctx.cancelled.set()  # for work the task's cancellation cannot reach (threads, loops)
        raise
    except ConnectionGap:
        raise  # structural: the caller decides whether the run pauses for consent
    except UnsettledCall as exc:
        return _Outcome(str(exc) or f"tool {spec.name} failed", True, exc.code), False
    except ToolError as exc:
        return _Outcome(str(exc) or f"tool {spec.name} failed", True, ToolErrorCode.ERROR), True
    except TimeoutError:
        if deadline.expired():
            ctx.cancelled.set()
            message = f"tool {spec.name} timed out after {spec.timeout_s:g}s"
            return _Outcome(message, True, ToolErrorCode.TIMEOUT), False
        return _crashed(spec.name, ctx, TimeoutError), False
    except Exception as exc:
        return _crashed(spec.name, ctx, type(exc)), False
    code = ToolErrorCode.ERROR if output.is_error else None
    return _Outcome(output.content, output.is_error, code, output.data), True


def _crashed(name: str, ctx: ToolContext, kind: type[BaseException]) -> _Outcome:
    # The traceback is for operators; the model only learns that the tool broke and how.
    log.exception("tool %s crashed (call %s, run %s)", name, ctx.tool_call_id, ctx.run_id)
    message = f"tool {name} failed unexpectedly ({kind.__name__})"
    return _Outcome(message, True, ToolErrorCode.CRASHED)


def refusal(code: str, message: str, *, ends_run: bool = False) -> ToolResult:
    """An error result the path gives without running the tool."""
    return ToolResult(content=message, is_error=True, error_code=code, ends_run=ends_run)


def _refusal(code: ToolErrorCode, message: str) -> ToolResult:
    return ToolResult(content=message, is_error=True, error_code=code)


def _result(
    outcome: _Outcome, max_inline_bytes: int, output_ref: str, *, replayed: bool, key: str | None
) -> ToolResult:
    inline, truncated = truncate_inline(outcome.content, max_inline_bytes, output_ref)
    return ToolResult(
        content=inline,
        is_error=outcome.is_error,
        error_code=outcome.error_code,
        full_content=outcome.content if truncated else None,
        truncated=truncated,
        replayed=replayed,
        data=outcome.data,
        idempotency_key=key,
    )
