"""The secret store through the gateway's three surfaces (gRPC, HTTP v2, the CLI): a value goes
in and never comes out, not in an answer, not in a service's log, not in the table."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
import uuid
from pathlib import Path

import grpc
import httpx2
import pytest
from sqlalchemy import text

from tests.system.conftest import RunningStack
from tether import apikeys
from tether.credentials import SECRETS_KEY_ENV, generate, service_env
from tether.db.engine import create_engine
from tether.v1 import gateway_pb2, gateway_pb2_grpc


def _secret() -> str:
    return "xoxb-" + secrets.token_hex(16)


def _md(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


async def _other_tenant_key(stack: RunningStack) -> str:
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.begin() as conn:
            tenant = f"t-{uuid.uuid4().hex[:8]}"
            await apikeys.ensure_tenant(conn, tenant)
            key, _ = await apikeys.create_key(
                conn, tenant, "eve", [apikeys.SECRETS_READ, apikeys.SECRETS_WRITE]
            )
    finally:
        await engine.dispose()
    return key


async def _status(call: object) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    return info.value.code()


async def _tether(stack: RunningStack, tmp_path: Path, *args: str) -> tuple[int, str]:
    stack_file = tmp_path / f"stack-{uuid.uuid4().hex[:6]}.json"
    stack_file.write_text(json.dumps({"gateway": stack.gateway, "api_key": stack.admin_key}))
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tether.cli",
        *args,
        "--stack",
        str(stack_file),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, out.decode() + err.decode()


async def test_a_secret_is_stored_listed_and_removed_but_never_read_back(
    stack: RunningStack, gateway_channel: grpc.aio.Channel, tmp_path: Path
) -> None:
    stub = gateway_pb2_grpc.GatewayServiceStub(gateway_channel)
    admin = _md(stack.admin_key)
    values = {f"{via}-{uuid.uuid4().hex[:6]}": _secret() for via in ("grpc", "http", "cli")}
    grpc_name, http_name, cli_name = values
    answers: list[str] = []

    added = await stub.AddSecret(
        gateway_pb2.AddSecretRequest(name=grpc_name, value=values[grpc_name]), metadata=admin
    )
    assert (added.secret.name, added.secret.last_four) == (grpc_name, values[grpc_name][-4:])
    answers.append(str(added))

    http_base = f"http://{stack.services.http_addresses()['gateway']}"
    auth = {"Authorization": f"Bearer {stack.admin_key}"}
    async with httpx2.AsyncClient(base_url=http_base, timeout=30) as http:
        posted = await http.post(
            "/v2/secrets", json={"name": http_name, "value": values[http_name]}, headers=auth
        )
        assert posted.status_code == 201, posted.text
        assert posted.json()["secret"]["lastFour"] == values[http_name][-4:]
        answers.append(posted.text)

        value_file = tmp_path / "value"
        value_file.write_text(values[cli_name] + "\n")
        code, out = await _tether(
            stack, tmp_path, "secrets", "add", cli_name, "--file", str(value_file), "--json"
        )
        assert code == 0, out
        assert json.loads(out)["last_four"] == values[cli_name][-4:]
        answers.append(out)

        listed = await stub.ListSecrets(gateway_pb2.ListSecretsRequest(), metadata=admin)
        assert {s.name for s in listed.secrets} >= set(values)
        answers.append(str(listed))
        got = await http.get("/v2/secrets", headers=auth)
        assert got.status_code == 200, got.text
        assert {s["name"] for s in got.json()["secrets"]} >= set(values)
        answers.append(got.text)
        code, out = await _tether(stack, tmp_path, "secrets", "list", "--json")
        assert code == 0, out
        assert {json.loads(line)["name"] for line in out.splitlines()} >= set(values)
        answers.append(out)
        code, out = await _tether(stack, tmp_path, "secrets", "list")
        assert code == 0 and cli_name in out, out
        answers.append(out)

        again = stub.AddSecret(
            gateway_pb2.AddSecretRequest(name=grpc_name, value="other-value"), metadata=admin
        )
        assert await _status(again) == grpc.StatusCode.ALREADY_EXISTS

        removed = await stub.RemoveSecret(
            gateway_pb2.RemoveSecretRequest(name=grpc_name), metadata=admin
        )
        assert removed.name == grpc_name
        deleted = await http.delete(f"/v2/secrets/{http_name}", headers=auth)
        assert deleted.status_code == 200, deleted.text
        deleted_again = await http.delete(f"/v2/secrets/{http_name}", headers=auth)
        assert deleted_again.status_code == 404
        assert deleted_again.json()["error"]["status"] == "NOT_FOUND"
        code, out = await _tether(stack, tmp_path, "secrets", "rm", cli_name)
        assert code == 0, out
        left = await stub.ListSecrets(gateway_pb2.ListSecretsRequest(), metadata=admin)
        assert not set(values) & {s.name for s in left.secrets}

    for answer in answers:
        for value in values.values():
            assert value not in answer
    for name, process in stack.services.procs.items():
        log = process.log_path.read_text(errors="replace")
        for value in values.values():
            assert value not in log, f"{name}'s log holds a secret's value"


async def test_bad_input_and_another_tenant_change_nothing(
    stack: RunningStack, gateway_channel: grpc.aio.Channel
) -> None:
    stub = gateway_pb2_grpc.GatewayServiceStub(gateway_channel)
    admin = _md(stack.admin_key)
    name, value = f"kept-{uuid.uuid4().hex[:6]}", _secret()
    await stub.AddSecret(gateway_pb2.AddSecretRequest(name=name, value=value), metadata=admin)
    refused = {
        "empty": gateway_pb2.AddSecretRequest(name="x1", value=""),
        "too long": gateway_pb2.AddSecretRequest(name="x2", value="a" * 65_537),
        # Within the characters the gateway counts, over the 64 KiB the store seals.
        "too many bytes": gateway_pb2.AddSecretRequest(name="x3", value="€" * 30_000),
        "bad name": gateway_pb2.AddSecretRequest(name="no spaces", value="v"),
        "no name": gateway_pb2.AddSecretRequest(name="", value="v"),
    }
    for why, request in refused.items():
        code = await _status(stub.AddSecret(request, metadata=admin))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, why
    no_scope = stub.ListSecrets(gateway_pb2.ListSecretsRequest(), metadata=_md(stack.key_a))
    assert await _status(no_scope) == grpc.StatusCode.PERMISSION_DENIED

    other = _md(await _other_tenant_key(stack))
    assert not (await stub.ListSecrets(gateway_pb2.ListSecretsRequest(), metadata=other)).secrets
    with pytest.raises(grpc.aio.AioRpcError) as theirs:
        await stub.RemoveSecret(gateway_pb2.RemoveSecretRequest(name=name), metadata=other)
    with pytest.raises(grpc.aio.AioRpcError) as absent:
        await stub.RemoveSecret(gateway_pb2.RemoveSecretRequest(name="never-was"), metadata=other)
    assert theirs.value.code() == absent.value.code() == grpc.StatusCode.NOT_FOUND
    assert theirs.value.details().replace(name, "N") == absent.value.details().replace(
        "never-was", "N"
    )
    # The other tenant may use the same name: its own, not ours.
    await stub.AddSecret(gateway_pb2.AddSecretRequest(name=name, value="theirs"), metadata=other)

    listed = await stub.ListSecrets(gateway_pb2.ListSecretsRequest(), metadata=admin)
    assert {s.name for s in listed.secrets} & {"x1", "x2", "x3"} == set()
    assert name in {s.name for s in listed.secrets}
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            stored = (await conn.execute(text("SELECT s::text FROM secrets s"))).all()
    finally:
        await engine.dispose()
    assert any(name in row[0] for row in stored)
    assert not any(value in row[0] for row in stored)


def test_interactions_with_a_malformed_key_exits_naming_the_setting() -> None:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("TETHER_")},
        **service_env(generate(), "interactions"),
        SECRETS_KEY_ENV: "dev1:not-a-key",
    }
    done = subprocess.run(
        [sys.executable, "-m", "services.interactions"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0
    assert "TETHER_SECRETS_KEY" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
