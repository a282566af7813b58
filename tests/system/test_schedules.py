"""Schedules through the real services (processes over loopback, a worker and the local model
server), the admission replicas' time read from a clock file the test moves (an outage of
minutes in a moment): a tick's run is the named agent's, the creator's, in a conversation of its
own, and completes; a schedule every minute across a three-minute outage admits one catch-up
run under `latest`; ticks fired by two admission replicas are admitted once each; bad input
over gRPC, HTTP v2 and the CLI is INVALID_ARGUMENT naming the problem, with nothing stored;
another tenant's schedule is NOT_FOUND; the CLI's round trip, each act audited."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
import httpx2
import pytest
import pytest_asyncio
from sqlalchemy import select

from tests.system.bad_input_support import assert_json_error
from tests.system.execution_support import ExecStack, Tenant, exec_stack, wait_for_status
from tether import apikeys
from tether.db.engine import create_engine
from tether.db.schema import audit_log, messages, runs
from tether.testing.eventually import eventually
from tether.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

# a whole stack of processes per module: tens of seconds, so in `make slow` (the 15-minute budget)
pytestmark = pytest.mark.slow


SCHEDULE_SCOPES = (
    *apikeys.CLIENT_SCOPES,
    apikeys.AGENTS_READ,
    apikeys.AGENTS_WRITE,
    apikeys.SCHEDULES_READ,
    apikeys.SCHEDULES_WRITE,
)
# The replicas' time at the start: a Monday, 09:00 in Paris.
T0 = datetime(2026, 3, 2, 8, 0, 0, tzinfo=UTC)


class FileClock:
    """The admission replicas' time (TETHER_ADMISSION_SCHEDULE_CLOCK_FILE), moved by the tests,
    only ever forward."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.now = T0
        self._write()

    def _write(self) -> None:
        staged = self.path.with_suffix(".tmp")
        staged.write_text(self.now.isoformat())
        staged.replace(self.path)  # a replica never reads half a time

    def move_to(self, when: datetime) -> None:
        assert when >= self.now
        self.now = when
        self._write()


class Schedules:
    """The module's stack and its clock."""

    def __init__(self, stack: ExecStack, clock: FileClock) -> None:
        self.stack = stack
        self.clock = clock


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def running(
    pg_server_url: str, template_db: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Schedules]:
    run_dir = Path(tmp_path_factory.mktemp("schedules"))
    clock = FileClock(run_dir / "clock")
    async with exec_stack(
        pg_server_url,
        template_db,
        redis_url,
        run_dir,
        workers=1,
        extra_env={
            "TETHER_ADMISSION_SCHEDULE_CLOCK_FILE": str(clock.path),
            "TETHER_ADMISSION_SCHEDULE_POLL_S": "0.1",
        },
    ) as stack:
        yield Schedules(stack, clock)


async def tenant_with_agents(stack: ExecStack, *names: str) -> Tenant:
    """A fresh tenant whose key may manage agents and schedules, with agents `names` applied
    (the last one its default)."""
    tenant = await stack.tenant(scopes=SCHEDULE_SCOPES)
    async with grpc.aio.insecure_channel(stack.addr("gateway")) as channel:
        stub = tenant.stub(channel)
        for name in names:
            spec = json.dumps({"name": name, "instructions": f"You are {name}.", "tools": []})
            await stub.ApplyAgent(
                gateway_pb2.ApplyAgentRequest(spec=spec), metadata=tenant.metadata
            )
        await stub.SetDefaultAgent(
            gateway_pb2.SetDefaultAgentRequest(name=names[-1]), metadata=tenant.metadata
        )
    return tenant


async def add(tenant: Tenant, **fields: Any) -> common_pb2.Schedule:
    request = gateway_pb2.AddScheduleRequest(
        **{"cron": "* * * * *", "timezone": "Europe/Paris", "message": "status?", **fields}
    )
    async with grpc.aio.insecure_channel(tenant.stack.addr("gateway")) as channel:
        added = await tenant.stub(channel).AddSchedule(request, metadata=tenant.metadata)
    return added.schedule


async def listed(tenant: Tenant) -> list[common_pb2.Schedule]:
    async with grpc.aio.insecure_channel(tenant.stack.addr("gateway")) as channel:
        found = await tenant.stub(channel).ListSchedules(
            gateway_pb2.ListSchedulesRequest(), metadata=tenant.metadata
        )
    return list(found.schedules)


async def next_fire(tenant: Tenant, schedule_id: str) -> datetime:
    [found] = [s for s in await listed(tenant) if s.schedule_id == schedule_id]
    return found.next_fire_at.ToDatetime(tzinfo=UTC)


async def ticked(stack: ExecStack, schedule_id: str) -> list[Any]:
    """The runs the schedule's ticks admitted, oldest tick first, with their tick times."""
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            rows = await conn.execute(
                select(runs, messages.c.context["tick_at"].astext.label("tick_at"))
                .join(messages, messages.c.message_id == runs.c.message_id)
                .where(messages.c.context["schedule_id"].astext == schedule_id)
                .order_by(messages.c.context["tick_at"].astext)
            )
            return list(rows)
    finally:
        await engine.dispose()


async def moved_past(tenant: Tenant, schedule_id: str, when: datetime) -> None:
    """Wait until a ticker has fired the schedule's ticks up to `when` (its next fire time moved
    past it, in the transaction that admitted them)."""

    async def probe() -> bool:
        return await next_fire(tenant, schedule_id) > when

    await eventually(probe, timeout=20, interval=0.05, what=f"{schedule_id} to move past {when}")


async def test_a_tick_runs_the_named_agent_as_the_creator_in_a_conversation_of_its_own(
    running: Schedules,
) -> None:
    stack, clock = running.stack, running.clock
    # The tenant's default agent is "other": the tick's run goes to "reporter" only if pinned.
    tenant = await tenant_with_agents(stack, "reporter", "other")
    schedule = await add(tenant, agent="reporter", message="how are the builds?")
    due = schedule.next_fire_at.ToDatetime(tzinfo=UTC)
    assert due == (clock.now + timedelta(minutes=1)).replace(second=0, microsecond=0)
    clock.move_to(due + timedelta(seconds=1))
    await moved_past(tenant, schedule.schedule_id, due)
    [run] = await ticked(stack, schedule.schedule_id)
    assert run.tick_at == due.isoformat()
    assert (run.owner_principal_id, run.tenant_id) == ("tester", tenant.tenant_id)
    await wait_for_status(stack.db_url, run.run_id, "completed")
    async with grpc.aio.insecure_channel(stack.addr("gateway")) as channel:
        got = await tenant.stub(channel).GetRun(
            gateway_pb2.GetRunRequest(run_id=run.run_id), metadata=tenant.metadata
        )
    assert got.run.routing.agent == "reporter"
    assert got.run.input_text == "how are the builds?"
    [after] = [s for s in await listed(tenant) if s.schedule_id == schedule.schedule_id]
    assert after.last_run_id == run.run_id


async def test_a_three_minute_outage_admits_one_catch_up_run_under_latest(
    running: Schedules,
) -> None:
    stack, clock = running.stack, running.clock
    tenant = await tenant_with_agents(stack, "reporter")
    schedule = await add(tenant, agent="reporter", catch_up="latest", overlap="allow")
    first = schedule.next_fire_at.ToDatetime(tzinfo=UTC)
    clock.move_to(first + timedelta(seconds=1))
    await moved_past(tenant, schedule.schedule_id, first)
    assert len(await ticked(stack, schedule.schedule_id)) == 1
    # Admission is down from just after the first tick until 3.5 minutes later: the ticks of
    # +1, +2 and +3 minutes pass with no ticker running.
    stack.services.kill("admission")
    back = first + timedelta(minutes=3, seconds=30)
    clock.move_to(back)
    await stack.services.restart("admission")
    await moved_past(tenant, schedule.schedule_id, back)
    fired = await ticked(stack, schedule.schedule_id)
    assert [r.tick_at for r in fired] == [
        first.isoformat(),
        (first + timedelta(minutes=3)).isoformat(),
    ]
    assert await next_fire(tenant, schedule.schedule_id) == first + timedelta(minutes=4)


async def test_ticks_fired_by_two_admission_replicas_are_admitted_once_each(
    running: Schedules,
) -> None:
    stack, clock = running.stack, running.clock
    tenant = await tenant_with_agents(stack, "reporter")
    added = [await add(tenant, agent="reporter", overlap="allow") for _ in range(12)]
    second = await stack.services.start("admission")
    try:
        due = max(s.next_fire_at.ToDatetime(tzinfo=UTC) for s in added)
        for minute in range(3):
            tick = due + timedelta(minutes=minute)
            clock.move_to(tick + timedelta(seconds=1))
            for schedule in added:
                await moved_past(tenant, schedule.schedule_id, tick)
        for schedule in added:
            fired = await ticked(stack, schedule.schedule_id)
            ticks = [r.tick_at for r in fired if datetime.fromisoformat(r.tick_at) >= due]
            assert ticks == [(due + timedelta(minutes=m)).isoformat() for m in range(3)]
    finally:
        await stack.services.stop(second.name)


BAD = [
    ({"cron": "61 * * * *"}, "does not parse"),
    ({"cron": "every monday"}, "five fields"),
    ({"timezone": "Europe/Atlantis"}, "does not exist"),
    ({"agent": "nobody"}, "does not exist in this tenant"),
    ({"overlap": "queue"}, "skip"),
    ({"catch_up": "burst"}, "latest"),
]


async def test_bad_input_is_invalid_argument_over_grpc_http_and_the_cli_and_stores_nothing(
    running: Schedules, tmp_path: Path
) -> None:
    stack = running.stack
    tenant = await tenant_with_agents(stack, "reporter")
    base = {"agent": "reporter", "cron": "0 9 * * 1-5", "timezone": "Europe/Paris"}
    stack_file = tmp_path / "stack.json"
    stack_file.write_text(json.dumps({"gateway": stack.addr("gateway"), "api_key": tenant.api_key}))
    http_base = f"http://{stack.services.http_addresses()['gateway']}"
    auth = {"Authorization": f"Bearer {tenant.api_key}"}
    async with (
        grpc.aio.insecure_channel(stack.addr("gateway")) as channel,
        httpx2.AsyncClient(base_url=http_base, timeout=30) as http,
    ):
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        for change, named in BAD:
            fields = {**base, "message": "report", **change}
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.AddSchedule(
                    gateway_pb2.AddScheduleRequest(**fields), metadata=tenant.metadata
                )
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, change
            assert named in (refused.value.details() or ""), (change, refused.value.details())
            answer = await http.post("/v2/schedules", headers=auth, json=fields)
            assert_json_error(answer, 400, "INVALID_ARGUMENT")
            assert named in answer.json()["error"]["message"]
            code, out = await tether(
                "schedules",
                "add",
                *(f"--{k.replace('_', '-')}={v}" for k, v in fields.items()),
                "--stack",
                str(stack_file),
            )
            assert code == 1 and "INVALID_ARGUMENT" in out and named in out, (change, out)
        # A window past 7 days is refused at the gateway's limits, before admission.
        answer = await http.post(
            "/v2/schedules",
            headers=auth,
            json={**base, "message": "r", "catch_up": "all", "catchUpWindowSeconds": 700_000},
        )
        assert_json_error(answer, 400, "INVALID_ARGUMENT")
        assert await listed(tenant) == []
        assert (await http.get("/v2/schedules", headers=auth)).json() == {}


async def test_another_tenants_schedule_is_not_found_and_a_key_without_the_scope_is_denied(
    running: Schedules,
) -> None:
    stack = running.stack
    owner = await tenant_with_agents(stack, "reporter")
    other = await tenant_with_agents(stack, "reporter")
    schedule = await add(owner, agent="reporter")
    http_base = f"http://{stack.services.http_addresses()['gateway']}"
    async with (
        grpc.aio.insecure_channel(stack.addr("gateway")) as channel,
        httpx2.AsyncClient(base_url=http_base, timeout=30) as http,
    ):
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        for call, request in (
            (stub.PauseSchedule, gateway_pb2.PauseScheduleRequest),
            (stub.ResumeSchedule, gateway_pb2.ResumeScheduleRequest),
            (stub.RemoveSchedule, gateway_pb2.RemoveScheduleRequest),
        ):
            for schedule_id in (schedule.schedule_id, "sch_absent"):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call(request(schedule_id=schedule_id), metadata=other.metadata)
                assert refused.value.code() == grpc.StatusCode.NOT_FOUND
                assert refused.value.details() == f"schedule {schedule_id!r} not found"
        other_auth = {"Authorization": f"Bearer {other.api_key}"}
        answer = await http.post(f"/v2/schedules/{schedule.schedule_id}/pause", headers=other_auth)
        assert_json_error(answer, 404, "NOT_FOUND")
        answer = await http.delete(f"/v2/schedules/{schedule.schedule_id}", headers=other_auth)
        assert_json_error(answer, 404, "NOT_FOUND")
        assert await listed(other) == []
        # A client key holds neither schedules scope.
        client = await stack.tenant()
        with pytest.raises(grpc.aio.AioRpcError) as denied:
            await stub.ListSchedules(gateway_pb2.ListSchedulesRequest(), metadata=client.metadata)
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "schedules:read" in (denied.value.details() or "")
    [kept] = await listed(owner)
    assert (kept.schedule_id, kept.paused) == (schedule.schedule_id, False)


async def test_the_cli_adds_lists_pauses_resumes_and_removes_each_act_audited(
    running: Schedules, tmp_path: Path
) -> None:
    stack = running.stack
    tenant = await tenant_with_agents(stack, "reporter")
    stack_file = tmp_path / "stack.json"
    stack_file.write_text(json.dumps({"gateway": stack.addr("gateway"), "api_key": tenant.api_key}))
    where = ("--stack", str(stack_file), "--json")
    code, out = await tether(
        "schedules", "add", "--agent", "reporter", "--cron", "0 9 * * 1-5",
        "--timezone", "Europe/Paris", "--message", "morning report", "--catch-up", "all",
        "--catch-up-window", "6h", *where,
    )  # fmt: skip
    assert code == 0, out
    added = json.loads(out)
    assert (added["catch_up"], added["catch_up_window_seconds"]) == ("all", "21600")
    schedule_id = added["schedule_id"]
    # 09:00 in Paris on the next weekday after the replicas' time (08:00 UTC is 09:00 CET).
    now = running.clock.now
    code, out = await tether("schedules", "list", *where)
    [found] = [json.loads(line) for line in out.splitlines()]
    next_at = datetime.fromisoformat(found["next_fire_at"].replace("Z", "+00:00"))
    assert next_at > now and next_at.weekday() < 5 and (next_at.hour, next_at.minute) == (8, 0)
    for command in ("pause", "resume"):
        code, out = await tether("schedules", command, schedule_id, *where)
        assert code == 0, out
        assert json.loads(out).get("paused", False) is (command == "pause")
    code, out = await tether("schedules", "rm", schedule_id, *where)
    assert (code, json.loads(out)) == (0, {"schedule_id": schedule_id, "removed": True})
    code, out = await tether("schedules", "list", *where)
    assert (code, out.strip()) == (0, "")
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            rows = await conn.execute(
                select(audit_log.c.action)
                .where(audit_log.c.detail["schedule_id"].astext == schedule_id)
                .order_by(audit_log.c.id)
            )
            actions = list(rows.scalars())
    finally:
        await engine.dispose()
    assert actions == ["schedule.added", "schedule.paused", "schedule.resumed", "schedule.removed"]


async def tether(*args: str) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tether.cli",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, out.decode() + err.decode()
