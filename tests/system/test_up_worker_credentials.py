"""`tether up` gives a worker only what it needs: no database URL, no other service's credential
or setting, and a Redis user that may only publish live deltas. Read off a live worker (its
/proc environment) and the embedded Redis (its ACL), then tried for real with the worker's URL."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis.asyncio as redis
from redis.exceptions import AuthenticationError, NoPermissionError

from tests.system.test_up_supervision import environ_of, running_up, streamed_run
from tether.hints import EVENTS_PATTERN, WAKE_CHANNEL, events_channel
from tether.stack.processes import SERVICES

# `make slow`: a whole `tether up`.
pytestmark = pytest.mark.slow


def acl_rules(reply: Any) -> dict[str, Any]:
    """ACL GETUSER's flat reply as a dict of str keys."""
    items = (
        list(reply.items())
        if isinstance(reply, dict)
        else list(zip(*[iter(reply)] * 2, strict=True))
    )
    return {(k.decode() if isinstance(k, bytes) else k): v for k, v in items}


def texts(value: Any) -> list[str]:
    """A reply's list of bytes (or one str) as strings."""
    if isinstance(value, (bytes, str)):
        value = value.split() if isinstance(value, str) else value.decode().split()
    return [v.decode() if isinstance(v, bytes) else str(v) for v in value]


async def test_a_worker_holds_no_database_url_no_other_credential_and_may_only_publish(
    tmp_path: Path,
) -> None:
    async with running_up(tmp_path / "data", TETHER_WORKERS="1") as up:
        info = up.info()
        worker_env = environ_of(info["pids"]["worker"])
        values = "\n".join(worker_env.values())

        assert "TETHER_DATABASE_URL" not in worker_env
        assert info["database_url"] not in values, "the database URL under another name"
        assert "postgres" not in values.lower(), "no connection to PostgreSQL of any kind"
        others = {
            name: environ_of(info["pids"][name]).get("TETHER_SERVICE_CREDENTIAL", "")
            for name in ("gateway", "interactions")
        }
        assert all(others.values()), "the callers each hold a credential of their own"
        for name, credential in others.items():
            assert credential not in values, f"the worker holds {name}'s credential"
        assert info["operator_credential"] not in values
        foreign = [
            key
            for key in worker_env
            for service in SERVICES
            if service != "worker"
            and key.startswith(f"TETHER_{service.upper()}_")
            and not key.endswith("_ADDR")
        ]
        assert not foreign, f"other services' settings reach the worker: {foreign}"

        worker_url = worker_env["TETHER_REDIS_URL"]
        assert worker_url != info["redis_url"], "the worker shares the stack's Redis user"
        user = urlsplit(worker_url).username
        assert user and user != "default", (
            f"the worker's Redis URL names no user of its own: {user}"
        )

        admin = redis.Redis.from_url(info["redis_url"])
        worker = redis.Redis.from_url(worker_url)
        anonymous = redis.Redis(host="127.0.0.1", port=urlsplit(worker_url).port or 6379)
        try:
            rules = acl_rules(await admin.execute_command("ACL", "GETUSER", user))
            assert "on" in texts(rules["flags"]), rules
            commands = texts(rules["commands"])
            assert commands[0] == "-@all" and set(commands) == {"-@all", "+ping", "+publish"}
            assert texts(rules["keys"]) == [], rules
            assert texts(rules["channels"]) == [EVENTS_PATTERN], rules

            for refused in (
                worker.get("tether:any"),
                worker.set("tether:any", "x"),
                worker.keys("*"),
                worker.publish(WAKE_CHANNEL, "not a worker's channel"),
                worker.execute_command("SUBSCRIBE", events_channel("r")),
            ):
                with pytest.raises(NoPermissionError):
                    await refused
            assert await worker.ping()
            assert await worker.publish(events_channel("r"), "hint") == 0
            with pytest.raises(AuthenticationError):
                await anonymous.ping()

            # And its runs still stream: the worker publishes their live deltas.
            await streamed_run(up, "deltas")
        finally:
            for client in (admin, worker, anonymous):
                await client.aclose()
