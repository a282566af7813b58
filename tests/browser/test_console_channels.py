"""The console's channels page in headless chromium against the stack as real processes: a Slack
connection added from the page (a loopback API refused first, in the API's words, nothing
stored), listed with its webhook URL and its secrets as name and last four only, its verification
secret rotated with a grace, and removed after a confirmation. Run with
`.venv/bin/python -m pytest -q -m browser tests/browser/test_console_channels.py`."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx2
import pytest
from playwright.async_api import expect

from tests.browser.test_console import Watched, axe_violations, base, shot, sign_in
from tests.system.execution_support import ExecStack, Tenant
from tether import apikeys

pytestmark = pytest.mark.browser

CHANNEL_SCOPES = (*apikeys.CLIENT_SCOPES, apikeys.CHANNELS_READ, apikeys.CHANNELS_WRITE)
SIGNING = "8f742231b10e8888abcd99yyyzzz85a5"
BOT_TOKEN = "xoxb-17653672481-19874698323-pdFZKVeTuE8sk7oOcBrzbqgy"
ROTATED = "0c1d2e3f4a5b6c7d8e9fnewsecretWXYZ"


async def channels_api(stack: ExecStack, tenant: Tenant, method: str, path: str = "") -> Any:
    """A read of the channels' HTTP routes with the tenant's key: (status, body)."""
    async with httpx2.AsyncClient(base_url=base(stack)) as http:
        response = await http.request(
            method, f"/v2/channels{path}", headers={"Authorization": f"Bearer {tenant.api_key}"}
        )
    return response.status_code, response.json()


async def test_a_slack_channel_is_added_listed_without_secrets_rotated_and_removed(
    stack: ExecStack, watched: Watched
) -> None:
    tenant = await stack.tenant(scopes=CHANNEL_SCOPES)
    page = watched.page
    await sign_in(watched, stack, tenant)
    await page.get_by_role("navigation", name="Pages").get_by_role("link", name="Channels").click()
    await expect(page.get_by_role("heading", name="Channels", exact=True)).to_be_visible()
    await expect(page.get_by_text("No channels yet.")).to_be_visible()

    # The form has the CLI's Slack fields; the secrets are password inputs.
    form = page.get_by_role("form", name="New channel")
    await expect(form.get_by_label("Kind")).to_have_value("slack")
    await form.get_by_label("Name").fill("demo")
    await form.get_by_label("Signing secret").fill(SIGNING)
    await form.get_by_label("Bot token").fill(BOT_TOKEN)
    for secret in ("Signing secret", "Bot token"):
        await expect(form.get_by_label(secret)).to_have_attribute("type", "password")

    # A loopback API is refused (the stack allows no private targets): the page says it in the
    # API's words, keeps the form, and nothing is stored.
    await form.get_by_label("API base URL").fill("http://127.0.0.1:9/api/")
    await form.get_by_role("button", name="Add channel").click()
    refusal = form.get_by_role("alert")
    await expect(refusal).to_contain_text("The channel was not added.")
    (refused,) = watched.posts("/v2/channels")
    answer = await refused.response()
    assert answer is not None and answer.status == 400
    said = (await answer.json())["error"]
    assert said["status"] == "INVALID_ARGUMENT"
    await expect(refusal).to_contain_text(said["message"])
    assert (await channels_api(stack, tenant, "GET")) == (200, {})

    # Without it, the connection is added and the provider's URL shown.
    await form.get_by_label("API base URL").fill("")
    await form.get_by_role("button", name="Add channel").click()
    added_card = page.get_by_role("status", name="Channel added")
    await expect(added_card).to_contain_text("Channel demo added")
    added = await (await watched.posts("/v2/channels")[-1].response()).json()  # type: ignore[union-attr]
    channel_id, webhook_url = added["channelId"], added["webhookUrl"]
    assert webhook_url == f"{base(stack)}/v2/webhooks/slack/{channel_id}"
    await expect(added_card).to_contain_text(webhook_url)
    for secret in ("Signing secret", "Bot token"):
        await expect(form.get_by_label(secret)).to_have_value("")

    # Listed: name, kind, agent, webhook URL, each secret as its name and last four only.
    row = page.locator(f'table.channels tr[data-channel="{channel_id}"]')
    await expect(row.locator("td")).to_have_text(
        [
            "demo",
            "slack",
            "routes",
            f"{webhook_url} Copy",
            f"bot_token …{BOT_TOKEN[-4:]}, signing_secret …{SIGNING[-4:]}",
            "none",
        ]
    )
    html = await page.content()
    assert SIGNING not in html and BOT_TOKEN not in html
    status, listed = await channels_api(stack, tenant, "GET")
    assert status == 200
    assert SIGNING not in json.dumps(listed) and BOT_TOKEN not in json.dumps(listed)

    # The copy button puts the webhook URL on the clipboard.
    await page.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=base(stack))
    await row.get_by_role("button", name="Copy the webhook URL of demo").click()
    await expect(row.get_by_role("status")).to_have_text("Copied")
    assert await page.evaluate("navigator.clipboard.readText()") == webhook_url
    assert await axe_violations(page) == []
    await shot(page, "channels")

    # The connection's page: a grace the API refuses is shown in its words and changes nothing;
    # one it takes rotates the secret and says until when the previous one verifies.
    await row.get_by_role("link", name="demo").click()
    await expect(page.get_by_role("heading", name="Channel demo")).to_be_visible()
    await expect(page.get_by_test_id("webhook-url")).to_have_text(webhook_url)
    await expect(page.get_by_test_id("previous-secret")).to_have_text("none")
    rotate = page.get_by_role("form", name="Rotate the verification secret")
    await expect(rotate.get_by_label("New secret")).to_have_attribute("type", "password")
    await rotate.get_by_label("New secret").fill(ROTATED)
    await rotate.get_by_label("Grace").fill("8d")
    await rotate.get_by_role("button", name="Rotate").click()
    rotations = f"/v2/channels/{channel_id}/rotate-secret"
    await expect(rotate.get_by_role("alert")).to_have_text("grace must be between 0 and 7 days")
    (too_long,) = watched.posts(rotations)
    assert json.loads(too_long.post_data or "{}") == {"secret": ROTATED, "graceSeconds": "691200"}
    await rotate.get_by_label("Grace").fill("2 hours")
    await rotate.get_by_role("button", name="Rotate").click()
    await expect(rotate.get_by_role("alert")).to_contain_text("is not a duration such as 30m")
    assert len(watched.posts(rotations)) == 1, "a grace the page cannot read is never sent"

    await rotate.get_by_label("Grace").fill("2h")
    before = datetime.now(UTC)
    await rotate.get_by_role("button", name="Rotate").click()
    await expect(rotate.get_by_role("status")).to_contain_text("Rotated")
    await expect(rotate.get_by_label("New secret")).to_have_value("")
    assert json.loads(watched.posts(rotations)[-1].post_data or "{}")["graceSeconds"] == "7200"
    await expect(page.get_by_test_id("secrets")).to_have_text(
        f"bot_token …{BOT_TOKEN[-4:]}, signing_secret …{ROTATED[-4:]}"
    )
    previous = page.get_by_test_id("previous-secret")
    await expect(previous).to_contain_text("verifies until ")
    until = datetime.fromisoformat((await previous.inner_text()).removeprefix("verifies until "))
    assert before + timedelta(hours=2) - timedelta(seconds=5) <= until
    assert until <= datetime.now(UTC) + timedelta(hours=2, seconds=5)
    assert ROTATED not in await page.content()
    assert await axe_violations(page) == []
    await shot(page, "channel")

    # Removal asks first; keeping it removes nothing.
    await page.get_by_role("button", name="Remove channel").click()
    confirm = page.get_by_role("group", name="Confirm removal")
    await expect(confirm).to_contain_text("Remove channel demo?")
    await confirm.get_by_role("button", name="Keep it").click()
    await expect(confirm).to_have_count(0)
    assert (await channels_api(stack, tenant, "GET", f"/{channel_id}"))[0] == 200
    await page.get_by_role("button", name="Remove channel").click()
    await (
        page.get_by_role("group", name="Confirm removal")
        .get_by_role("button", name="Remove demo")
        .click()
    )
    await expect(page.get_by_role("heading", name="Channels", exact=True)).to_be_visible()
    await expect(page.get_by_text("No channels yet.")).to_be_visible()
    status, gone = await channels_api(stack, tenant, "GET", f"/{channel_id}")
    assert (status, gone["error"]["status"]) == (404, "NOT_FOUND")

    # The removed connection's page is "not found", as any other.
    await page.goto(f"{base(stack)}/console/channels/{channel_id}")
    await expect(page.get_by_role("heading", name="Not found")).to_be_visible()
