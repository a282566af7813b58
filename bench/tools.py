"""`make bench BENCH=tools`: what the tool path costs a run, one figure per line.

- `tool_validate_share_of_turn`: the check every call of a demo tool pays before it runs
  (normalise, then validate against the tool's compiled schema: `PreparedTool.check`, the path's
  own), for the slowest demo tool, over the median of one model turn against the local model
  server: the turn in which such a call is made (a streamed Messages call offering the demo
  tools, answered with a `tool_use` of the slowest one). The stand-in answers faster than any
  real provider, so the share is an upper bound. Goal: <= 0.01.

- `mcp_run_vs_local_tool_p50` (bench/tools_mcp.py): p50 of a run making one MCP read call over
  the same run making one built-in read tool call, at light load, end to end. Goal: <= 1.2.

Each figure is a function in FIGURES; a figure that needs more (a stack, an MCP server) adds its
own and its setup stays inside it.
"""

from __future__ import annotations

import statistics
import time
import timeit
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from anthropic import AsyncAnthropic

from bench.common import emit
from bench.model import BENCH_REQUEST, model_server, streamed_call
from bench.tools_mcp import mcp_run_vs_local_tool_p50
from services.worker.tools.demo import DemoProvider
from tether.tools.path import PreparedTool

# A valid input per demo tool, as a model would send it (numbers as doubles, as tool calls carry
# them).
DEMO_INPUTS: dict[str, dict[str, Any]] = {
    "get_time": {},
    "publish_post": {"text": "Hello from the bench: a post of ordinary length, one sentence."},
    "slow_task": {"seconds": 1.0},
    "big_output": {"bytes": 4096.0},
    "fail_tool": {},
    "calendar_list_events": {},
}
CALLS = 2_000
SAMPLES = 7
TURNS = 40
WARMUP_TURNS = 5


def validate_us() -> dict[str, float]:
    """Per demo tool: the median over SAMPLES of the mean time of one check, in microseconds."""
    figures: dict[str, float] = {}
    for tool in DemoProvider().tools({}):
        prepared, instance = PreparedTool(tool), DEMO_INPUTS[tool.spec.name]
        _, problems = prepared.check(instance)
        assert not problems, f"{tool.spec.name}: the bench's input is invalid: {problems}"
        samples = timeit.repeat(
            lambda p=prepared, i=instance: p.check(i), number=CALLS, repeat=SAMPLES
        )
        figures[tool.spec.name] = statistics.median(samples) / CALLS * 1e6
    return figures


async def turn_median_ms(tool_name: str) -> float:
    """The median of TURNS streamed model turns against the local model server, in ms: the demo
    tools offered, the answer a `tool_use` of `tool_name` with its bench input."""
    tools = [tool.spec.to_anthropic() for tool in DemoProvider().tools({})]
    request = {**BENCH_REQUEST, "tools": tools}
    call = {"kind": "tool_use", "name": tool_name, "input": DEMO_INPUTS[tool_name]}
    key = f"tools-bench-{uuid.uuid4().hex[:8]}"
    async with model_server() as model:
        await model.script(key, [call] * (WARMUP_TURNS + TURNS))
        headers = {"x-tether-script": key}
        sdk = AsyncAnthropic(base_url=model.base_url, api_key="bench", max_retries=0)
        try:
            for _ in range(WARMUP_TURNS):
                await streamed_call(sdk, request, headers)
            samples = []
            for _ in range(TURNS):
                start = time.perf_counter()
                await streamed_call(sdk, request, headers)
                samples.append((time.perf_counter() - start) * 1000)
        finally:
            await sdk.close()
    return statistics.median(samples)


async def tool_validate_share_of_turn() -> None:
    """The slowest demo tool's check over one model turn's median (see the module)."""
    per_tool = validate_us()
    slowest = max(per_tool, key=lambda name: per_tool[name])
    turn_ms = await turn_median_ms(slowest)
    emit(
        "tool_validate_share_of_turn",
        per_tool[slowest] / 1000 / turn_ms,
        "ratio",
        goal="<= 0.01",
        slowest_tool=slowest,
        validate_us={name: round(us, 2) for name, us in per_tool.items()},
        turn_median_ms=round(turn_ms, 3),
        turns=TURNS,
    )


FIGURES: tuple[Callable[[], Awaitable[None]], ...] = (
    tool_validate_share_of_turn,
    mcp_run_vs_local_tool_p50,
)


async def run() -> None:
    """Print every figure of the group."""
    for figure in FIGURES:
        await figure()
