"""Demo tools: the `demo` provider of the `tether.tools` entry-point group.

They exist to exercise the runtime end to end: a read (`get_time`), an external write behind an
idempotency key (`publish_post`, against `tether.testing.ledger`), a long cancellable wait
(`slow_task`), an oversized output (`big_output`) and an expected failure (`fail_tool`).

Settings read (all optional):

- `TETHER_TOOL_LEDGER_URL`: base URL of the ledger `publish_post` writes to. Unset, posts are
  kept in a list inside the process and the output says so.
- `TETHER_TOOL_SLOW_TASK_TIMEOUT_S`: `slow_task`'s timeout (default 30), so tests can reach
  `tool_timeout` quickly.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx2

from tether.tools.base import (
    RiskCategory,
    Tool,
    ToolContext,
    ToolError,
    ToolOutput,
    ToolSpec,
)

LEDGER_URL_SETTING = "TETHER_TOOL_LEDGER_URL"
SLOW_TASK_TIMEOUT_SETTING = "TETHER_TOOL_SLOW_TASK_TIMEOUT_S"
# Well inside publish_post's 30 s tool timeout, so a hung ledger surfaces as an HTTP error.
LEDGER_HTTP_TIMEOUT_S = 10.0
# A line of 64 ASCII bytes: big_output's byte count is its character count, and a cut is visible.
_BIG_OUTPUT_LINE = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ!\n"

_NO_INPUT: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


class LedgerUnavailable(Exception):
    """The ledger could not be reached or failed, so whether the post happened is unknown.

    Deliberately not a ToolError: the effect stays open and a retry fires again under the same
    key, which the ledger deduplicates.
    """


class GetTime:
    """`get_time`: the current UTC time."""

    spec = ToolSpec(
        name="get_time",
        description="Returns the current time in UTC as an ISO 8601 string.",
        input_schema=_NO_INPUT,
    )

    async def run(self, ctx: ToolContext, input: dict[str, Any]) -> ToolOutput:
        """Read the clock."""
        return ToolOutput(datetime.now(UTC).isoformat())


@dataclass(frozen=True)
class LocalPost:
    """A post `publish_post` kept in-process because no ledger was configured."""

    id: str
    idempotency_key: str
    body: dict[str, Any]


@dataclass
class PublishPost:
    """`publish_post`: an external write, deduplicated by the ledger on the idempotency key."""

    # Not a dataclass field (no annotation): the spec is the same for every instance.
    spec = ToolSpec(
        name="publish_post",
        description="Publishes a post with the given text. Returns the post id.",
        input_schema={
            "type": "object",
            "properties": {
                "text": {
                    "type": "string",
                    "minLength": 1,
                    "maxLength": 2000,
                    "description": "The text of the post.",
                }
            },
            "required": ["text"],
            "additionalProperties": False,
        },
        risk=RiskCategory.PUBLISH,
        writes_externally=True,
    )

    ledger_url: str | None
    local_posts: list[LocalPost] = field(default_factory=list)

    async def run(self, ctx: ToolContext, input: dict[str, Any]) -> ToolOutput:
        """Publish `input["text"]` under `ctx.idempotency_key`."""
        key = ctx.idempotency_key
        if key is None:
            # Fail closed: without a key a retry would publish twice.
            raise ToolError("publish_post needs an idempotency key and was called without one")
        body = {
            "tool": "publish_post",
            "text": input["text"],
            "tenant_id": ctx.tenant_id,
            "run_id": ctx.run_id,
        }
        if self.ledger_url is None:
            post = self._publish_locally(key, body)
            return ToolOutput(
                f"published post {post.id} (kept in-process: {LEDGER_URL_SETTING} is not set)",
                data={"post_id": post.id},
            )
        post_id, replayed = await self._publish_to_ledger(self.ledger_url, key, body)
        return ToolOutput(
            f"published post {post_id}", data={"post_id": post_id, "replayed": replayed}
        )

    def _publish_locally(self, key: str, body: dict[str, Any]) -> LocalPost:
        for post in self.local_posts:
            if post.idempotency_key == key:
                return post
        post = LocalPost(id=f"post_{uuid.uuid4().hex[:12]}", idempotency_key=key, body=body)
        self.local_posts.append(post)
        return post

    async def _publish_to_ledger(
        self, base_url: str, key: str, body: dict[str, Any]
    ) -> tuple[str, bool]:
        try:
            async with httpx2.AsyncClient(base_url=base_url, timeout=LEDGER_HTTP_TIMEOUT_S) as http:
                response = await http.post("/effects", json=body, headers={"Idempotency-Key": key})
        except httpx2.HTTPError as exc:
            raise LedgerUnavailable(f"ledger request failed: {exc!r}") from exc
        if response.status_code >= 500:
            raise LedgerUnavailable(f"ledger answered {response.status_code}")
        if response.status_code >= 400:
            # A 4xx is a definite refusal: nothing was written, and trying again will not help.
            raise ToolError(f"the ledger refused the post ({response.status_code})")
        payload = response.json()
        return str(payload["id"]), bool(payload.get("replayed", False))


@dataclass
class SlowTask:
    """`slow_task`: waits, cancellably; for cancellation and timeout tests."""

    timeout_s: float = 30.0

    @property
    def spec(self) -> ToolSpec:
        """The spec, carrying the configured timeout."""
        return ToolSpec(
            name="slow_task",
            description="Waits for the given number of seconds, then returns 'done'.",
            input_schema={
                "type": "object",
                "properties": {"seconds": {"type": "number", "minimum": 0, "maximum": 600}},
                "required": ["seconds"],
                "additionalProperties": False,
            },
            timeout_s=self.timeout_s,
        )

    async def run(self, ctx: ToolContext, input: dict[str, Any]) -> ToolOutput:
        """Sleep `input["seconds"]`; cancellation ends the sleep at once."""
        await asyncio.sleep(input["seconds"])
        return ToolOutput("done")


class BigOutput:
    """`big_output`: exactly N bytes of deterministic ASCII text; for inline-cap tests."""

    spec = ToolSpec(
        name="big_output",
        description="Returns the given number of bytes of deterministic text.",
        input_schema={
            "type": "object",
            "properties": {"bytes": {"type": "integer", "minimum": 1, "maximum": 10_000_000}},
            "required": ["bytes"],
            "additionalProperties": False,
        },
    )

    async def run(self, ctx: ToolContext, input: dict[str, Any]) -> ToolOutput:
        """Build the text."""
        return ToolOutput(big_text(input["bytes"]))


class FailTool:
    """`fail_tool`: always fails with a ToolError."""

    spec = ToolSpec(
        name="fail_tool",
        description="Always fails. Useful to see how errors are reported.",
        input_schema=_NO_INPUT,
    )

    async def run(self, ctx: ToolContext, input: dict[str, Any]) -> ToolOutput:
        """Fail."""
        raise ToolError("this tool always fails")


def big_text(size: int) -> str:
    """`size` bytes (and characters) of the repeating line `big_output` returns."""
    repeats = size // len(_BIG_OUTPUT_LINE) + 1
    return (_BIG_OUTPUT_LINE * repeats)[:size]


class CalendarListEvents:
    """`calendar_list_events`: reads the person's calendar through the OAuth-connected
    `democal` provider; without a usable connection it raises a ConnectionGap."""

    spec = ToolSpec(
        name="calendar_list_events",
        description="Lists the user's upcoming calendar events (needs a connected calendar).",
        input_schema=_NO_INPUT,
    )

    async def run(self, ctx: ToolContext, input: dict[str, Any]) -> ToolOutput:
        """The events, as the provider would answer with the token."""
        if ctx.connections is None:
            raise ToolError("calendar_list_events needs a connection resolver; none is wired")
        token = await ctx.connections.token("democal", ["calendar.read"])
        return ToolOutput(
            f"Upcoming events (read with token {token[:8]}...): 10:00 stand-up; 14:00 review.",
            data={"events": ["stand-up", "review"]},
        )


class DemoProvider:
    """The demo tools, configured from env-like settings (see the module docstring)."""

    def tools(self, settings: Mapping[str, str]) -> Sequence[Tool]:
        """A fresh set of the five demo tools."""
        ledger_url = settings.get(LEDGER_URL_SETTING) or None
        slow_timeout = float(settings.get(SLOW_TASK_TIMEOUT_SETTING, "30"))
        return [
            GetTime(),
            PublishPost(ledger_url=ledger_url),
            SlowTask(timeout_s=slow_timeout),
            BigOutput(),
            FailTool(),
            CalendarListEvents(),
        ]


provider = DemoProvider()
