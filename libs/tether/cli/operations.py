"""The operator's commands: `tether doctor`, `tether migrate`, `tether retry`, `tether tenant
delete`, and how `tether run --attempts` reads.

`doctor` and `migrate` speak to PostgreSQL (and Redis, and each service's health check) directly:
the database URL comes from `--database-url`, TETHER_DATABASE_URL or the stack file; services'
addresses from the stack file, TETHER_GATEWAY and TETHER_<SERVICE>_ADDR, or `--service
NAME=HOST:PORT`. The rest go through the gateway like every other command.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tether.client import TetherClient, run_to_dict
from tether.convert import disposition_name
from tether.v1 import gateway_pb2

Emit = Any

# How far the database's clock may be from this machine's before doctor says so: leases,
# expiries and retention are all timed by the database, but a worker's deadlines by its own.
MAX_SKEW_S = 1.0
# How long doctor waits for one answer (a database, Redis, a service's health check).
PROBE_TIMEOUT_S = 5.0
_SERVICES_ENV = {
    "gateway": "TETHER_GATEWAY",
    "admission": "TETHER_ADMISSION_ADDR",
    "orchestrator": "TETHER_ORCHESTRATOR_ADDR",
    "interactions": "TETHER_INTERACTIONS_ADDR",
}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86_400}


def since(value: str, *, now: datetime | None = None) -> datetime:
    """A `--since` value: an RFC 3339 time (2025-01-31T09:00:00Z) or an age (45s, 30m, 2h,
    7d); raises ValueError naming what it takes."""
    match = _DURATION.fullmatch(value.strip())
    if match:
        seconds = float(match.group(1)) * _UNIT_S[match.group(2)]
        return (now or datetime.now(UTC)) - timedelta(seconds=seconds)
    try:
        when = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(
            f"--since takes a time (2025-01-31T09:00:00Z) or an age (45s, 30m, 2h, 7d); "
            f"got {value!r}"
        ) from None
    if when.tzinfo is None:
        raise ValueError(f"--since needs a time zone (Z or +01:00); got {value!r}")
    return when


# -- run --attempts ------------------------------------------------------------------------------


def _json(message: Any) -> dict[str, Any]:
    data: dict[str, Any] = json_format.MessageToDict(message, preserving_proto_field_name=True)
    return data


def attempts_json(response: gateway_pb2.GetRunAttemptsResponse) -> dict[str, Any]:
    """The execution record as stable JSON."""
    return {
        **run_to_dict(response.run),
        "attempts": [_json(a) for a in response.attempts],
        "turns": [_json(t) for t in response.turns],
        "lineage": [run_to_dict(r) for r in response.lineage],
    }


def _time(ts: Any) -> str:
    return ts.ToDatetime(tzinfo=UTC).strftime("%H:%M:%S.%f")[:-3] if ts.seconds else "-"


def attempts_text(response: gateway_pb2.GetRunAttemptsResponse) -> str:
    """The execution record for a person: lineage, attempts with their stages, model turns."""
    data = attempts_json(response)
    lines = [f"run {data['run_id']} status={data['status']} attempt={data.get('attempt', 0)}"]
    if len(data["lineage"]) > 1:
        chain = " -> ".join(
            f"{r['run_id']} ({r['status']})" + (" *" if r["run_id"] == data["run_id"] else "")
            for r in data["lineage"]
        )
        lines.append(f"lineage: {chain}")
    for attempt in response.attempts:
        outcome = attempt.outcome or "running"
        if attempt.HasField("error"):
            outcome += f" ({attempt.error.code}: {attempt.error.message})"
        lines.append(
            f"attempt {attempt.attempt} epoch {attempt.lease_epoch} on {attempt.worker_id}: "
            f"{_time(attempt.started_at)} -> {_time(attempt.ended_at)} {outcome}"
        )
        if attempt.stage_ms:
            stages = ", ".join(f"{k} {v:.1f} ms" for k, v in sorted(attempt.stage_ms.items()))
            lines.append(f"  stages: {stages}")
    total_micros = 0
    for i, turn in enumerate(response.turns, 1):
        usage = turn.usage
        total_micros += usage.cost_micros
        lines.append(
            f"turn {i} (attempt {turn.attempt}) {usage.model}: in {usage.input_tokens}, "
            f"out {usage.output_tokens}, cache write {usage.cache_creation_input_tokens}, "
            f"cache read {usage.cache_read_input_tokens}; ${usage.cost_micros / 1e6:.6f}"
        )
    if response.turns:
        lines.append(f"cost: ${total_micros / 1e6:.6f} over {len(response.turns)} turns")
    return "\n".join(lines)


# -- retry and tenant delete ---------------------------------------------------------------------


async def cmd_retry(args: argparse.Namespace, emit: Emit) -> int:
    """Retry a failed or cancelled run: a new run for its message, with lineage."""
    async with _client(args) as client:
        response = await client.retry_run(args.run_id)
    run = run_to_dict(response.run)
    disposition = disposition_name(response.disposition)
    what = "retried as" if disposition == "retried" else "was retried already as"
    emit(
        args,
        {**run, "disposition": disposition},
        f"run {args.run_id} {what} {run['run_id']} status={run['status']}",
    )
    return 0


async def cmd_tenant_delete(args: argparse.Namespace, emit: Emit) -> int:
    """Delete a tenant and all its data (the platform operator), a batch a call until gone."""
    removed: dict[str, int] = {}
    async with TetherClient.from_env(getattr(args, "stack", None), operator=True) as client:
        while True:
            step = await client.delete_tenant(args.tenant_id)
            for what, n in step.removed.items():
                removed[what] = removed.get(what, 0) + int(n)
            if step.deleted:
                break
            if not args.json:
                print(f"... {step.pending}", flush=True)  # noqa: T201
            if not any(step.removed.values()):
                await asyncio.sleep(0.5)  # waiting out the key revocation bound: no hurry
    emit(
        args,
        {"tenant_id": args.tenant_id, "deleted": True, "removed": removed},
        f"tenant {args.tenant_id} deleted: "
        + ", ".join(f"{n} {what}" for what, n in sorted(removed.items())),
    )
    return 0


async def cmd_tenant_set(args: argparse.Namespace, emit: Emit) -> int:
    """Set a tenant's weight and cap (the platform operator)."""
    async with TetherClient.from_env(getattr(args, "stack", None), operator=True) as client:
        done = await client.set_tenant(
            gateway_pb2.SetTenantRequest(
                tenant_id=args.tenant_id,
                weight=args.weight,
                max_running=args.max_running,
                clear_max_running=args.no_max_running,
            )
        )
    cap = done.max_running if done.HasField("max_running") else None
    emit(
        args,
        {"tenant_id": done.tenant_id, "weight": done.weight, "max_running": cap},
        f"tenant {done.tenant_id}: weight {done.weight}, "
        + ("no cap on runs running at once" if cap is None else f"at most {cap} runs at once"),
    )
    return 0


def _client(args: argparse.Namespace) -> TetherClient:
    return TetherClient.from_env(getattr(args, "stack", None), tenant=getattr(args, "tenant", ""))


# -- doctor and migrate --------------------------------------------------------------------------


def _stack(args: argparse.Namespace) -> dict[str, Any]:
    path = getattr(args, "stack", None)
    if not path:
        return {}
    info: dict[str, Any] = json.loads(Path(path).read_text())
    return info


def _database_url(args: argparse.Namespace) -> str:
    url = (
        args.database_url
        or os.environ.get("TETHER_DATABASE_URL")
        or _stack(args).get("database_url", "")
    )
    if not url:
        raise ValueError(
            "no database: pass --database-url, set TETHER_DATABASE_URL or pass --stack "
            "<data-dir>/stack.json"
        )
    return str(url)


@dataclass(frozen=True)
class Check:
    """One thing doctor looked at."""

    name: str
    ok: bool
    detail: str


async def _database_checks(url: str) -> list[Check]:
    from sqlalchemy import text

    from tether.db.engine import create_engine
    from tether.db.migrate import SchemaState, applied_revisions, schema_state, shipped_revisions

    engine = create_engine(url, pool_size=1, application="cli")
    try:
        async with asyncio.timeout(PROBE_TIMEOUT_S):
            async with engine.connect() as conn:
                before = time.time()
                row = (await conn.execute(text("SELECT version() AS v, now() AS now"))).one()
                after = time.time()
            applied = await applied_revisions(engine)
    except Exception as exc:  # the failure is the finding; doctor reports it and goes on
        return [Check("database", False, f"cannot reach PostgreSQL: {exc!r}"[:300])]
    finally:
        await engine.dispose()
    version = str(row.v).split(",")[0]
    checks = [Check("database", True, f"{version}, answered in {(after - before) * 1000:.1f} ms")]
    head, _ = shipped_revisions()
    at = ", ".join(applied) or "none applied"
    state = schema_state(applied)
    if state is SchemaState.CURRENT:
        checks.append(Check("migrations", True, f"at head ({head})"))
    elif state is SchemaState.BEHIND:
        checks.append(Check("migrations", False, f"{at}; head is {head}: tether migrate"))
    else:
        checks.append(
            Check(
                "migrations",
                True,
                f"at {at}, newer than this release's head ({head}): a newer release migrated "
                "it, and this one runs on it (expand-then-contract)",
            )
        )
    skew = row.now.timestamp() - (before + after) / 2
    checks.append(
        Check(
            "clock skew",
            abs(skew) <= MAX_SKEW_S,
            f"the database's clock is {skew * 1000:+.0f} ms from this machine's "
            f"(within ±{(after - before) * 500:.0f} ms; at most {MAX_SKEW_S:g} s is fine)",
        )
    )
    return checks


async def _redis_check(url: str) -> Check:
    import redis.asyncio as redis

    client = redis.from_url(url, socket_timeout=PROBE_TIMEOUT_S)
    try:
        before = time.monotonic()
        await client.ping()
        elapsed = time.monotonic() - before
        version = (await client.info("server")).get("redis_version", "?")
    except Exception as exc:  # the failure is the finding
        return Check("redis", False, f"cannot reach Redis: {exc!r}"[:300])
    finally:
        await client.aclose()
    return Check("redis", True, f"Redis {version}, PING in {elapsed * 1000:.1f} ms")


# The services whose gRPC port speaks only mutual TLS when it is configured (the gateway's is
# public, the worker's serves health alone).
_MUTUAL_TLS = ("admission", "orchestrator", "interactions")


def _channel(name: str, address: str) -> grpc.aio.Channel:
    """A channel to a service's gRPC port: over mutual TLS when this environment configures it
    (TETHER_TLS_*, as a service's pod has) and the service serves that way."""
    from tether.runtime.tls import mutual_tls
    from tether.settings import PlatformSettings

    tls = mutual_tls("tether doctor", PlatformSettings(), serves=False, calls=True)
    if tls is not None and name in _MUTUAL_TLS:
        return grpc.aio.secure_channel(address, tls.channel_credentials())
    return grpc.aio.insecure_channel(address)


async def _health_check(name: str, address: str) -> Check:
    try:
        async with _channel(name, address) as channel:
            answer = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=PROBE_TIMEOUT_S
            )
    except grpc.aio.AioRpcError as exc:
        return Check(f"service {name}", False, f"{address}: {exc.code().name}: {exc.details()}")
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
    return Check(f"service {name}", answer.status == answer.SERVING, f"{address}: {status}")


def _services(args: argparse.Namespace) -> dict[str, str]:
    found = {name: os.environ[env] for name, env in _SERVICES_ENV.items() if os.environ.get(env)}
    found.update({str(k): str(v) for k, v in _stack(args).get("services", {}).items()})
    for entry in args.service or ():
        name, sep, address = entry.partition("=")
        if not sep or not name or not address:
            raise ValueError(f"--service takes NAME=HOST:PORT; got {entry!r}")
        found[name] = address
    return found


async def cmd_doctor(args: argparse.Namespace, emit: Emit) -> int:
    """Check the database, its migrations and clock, Redis and every service's health."""
    checks = await _database_checks(_database_url(args))
    redis_url = os.environ.get("TETHER_REDIS_URL") or _stack(args).get("redis_url", "")
    redis_url = args.redis_url or redis_url
    checks.append(
        await _redis_check(redis_url)
        if redis_url
        else Check("redis", False, "no Redis URL: pass --redis-url or set TETHER_REDIS_URL")
    )
    services = _services(args)
    if not services:
        checks.append(
            Check(
                "services",
                False,
                "no service addresses: pass --stack, --service NAME=HOST:PORT, or set "
                + ", ".join(_SERVICES_ENV.values()),
            )
        )
    probes: list[Awaitable[Check]] = [_health_check(n, a) for n, a in sorted(services.items())]
    checks.extend(await asyncio.gather(*probes))
    for check in checks:
        emit(
            args,
            {"check": check.name, "ok": check.ok, "detail": check.detail},
            f"{'ok' if check.ok else 'FAIL':<4} {check.name:<24} {check.detail}",
        )
    return 0 if all(c.ok for c in checks) else 1


async def cmd_migrate(args: argparse.Namespace, emit: Emit) -> int:
    """Apply the migrations up to head (or --to) on the database."""
    from tether.db.engine import create_engine
    from tether.db.migrate import applied_revisions, upgrade

    url = _database_url(args)

    async def applied() -> str:
        engine = create_engine(url, pool_size=1, application="cli")
        try:
            return ", ".join(await applied_revisions(engine))
        finally:
            await engine.dispose()

    before = await applied()
    await upgrade(url, args.to)
    after = await applied()
    text = (
        f"database at {after}; nothing to apply"
        if before == after
        else f"database migrated from {before or 'empty'} to {after}"
    )
    emit(args, {"from": before or None, "to": after}, text)
    return 0


def register(
    sub: Any,
    common: Callable[[argparse.ArgumentParser], None],
    wrap: Callable[[Callable[[argparse.Namespace, Any], Awaitable[int]]], Any],
) -> None:
    """Add the operator's subcommands."""
    retry = sub.add_parser("retry", help="retry a failed or cancelled run (a new run, lineage)")
    retry.add_argument("run_id")
    add_tenant_flag(retry)
    common(retry)
    retry.set_defaults(func=wrap(cmd_retry))

    tenant = sub.add_parser("tenant", help="manage tenants (the platform operator)")
    tenant_sub = tenant.add_subparsers(dest="tenant_command", required=True)
    delete = tenant_sub.add_parser(
        "delete", help="delete a tenant and all its data, every service's (irreversible)"
    )
    delete.add_argument("tenant_id")
    common(delete)
    delete.set_defaults(func=wrap(cmd_tenant_delete))
    settings = tenant_sub.add_parser(
        "set", help="set a tenant's weight in fair leases and its cap on runs running at once"
    )
    settings.add_argument("tenant_id")
    settings.add_argument("--weight", type=int, help="its share of the pool (default 1)")
    cap = settings.add_mutually_exclusive_group()
    cap.add_argument("--max-running", type=int, help="how many of its runs may run at once")
    cap.add_argument("--no-max-running", action="store_true", help="remove its cap")
    common(settings)
    settings.set_defaults(func=wrap(cmd_tenant_set))

    for name, func, helptext in (
        ("doctor", cmd_doctor, "check the database, migrations, clock, Redis and services"),
        ("migrate", cmd_migrate, "apply the database migrations"),
    ):
        command = sub.add_parser(name, help=helptext)
        command.add_argument("--database-url", help="PostgreSQL URL (default TETHER_DATABASE_URL)")
        if name == "doctor":
            command.add_argument("--redis-url", help="Redis URL (default TETHER_REDIS_URL)")
            command.add_argument(
                "--service", action="append", metavar="NAME=HOST:PORT", help="a service to check"
            )
        else:
            command.add_argument("--to", default="head", help="revision (default head)")
        common(command)
        command.set_defaults(func=wrap(func))


def add_tenant_flag(parser: argparse.ArgumentParser) -> None:
    """`--tenant T`: act as the platform operator within tenant T."""
    parser.add_argument(
        "--tenant",
        default="",
        help="as the platform operator, within this tenant (the stack's operator_credential "
        "or TETHER_OPERATOR_CREDENTIAL)",
    )
