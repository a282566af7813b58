"""`tether watch`, `tether send --follow` and `tether cancel` against the services as processes."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from tests.system.execution_support import ExecStack, Tenant, exec_stack, wait_for_status
from tests.system.streaming_support import get_run, prompt
from tether.testing.model_server import ErrorTurn, TextTurn, ToolUseTurn
from tether.transport import part_to_json

# Slow: a stack of its own and the CLI as processes, one per command (make slow).
pytestmark = pytest.mark.slow


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(
    pg_server_url: str, template_db: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ExecStack]:
    async with exec_stack(
        pg_server_url, template_db, redis_url, Path(tmp_path_factory.mktemp("cli")), workers=1
    ) as running:
        yield running


def stack_file(stack: ExecStack, tenant: Tenant, directory: Path) -> str:
    path = directory / "stack.json"
    path.write_text(json.dumps({"gateway": stack.addr("gateway"), "api_key": tenant.api_key}))
    return str(path)


async def start(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tether.cli",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def tether(*args: str) -> tuple[int, str]:
    process = await start(*args)
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, out.decode() + err.decode()


async def test_send_follow_renders_text_tools_and_the_retry_indicator(
    stack: ExecStack, tmp_path: Path
) -> None:
    tenant = await stack.tenant()
    text = prompt("follow me")
    stack.model.script(
        text,
        [
            ErrorTurn(529),
            ToolUseTurn("get_time", {}, text="Let me look."),
            TextTurn("It is late.", chunks=["It ", "is ", "late."], delay_ms=20),
        ],
    )
    code, out = await tether(
        "send", text, "--follow", "--stack", stack_file(stack, tenant, tmp_path)
    )
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0].startswith("run run_") and "created" in lines[0]
    retry = next(line for line in lines if line.startswith("[retry]"))
    assert "attempt 1/3 failed: provider_overloaded" in retry and "attempt 2 in" in retry
    assert "Let me look." in lines
    assert "[tool] get_time {}" in lines
    assert any(line.startswith("[tool] get_time -> ") for line in lines)
    assert "It is late." in lines, "\n".join(lines)  # deltas never overtake tool events
    assert lines[-1].startswith("[completed]")


async def test_watch_json_prints_one_object_per_line_with_every_seq(
    stack: ExecStack, tmp_path: Path
) -> None:
    tenant = await stack.tenant()
    text = prompt("json lines")
    stack.model.script(text, [ToolUseTurn("get_time", {}), TextTurn("Fine.")])
    run_id = await tenant.send(text)
    await wait_for_status(stack.db_url, run_id, "completed")
    file = stack_file(stack, tenant, tmp_path)
    code, out = await tether("watch", run_id, "--json", "--stack", file)
    assert code == 0, out
    objects = [json.loads(line) for line in out.splitlines()]
    assert objects[0]["type"] == "snapshot" and objects[0]["run"]["status"] == "completed"
    final = await get_run(tenant, run_id)
    assert [o["seq"] for o in objects[1:]] == list(range(1, final.run.last_seq + 1))
    assert objects[-1]["type"] == "run.completed"
    code, out = await tether("watch", run_id, "--after", "3", "--json", "--stack", file)
    resumed = [json.loads(line)["seq"] for line in out.splitlines()[1:]]
    assert resumed == list(range(4, final.run.last_seq + 1))


async def test_watch_shows_a_pause_with_its_command_and_cancel_ends_it(
    stack: ExecStack, tmp_path: Path
) -> None:
    tenant = await stack.tenant()
    text = prompt("publish")
    stack.model.script(text, [ToolUseTurn("publish_post", {"text": "Hello world"})])
    run_id = await tenant.send(text)
    file = stack_file(stack, tenant, tmp_path)
    watcher = await start("watch", run_id, "--stack", file)
    assert watcher.stdout is not None
    try:
        seen: list[str] = []
        while not any(line.startswith("waiting for approval") for line in seen):
            line = await asyncio.wait_for(watcher.stdout.readline(), 30)
            assert line, f"watch ended early: {seen}"
            seen.append(line.decode().rstrip("\n"))
        hint = seen[-1]
        assert hint.startswith(f"waiting for approval: tether decide {run_id} ")
        assert "allow-once" in hint and "deny" in hint
        assert any(line.startswith("[approval] publish_post") for line in seen)
        code, out = await tether("cancel", run_id, "--reason", "not today", "--stack", file)
        assert code == 0 and out.strip() == f"run {run_id} cancelled", out
        rest, _ = await asyncio.wait_for(watcher.communicate(), 30)
    finally:
        if watcher.returncode is None:
            watcher.kill()
            await watcher.wait()
    assert watcher.returncode == 1
    assert rest.decode().splitlines()[-1] == "[cancelled] not today"
    code, out = await tether("cancel", run_id, "--json", "--stack", file)
    assert json.loads(out)["changed"] is False


async def test_run_json_shows_the_persisted_parts_and_parts_limits_them(
    stack: ExecStack, tmp_path: Path
) -> None:
    tenant = await stack.tenant()
    text = prompt("read back")
    stack.model.script(
        text, [ToolUseTurn("get_time", {}, text="Let me look."), TextTurn("It is late.")]
    )
    run_id = await tenant.send(text)
    await wait_for_status(stack.db_url, run_id, "completed")
    file = stack_file(stack, tenant, tmp_path)
    code, out = await tether("run", run_id, "--json", "--stack", file)
    assert code == 0, out
    shown = json.loads(out)
    assert shown["status"] == "completed" and shown["result_text"] == "It is late."
    persisted = (await get_run(tenant, run_id)).parts
    assert shown["parts"] == [part_to_json(part) for part in persisted]
    kinds = [next(k for k in ("text", "toolCall", "toolResult") if k in p) for p in shown["parts"]]
    assert kinds == ["text", "toolCall", "toolResult", "text"], shown["parts"]
    assert shown["parts"][0]["text"]["text"] == "Let me look."
    assert shown["parts"][1]["toolCall"]["name"] == "get_time"
    assert shown["parts"][3]["text"]["text"] == "It is late."
    assert shown["part_count"] == 4

    code, out = await tether("run", run_id, "--json", "--parts", "1", "--stack", file)
    assert code == 0, out
    last = json.loads(out)
    assert last["parts"] == shown["parts"][-1:] and last["part_count"] == 4
    code, out = await tether("run", run_id, "--json", "--parts", "9", "--stack", file)
    assert json.loads(out)["parts"] == shown["parts"]
    code, out = await tether("run", run_id, "--json", "--parts", "0", "--stack", file)
    assert json.loads(out)["parts"] == []
    code, out = await tether("run", run_id, "--json", "--parts", "-1", "--stack", file)
    assert code == 2 and "--parts: must be 0 or more, not -1" in out, out
