"""`tether up` supervises its services: a SIGKILLed worker is restarted on its own port (with a
line saying so) and its run completes; `TETHER_WORKERS` workers serve; a SIGKILLed Redis is
restarted with the worker's user and runs stream again; a SIGKILLed PostgreSQL is restarted on
its socket, the runs it held complete and the services serve again without a restart; Ctrl-C
during a restart's backoff still stops everything cleanly."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import asyncpg
import psutil
import pytest
import redis.asyncio as redis

from tests.system.streaming_support import prompt
from tests.system.up_support import UpProcess
from tether.client import TetherClient, run_to_dict
from tether.hints import EVENTS_PATTERN, decode_events
from tether.testing.eventually import eventually

# `make slow`: `tether up` under kills and restarts, half a minute.
pytestmark = pytest.mark.slow

# Short leases so a run held by a killed worker is reaped within a couple of seconds.
FAST_LEASES = {
    "TETHER_ORCHESTRATOR_LEASE_TTL_S": "1.5",
    "TETHER_ORCHESTRATOR_REAP_INTERVAL_S": "0.2",
    "TETHER_ORCHESTRATOR_CLAIM_POLL_S": "0.2",
}


@asynccontextmanager
async def running_up(data_dir: Path, **env: str) -> AsyncIterator[UpProcess]:
    """`tether up` until the block ends, then Ctrl-C with the clean-exit checks (skipped when
    the block failed: then it is only stopped, so the block's own failure is what is shown)."""
    up = UpProcess(data_dir, **env)
    try:
        await up.ready()
        yield up
    except BaseException as exc:
        await up.abandon()
        exc.add_note(f"tether up printed:\n{up.output}")
        raise
    if up.process.poll() is None:
        await up.interrupt()


def environ_of(pid: int) -> dict[str, str]:
    """A live process's environment, as the kernel holds it (what a tool could read)."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    pairs = (entry.decode().partition("=") for entry in raw.split(b"\0") if entry)
    return {name: value for name, _, value in pairs}


async def script(model_url: str, key: str, turns: list[dict[str, Any]]) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{model_url}/_script", json={"key": key, "turns": turns}) as response,
    ):
        assert response.status == 200, await response.text()


async def model_requests(model_url: str, key: str) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as session, session.get(f"{model_url}/_requests") as got:
        body = await got.json()
    return [r for r in body["requests"] if r["script_key"] == key]


async def worker_pids(db_url: str, run_id: str) -> list[int]:
    """The pid of each worker that held the run, in attempt order (worker ids are HOST-PID)."""
    conn = await asyncpg.connect(db_url)
    try:
        rows = await conn.fetch(
            "SELECT worker_id FROM attempts WHERE run_id = $1 ORDER BY lease_epoch", run_id
        )
    finally:
        await conn.close()
    return [int(row["worker_id"].rsplit("-", 1)[1]) for row in rows]


async def finished(client: TetherClient, run_id: str, *, timeout: float = 30.0) -> dict[str, Any]:
    async def probe() -> dict[str, Any] | None:
        run = run_to_dict((await client.get_run(run_id)).run)
        return run if run["status"] in ("completed", "failed", "cancelled") else None

    return await eventually(probe, timeout=timeout, interval=0.1, what=f"run {run_id} to end")


async def test_a_killed_worker_is_restarted_on_its_port_and_its_run_completes(
    tmp_path: Path,
) -> None:
    # One attempt per worker process, so a second run in flight needs the second worker.
    env = {**FAST_LEASES, "TETHER_WORKERS": "2", "TETHER_WORKER_CONCURRENCY": "1"}
    async with running_up(tmp_path / "data", **env) as up:
        info = up.info()
        model, db_url = info["model_base_url"], info["database_url"]
        workers = {p.pid for p in up.children("services.worker")}
        assert len(workers) == 2, f"TETHER_WORKERS=2 started {len(workers)} workers"
        async with TetherClient.from_env(str(up.data_dir / "stack.json")) as client:
            held = prompt("held")
            # Stalls mid-stream until its worker goes away; the next attempt gets the answer.
            stall = {"kind": "stall", "after_events": 3}
            await script(model, held, [stall, {"kind": "text", "text": "Done."}])
            held_run = (await client.send(held, conversation_id="held", event_id="held")).run.run_id

            async def streaming() -> list[dict[str, Any]]:
                return await model_requests(model, held)

            await eventually(streaming, timeout=30, what="the held run's model call")
            [holder] = await worker_pids(db_url, held_run)

            other = prompt("other")
            await script(model, other, [{"kind": "text", "text": "Served elsewhere."}])
            other_run = (
                await client.send(other, conversation_id="other", event_id="other")
            ).run.run_id
            assert (await finished(client, other_run))["status"] == "completed"
            [server] = await worker_pids(db_url, other_run)
            assert {holder, server} == workers, "both worker processes serve"

            os.kill(holder, signal.SIGKILL)
            died = await up.line(
                lambda line: f"pid {holder}" in line and "SIGKILL" in line,
                timeout=30,
                what="the supervisor's line about the killed worker",
            )
            assert "restarting in" in died, died
            done = await finished(client, held_run)
            assert done["status"] == "completed" and done["result_text"] == "Done.", done

            async def replaced() -> set[int] | None:
                now = {p.pid for p in up.children("services.worker")}
                return now if len(now) == 2 and holder not in now else None

            now = await eventually(replaced, timeout=30, what="a replacement worker")
            await up.line(lambda line: "restarted" in line, timeout=30, what="the restart line")
            after = up.info()
            assert after["services"] == info["services"], "a restarted service keeps its port"
            assert {pid for name, pid in after["pids"].items() if name.startswith("worker")} == now

            later = prompt("later")
            await script(model, later, [{"kind": "text", "text": "Still served."}])
            later_run = (
                await client.send(later, conversation_id="later", event_id="later")
            ).run.run_id
            assert (await finished(client, later_run))["result_text"] == "Still served."


async def streamed_run(up: UpProcess, label: str) -> None:
    """Send a run; assert the run completes and its worker's live delta (seq 0) reaches
    Redis."""
    info = up.info()
    admin = redis.Redis.from_url(info["redis_url"])
    listener = admin.pubsub()
    try:
        await listener.psubscribe(EVENTS_PATTERN)
        text = prompt(label)
        await script(info["model_base_url"], text, [{"kind": "text", "text": "Streamed."}])
        async with TetherClient.from_env(str(up.data_dir / "stack.json")) as client:
            run_id = (await client.send(text, conversation_id=label, event_id=label)).run.run_id

            async def a_delta() -> None:
                while True:
                    message = await listener.get_message(timeout=1.0)
                    if message is None or message["type"] != "pmessage":
                        continue
                    if any(
                        e.run_id == run_id and e.seq == 0 for e in decode_events(message["data"])
                    ):
                        return

            await asyncio.wait_for(a_delta(), timeout=30)
            assert (await finished(client, run_id))["result_text"] == "Streamed."
    finally:
        await listener.aclose()
        await admin.aclose()


async def test_a_killed_redis_is_restarted_with_the_workers_user_and_runs_stream_again(
    tmp_path: Path,
) -> None:
    async with running_up(tmp_path / "data", TETHER_WORKERS="1") as up:
        await streamed_run(up, "before")
        killed = up.info()["redis_pid"]
        os.kill(killed, signal.SIGKILL)
        died = await up.line(
            lambda line: f"redis (pid {killed})" in line and "SIGKILL" in line,
            timeout=30,
            what="the supervisor's line about the killed Redis",
        )
        assert "restarting in" in died, died
        await up.line(lambda line: "redis restarted" in line, timeout=30, what="Redis's restart")
        info = up.info()
        assert info["redis_pid"] != killed
        worker_url = environ_of(info["pids"]["worker"])["TETHER_REDIS_URL"]
        admin = redis.Redis.from_url(info["redis_url"])
        try:
            user = urlsplit(worker_url).username
            rules = await admin.execute_command("ACL", "GETUSER", user)
            assert rules is not None, "the restarted Redis lost the worker's user"
        finally:
            await admin.aclose()
        # The services reconnect by themselves: the first run after the restart completes and
        # its live deltas stream (a publish that meets a connection the restart broke is sent
        # again on a new one, tether.bus).
        await streamed_run(up, "after")


async def test_a_killed_postgres_is_restarted_on_its_socket_and_no_run_is_lost(
    tmp_path: Path,
) -> None:
    # One worker running one attempt at a time, so a second run waits in the queue.
    env = {**FAST_LEASES, "TETHER_WORKERS": "1", "TETHER_WORKER_CONCURRENCY": "1"}
    async with running_up(tmp_path / "data", **env) as up:
        info = up.info()
        model = info["model_base_url"]
        async with TetherClient.from_env(str(up.data_dir / "stack.json")) as client:
            # In flight across the kill: its model stream pauses for a while mid-answer. If
            # the attempt is lost with the server, the next one gets the same answer.
            flying = prompt("flying")
            answer = {"kind": "text", "text": "Held through."}
            pause = {"kind": "stall", "after_events": 3, "seconds": 3, "text": "Held through."}
            await script(model, flying, [pause, answer])
            flying_run = (
                await client.send(flying, conversation_id="flying", event_id="flying")
            ).run.run_id

            async def streaming() -> list[dict[str, Any]]:
                return await model_requests(model, flying)

            await eventually(streaming, timeout=30, what="the in-flight run's model call")
            waiting = prompt("waiting")
            await script(model, waiting, [{"kind": "text", "text": "Waited."}])
            waiting_run = (
                await client.send(waiting, conversation_id="waiting", event_id="waiting")
            ).run.run_id

            killed = info["postgres_pid"]
            os.kill(killed, signal.SIGKILL)
            died = await up.line(
                lambda line: f"postgres (pid {killed})" in line and "SIGKILL" in line,
                timeout=30,
                what="the supervisor's line about the killed PostgreSQL",
            )
            assert "restarting in" in died, died
            await up.line(
                lambda line: "postgres restarted" in line, timeout=60, what="PostgreSQL's restart"
            )
            restarted = up.info()["postgres_pid"]
            assert restarted != killed
            assert psutil.Process(restarted).ppid() == up.process.pid, "the new one is supervised"

            # Runs admitted before the kill are not lost: both complete.
            assert (await finished(client, flying_run, timeout=60))["result_text"] == (
                "Held through."
            )
            assert (await finished(client, waiting_run, timeout=60))["result_text"] == "Waited."
            # The services reconnect by themselves: a new run through the gateway completes,
            # and none of them was restarted to get there.
            after = prompt("after")
            await script(model, after, [{"kind": "text", "text": "Served again."}])
            after_run = (
                await client.send(after, conversation_id="after", event_id="after")
            ).run.run_id
            assert (await finished(client, after_run))["result_text"] == "Served again."
        assert up.info()["pids"] == info["pids"], "a service was restarted"
        # Nor did a task of theirs die of the outage unnoticed (asyncio's last word for it).
        for service_log in (up.data_dir / "run").glob("*.log"):
            assert "exception was never retrieved" not in service_log.read_text(), service_log


async def test_ctrl_c_during_a_restart_backoff_exits_cleanly(tmp_path: Path) -> None:
    # A backoff far longer than the test, so Ctrl-C surely lands inside it.
    env = {
        "TETHER_WORKERS": "1",
        "TETHER_UP_RESTART_DELAY_S": "600",
        "TETHER_UP_RESTART_MAX_DELAY_S": "600",
    }
    async with running_up(tmp_path / "data", **env) as up:
        [worker] = up.children("services.worker")
        worker.kill()
        died = await up.line(
            lambda line: f"pid {worker.pid}" in line,
            timeout=30,
            what="the supervisor's line about the killed worker",
        )
        assert "restarting in 600.0 s" in died, died
        out = await up.interrupt()  # exit code 0, nothing left running
    assert "restarted" not in out, out
    assert out.splitlines()[-1] == "tether stopped", out
