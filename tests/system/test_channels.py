"""Channel connections through the gateway's HTTP v2 routes and the CLI, on one shared stack: each
kind added, listed, shown, rotated and removed, and no secret in any answer or service log; the
gateway alone may look up a connection's verification secrets, which a rotation's grace keeps
double for a while; a loopback target is refused under the default policy."""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
import sys
import uuid
from pathlib import Path

import grpc
import httpx2
import pytest

from tests.system.conftest import RunningStack
from tether import apikeys
from tether.db.engine import create_engine
from tether.runtime.rpc import internal_channel
from tether.testing.eventually import eventually
from tether.testing.slack_wire import DEMO_BOT_TOKEN, DEMO_SIGNING_SECRET
from tether.v1 import interactions_pb2, interactions_pb2_grpc


def _secret(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(16)}"


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


async def _other_tenant_key(stack: RunningStack) -> str:
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.begin() as conn:
            tenant = f"t-{uuid.uuid4().hex[:8]}"
            await apikeys.ensure_tenant(conn, tenant)
            key, _ = await apikeys.create_key(
                conn, tenant, "eve", [apikeys.CHANNELS_READ, apikeys.CHANNELS_WRITE]
            )
    finally:
        await engine.dispose()
    return key


def _file(tmp_path: Path, value: str) -> str:
    path = tmp_path / f"secret-{uuid.uuid4().hex[:6]}"
    path.write_text(value + "\n")
    return str(path)


async def _lookup(
    stack: RunningStack, caller: str, channel_id: str
) -> interactions_pb2.LookupChannelVerificationResponse:
    address = stack.services.addresses()["interactions"]
    async with internal_channel(address, stack.credentials[caller]) as channel:
        stub = interactions_pb2_grpc.InteractionsServiceStub(channel)
        response: interactions_pb2.LookupChannelVerificationResponse = (
            await stub.LookupChannelVerification(
                interactions_pb2.LookupChannelVerificationRequest(channel_id=channel_id)
            )
        )
        return response


async def test_each_kind_is_added_shown_rotated_and_removed_without_a_secret_shown(
    stack: RunningStack, tmp_path: Path
) -> None:
    values = {
        name: _secret(name)
        for name in (
            "signing",
            "bot",
            "app",
            "verify",
            "access",
            "whsec",
            "rotated",
            "rotated2",
        )
    }
    # A webhook connection's secret is a Standard Webhooks one, as its sender shows it.
    values["whsec"] = "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()
    answers: list[str] = []
    http_base = f"http://{stack.services.http_addresses()['gateway']}"
    auth = {"Authorization": f"Bearer {stack.admin_key}"}

    code, out = await _tether(
        stack,
        tmp_path,
        "channels",
        "add",
        "slack",
        "--name",
        f"slack-{uuid.uuid4().hex[:6]}",
        "--signing-secret-file",
        _file(tmp_path, values["signing"]),
        "--bot-token-file",
        _file(tmp_path, values["bot"]),
        "--json",
    )
    assert code == 0, out
    answers.append(out)
    slack = json.loads(out)
    assert set(slack) == {"channel_id", "webhook_url"}
    assert slack["webhook_url"] == f"{http_base}/v2/webhooks/slack/{slack['channel_id']}"

    code, out = await _tether(
        stack,
        tmp_path,
        "channels",
        "add",
        "webhook",
        "--name",
        f"hook-{uuid.uuid4().hex[:6]}",
        "--secret-file",
        _file(tmp_path, values["whsec"]),
        "--text-field",
        "/message/text",
        "--thread-field",
        "/thread",
        "--sender-field",
        "/from",
        "--event-id-field",
        "/id",
        "--json",
    )
    assert code == 0, out
    answers.append(out)
    hook = json.loads(out)
    assert hook["webhook_url"].endswith(f"/v2/webhooks/webhook/{hook['channel_id']}")

    async with httpx2.AsyncClient(base_url=http_base, timeout=30) as http:
        posted = await http.post(
            "/v2/channels",
            json={
                "kind": "whatsapp",
                "name": f"wa-{uuid.uuid4().hex[:6]}",
                "secrets": {
                    "appSecret": values["app"],
                    "verifyToken": values["verify"],
                    "accessToken": values["access"],
                },
                "settings": {"phoneNumberId": "1234567890"},
            },
            headers=auth,
        )
        assert posted.status_code == 201, posted.text
        answers.append(posted.text)
        whatsapp = posted.json()
        assert whatsapp["channel"]["apiBaseUrl"] == "https://graph.facebook.com/v21.0/"
        assert {s["name"]: s["lastFour"] for s in whatsapp["channel"]["secrets"]} == {
            "app_secret": values["app"][-4:],
            "verify_token": values["verify"][-4:],
            "access_token": values["access"][-4:],
        }

        listed = await http.get("/v2/channels", headers=auth)
        assert listed.status_code == 200, listed.text
        answers.append(listed.text)
        ids = {c["channelId"] for c in listed.json()["channels"]}
        assert {slack["channel_id"], hook["channel_id"], whatsapp["channelId"]} <= ids
        shown = await http.get(f"/v2/channels/{hook['channel_id']}", headers=auth)
        assert shown.status_code == 200, shown.text
        answers.append(shown.text)
        assert shown.json()["channel"]["settings"]["text_field"] == "/message/text"
        for args in (("list", "--json"), ("list",), ("show", slack["channel_id"], "--json")):
            code, out = await _tether(stack, tmp_path, "channels", *args)
            assert code == 0, out
            answers.append(out)

        before = await _lookup(stack, "gateway", slack["channel_id"])
        assert before.kind == "slack" and before.tenant_id
        assert list(before.secrets) == [values["signing"]]
        code, out = await _tether(
            stack,
            tmp_path,
            "channels",
            "rotate-secret",
            slack["channel_id"],
            "--file",
            _file(tmp_path, values["rotated"]),
            "--json",
        )
        assert code == 0, out
        answers.append(out)
        during = await _lookup(stack, "gateway", slack["channel_id"])
        assert list(during.secrets) == [values["rotated"], values["signing"]]

        rotated = await http.post(
            f"/v2/channels/{slack['channel_id']}/rotate-secret",
            json={"secret": values["rotated2"], "graceSeconds": 1},
            headers=auth,
        )
        assert rotated.status_code == 200, rotated.text
        answers.append(rotated.text)
        assert list((await _lookup(stack, "gateway", slack["channel_id"])).secrets) == [
            values["rotated2"],
            values["rotated"],
        ]

        async def only_the_new_one() -> bool:
            found = await _lookup(stack, "gateway", slack["channel_id"])
            return list(found.secrets) == [values["rotated2"]]

        await eventually(only_the_new_one, timeout=10, what="the grace to end")

        deleted = await http.delete(f"/v2/channels/{whatsapp['channelId']}", headers=auth)
        assert deleted.status_code == 200, deleted.text
        again = await http.delete(f"/v2/channels/{whatsapp['channelId']}", headers=auth)
        assert again.status_code == 404
        assert again.json()["error"]["status"] == "NOT_FOUND"
        code, out = await _tether(stack, tmp_path, "channels", "rm", hook["channel_id"])
        assert code == 0, out
        gone = await http.get(f"/v2/channels/{hook['channel_id']}", headers=auth)
        assert gone.status_code == 404, gone.text

    for answer in answers:
        for value in values.values():
            assert value not in answer
    for name, process in stack.services.procs.items():
        log = process.log_path.read_text(errors="replace")
        for value in values.values():
            assert value not in log, f"{name}'s log holds a secret"


async def test_only_the_gateway_may_look_up_verification_secrets(
    stack: RunningStack, tmp_path: Path
) -> None:
    code, out = await _tether(
        stack,
        tmp_path,
        "channels",
        "add",
        "slack",
        "--name",
        f"slack-{uuid.uuid4().hex[:6]}",
        "--signing-secret-file",
        _file(tmp_path, _secret("s")),
        "--bot-token-file",
        _file(tmp_path, _secret("b")),
        "--json",
    )
    assert code == 0, out
    channel_id = json.loads(out)["channel_id"]
    assert (await _lookup(stack, "gateway", channel_id)).kind == "slack"
    for caller in ("worker", "interactions"):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _lookup(stack, caller, channel_id)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, caller
    with pytest.raises(grpc.aio.AioRpcError) as absent:
        await _lookup(stack, "gateway", "ch_" + uuid.uuid4().hex)
    assert absent.value.code() == grpc.StatusCode.NOT_FOUND


async def test_bad_input_is_refused_clearly_and_stores_nothing(
    stack: RunningStack, tmp_path: Path
) -> None:
    http_base = f"http://{stack.services.http_addresses()['gateway']}"
    auth = {"Authorization": f"Bearer {stack.admin_key}"}
    slack_secrets = {"signingSecret": "s" * 20, "botToken": "b" * 20}
    name = f"bad-{uuid.uuid4().hex[:6]}"
    refused = {
        "loopback": (
            {"kind": "slack", "name": name, "secrets": slack_secrets,
             "apiBaseUrl": "http://127.0.0.1:9/api/"},
            "api_base_url",
        ),
        "kind": ({"kind": "telegram", "name": name, "secrets": slack_secrets}, "kind"),
        "name": ({"kind": "slack", "name": "no spaces", "secrets": slack_secrets}, "name"),
        "nul": ({"kind": "slack", "name": "a\u0000b", "secrets": slack_secrets}, "name"),
        "agent": (
            {"kind": "slack", "name": name, "agent": "not an agent", "secrets": slack_secrets},
            "agent",
        ),
        "missing secret": (
            {"kind": "slack", "name": name, "secrets": {"signingSecret": "s" * 20}},
            "bot_token",
        ),
        "pointer": (
            {"kind": "webhook", "name": name, "secrets": {"secret": "w" * 20},
             "settings": {"textField": "text", "threadField": "/t", "senderField": "/s",
                          "eventIdField": "/e"}},
            "JSON pointer",
        ),
    }  # fmt: skip
    async with httpx2.AsyncClient(base_url=http_base, timeout=30) as http:
        for why, (body, named) in refused.items():
            answer = await http.post("/v2/channels", json=body, headers=auth)
            assert answer.status_code == 400, (why, answer.text)
            assert answer.json()["error"]["status"] == "INVALID_ARGUMENT", why
            assert named in answer.json()["error"]["message"], (why, answer.text)
        listed = (await http.get("/v2/channels", headers=auth)).json().get("channels", [])
        assert name not in {c["name"] for c in listed}
        no_scope = await http.get(
            "/v2/channels", headers={"Authorization": f"Bearer {stack.key_a}"}
        )
        assert no_scope.status_code == 403, no_scope.text
        mine = await http.post(
            "/v2/channels",
            json={"kind": "slack", "name": name, "secrets": slack_secrets},
            headers=auth,
        )
        assert mine.status_code == 201, mine.text
        mine_id = mine.json()["channelId"]
        other = {"Authorization": f"Bearer {await _other_tenant_key(stack)}"}
        theirs = await http.get(f"/v2/channels/{mine_id}", headers=other)
        absent = await http.get(f"/v2/channels/ch_{uuid.uuid4().hex}", headers=other)
        assert theirs.status_code == absent.status_code == 404, theirs.text
        absent_id = absent.request.url.path.rsplit("/", 1)[1]
        assert theirs.json() == json.loads(absent.text.replace(absent_id, mine_id))
        for answer in (
            await http.delete(f"/v2/channels/{mine_id}", headers=other),
            await http.post(
                f"/v2/channels/{mine_id}/rotate-secret", json={"secret": "x" * 20}, headers=other
            ),
        ):
            assert answer.status_code == 404, answer.text
        assert (await http.get(f"/v2/channels/{mine_id}", headers=auth)).status_code == 200
    code, out = await _tether(
        stack,
        tmp_path,
        "channels",
        "add",
        "slack",
        "--name",
        name,
        "--signing-secret-file",
        str(tmp_path / "absent"),
        "--bot-token-file",
        str(tmp_path / "absent"),
    )
    assert code != 0
    assert "absent" in out and "Traceback" not in out, out


async def test_a_demo_slack_channel_takes_the_stand_ins_secrets_without_files(
    stack: RunningStack, tmp_path: Path
) -> None:
    name = f"demo-{uuid.uuid4().hex[:6]}"
    # A public address: this stack allows no private targets (tether up allows loopback).
    code, out = await _tether(
        stack,
        tmp_path,
        *("channels", "add", "slack", "--demo", "--name", name),
        *("--api-base-url", "https://8.8.8.8/api/", "--json"),
    )
    assert code == 0, out
    added = json.loads(out)
    code, out = await _tether(stack, tmp_path, "channels", "show", added["channel_id"], "--json")
    assert code == 0, out
    shown = json.loads(out)
    assert (shown["name"], shown["kind"], shown["api_base_url"]) == (
        name,
        "slack",
        "https://8.8.8.8/api/",
    )
    hints = {s["name"]: s["last_four"] for s in shown["secrets"]}
    assert hints == {
        "signing_secret": DEMO_SIGNING_SECRET[-4:],
        "bot_token": DEMO_BOT_TOKEN[-4:],
    }
    assert DEMO_SIGNING_SECRET not in out and DEMO_BOT_TOKEN not in out

    refused = await _tether(
        stack,
        tmp_path,
        *("channels", "add", "slack", "--demo", "--signing-secret-file", "s.txt"),
        *("--api-base-url", "https://8.8.8.8/api/"),
    )
    assert refused[0] == 2 and "leave out --signing-secret-file" in refused[1]
