"""`make bench BENCH=ratelimit`: shared model rate limits against the model server enforcing
the same limit (issue 32).

The model server answers 429 past `input_tokens=LIMIT` per WINDOW_S (per API key); the
orchestrator keeps the same limit (TETHER_MODEL_LIMITS) for the pool of WORKERS workers. After
one run measures the tokens a run's call takes, runs are admitted at twice the pace the limit
admits, for DEMAND_S seconds, and every one is waited for.

- `rate_limited_429_pct`: the model server's 429 answers over every model request it saw
  (goal <= 1).
- `rate_limit_utilisation_pct`: the input tokens answered in the contended window (from one
  window after the first admission, while runs still wait, to the last answer) over what the
  limit allows in it (goal >= 90).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from bench.common import bench_stack, emit
from bench.model import PROMPT, Model, model_server
from tether.client import TetherClient
from tether.v1 import common_pb2

WINDOW_S = 10.0
LIMIT = 6000  # input tokens per window, per API key
DEMAND_S = 30.0  # how long runs are admitted at twice the limit's pace
WORKERS = 2
TIMEOUT_S = 240.0
SERVICES = ("orchestrator", "admission", "gateway")
_TERMINAL = {
    common_pb2.RUN_STATUS_COMPLETED: "completed",
    common_pb2.RUN_STATUS_FAILED: "failed",
    common_pb2.RUN_STATUS_CANCELLED: "cancelled",
}


async def _log(model: Model) -> list[dict[str, Any]]:
    async with model.http.get(f"{model.base_url}/_requests") as response:
        response.raise_for_status()
        log: list[dict[str, Any]] = (await response.json())["requests"]
    return [r for r in log if r["path"] == "/v1/messages"]


def _prompt_tokens(request: dict[str, Any]) -> int:
    """The input tokens the model server's limiter counted for a request: the whole prompt,
    cached or not."""
    usage = request["usage"]
    return int(
        usage["input_tokens"]
        + usage.get("cache_creation_input_tokens", 0)
        + usage.get("cache_read_input_tokens", 0)
    )


async def _wait_done(client: TetherClient, run_ids: list[str]) -> dict[str, int]:
    """Every run's terminal status (polled), within TIMEOUT_S."""
    deadline = time.monotonic() + TIMEOUT_S
    statuses: dict[str, str] = {}
    while time.monotonic() < deadline:
        for run_id in run_ids:
            if run_id not in statuses:
                reached = (await client.get_run(run_id)).run.status
                if reached in _TERMINAL:
                    statuses[run_id] = _TERMINAL[reached]
        if len(statuses) == len(run_ids):
            break
        await asyncio.sleep(0.5)
    counts: dict[str, int] = {}
    for ended in statuses.values():
        counts[ended] = counts.get(ended, 0) + 1
    counts["unfinished"] = len(run_ids) - len(statuses)
    return counts


async def run() -> None:
    """Print rate_limited_429_pct and rate_limit_utilisation_pct."""
    limit = f"input_tokens={LIMIT},window={WINDOW_S:g}"
    env = {"TETHER_MODEL_LIMITS": f"*: input_tokens={LIMIT}, window={WINDOW_S:g}"}
    async with (
        model_server("--rate-limit", limit) as model,
        bench_stack(SERVICES, extra_env=env) as stack,
        TetherClient(stack.services.addresses()["gateway"], stack.api_key) as client,
    ):
        worker_env = {
            "TETHER_WORKER_ANTHROPIC_BASE_URL": model.base_url,
            "TETHER_WORKER_ANTHROPIC_API_KEY": "bench",
        }
        for _ in range(WORKERS):
            await stack.services.start("worker", extra_env=worker_env)
        tag = uuid.uuid4().hex[:8]
        first = await client.send(PROMPT, conversation_id=f"rl-warm-{tag}", event_id=tag)
        await _wait_done(client, [first.run.run_id])
        warm = [r for r in await _log(model) if r["usage"]]
        per_run = _prompt_tokens(warm[-1])
        # Twice the limit's pace: 2 * (LIMIT / WINDOW_S) tokens a second, per_run each.
        pace_s = per_run * WINDOW_S / (2 * LIMIT)
        count = int(DEMAND_S / pace_s)
        started = time.time()
        run_ids = []
        for i in range(count):
            conversation = f"rl-{tag}-{i}"
            response = await client.send(
                PROMPT, conversation_id=conversation, event_id=conversation
            )
            run_ids.append(response.run.run_id)
            await asyncio.sleep(max(0.0, started + (i + 1) * pace_s - time.time()))
        outcomes = await _wait_done(client, run_ids)
        log = [r for r in await _log(model) if r["timestamp"] >= started]
    refused = sum(1 for r in log if r["served"] == "rate_limited")
    answered = sorted((r["timestamp"], _prompt_tokens(r)) for r in log if r["usage"])
    contended_from = started + WINDOW_S
    contended_to = answered[-1][0] if answered else contended_from
    used = sum(tokens for at, tokens in answered if contended_from <= at <= contended_to)
    allowed = LIMIT / WINDOW_S * max(contended_to - contended_from, 1e-9)
    config = {
        "limit_input_tokens": LIMIT,
        "window_s": WINDOW_S,
        "tokens_per_run": per_run,
        "runs": count,
        "workers": WORKERS,
        "outcomes": outcomes,
    }
    emit("rate_limited_429_pct", round(100 * refused / max(len(log), 1), 2), "%", **config)
    emit("rate_limit_utilisation_pct", round(100 * used / allowed, 1), "%", **config)
