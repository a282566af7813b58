"""The console's schedules page in headless chromium against the stack as real processes: a
schedule with a cron that does not parse is refused in the API's words and nothing is stored; one
added from the page is listed with its next fire time in its timezone, paused, resumed and
removed. Run with
`.venv/bin/python -m pytest -q -m browser tests/browser/test_console_schedules.py`."""

from __future__ import annotations

import json

import grpc
import httpx2
import pytest
from playwright.async_api import expect

from tests.browser.test_console import Watched, axe_violations, base, shot, sign_in
from tests.system.execution_support import ExecStack, Tenant
from tether import apikeys
from tether.testing.eventually import eventually
from tether.v1 import gateway_pb2

pytestmark = pytest.mark.browser

SCHEDULE_SCOPES = (
    *apikeys.CLIENT_SCOPES,
    apikeys.AGENTS_WRITE,
    apikeys.SCHEDULES_READ,
    apikeys.SCHEDULES_WRITE,
)


async def listed(stack: ExecStack, tenant: Tenant) -> list[dict[str, object]]:
    async with httpx2.AsyncClient(base_url=base(stack)) as http:
        response = await http.get(
            "/v2/schedules", headers={"Authorization": f"Bearer {tenant.api_key}"}
        )
    assert response.status_code == 200, response.text
    found: list[dict[str, object]] = response.json().get("schedules", [])
    return found


async def test_a_schedule_is_refused_then_added_paused_resumed_and_removed(
    stack: ExecStack, watched: Watched
) -> None:
    tenant = await stack.tenant(scopes=SCHEDULE_SCOPES)
    spec = json.dumps({"name": "reporter", "instructions": "You report.", "tools": []})
    async with grpc.aio.insecure_channel(stack.addr("gateway")) as channel:
        await tenant.stub(channel).ApplyAgent(
            gateway_pb2.ApplyAgentRequest(spec=spec), metadata=tenant.metadata
        )
    page = watched.page
    await sign_in(watched, stack, tenant)
    await page.get_by_role("navigation", name="Pages").get_by_role("link", name="Schedules").click()
    await expect(page.get_by_role("heading", name="Schedules", exact=True)).to_be_visible()
    await expect(page.get_by_text("No schedules yet.")).to_be_visible()

    form = page.get_by_role("form", name="New schedule")
    await form.get_by_label("Agent").fill("reporter")
    await form.get_by_label("Cron").fill("0 25 * * *")
    await form.get_by_label("Timezone").fill("Europe/Paris")
    await form.get_by_label("Message").fill("morning report")
    await form.get_by_role("button", name="Add schedule").click()
    refusal = form.get_by_role("alert")
    await expect(refusal).to_contain_text("The schedule was not added.")
    (refused,) = watched.posts("/v2/schedules")
    answer = await refused.response()
    assert answer is not None and answer.status == 400
    said = (await answer.json())["error"]
    assert said["status"] == "INVALID_ARGUMENT" and "does not parse" in said["message"]
    await expect(refusal).to_contain_text(said["message"])
    assert await listed(stack, tenant) == []

    await form.get_by_label("Cron").fill("0 9 * * 1-5")
    await form.get_by_role("button", name="Add schedule").click()
    [stored] = await _eventually_one(stack, tenant)
    row = page.locator(f'table.schedules tr[data-schedule="{stored["scheduleId"]}"]')
    await expect(row.locator("td").nth(0)).to_have_text("reporter")
    await expect(row.locator("td").nth(1)).to_have_text("0 9 * * 1-5 Europe/Paris")
    await expect(row.locator("td").nth(2)).to_contain_text("09:00 Europe/Paris")
    await expect(row.locator("td").nth(3)).to_have_text("overlap skip, catch-up latest")
    await expect(row.locator("td").nth(4)).to_have_text("none yet")
    assert await axe_violations(page) == []
    await shot(page, "schedules")

    await row.get_by_role("button", name="Pause").click()
    await expect(row.locator("td").nth(2)).to_have_text("paused")
    assert (await listed(stack, tenant))[0].get("paused") is True
    await row.get_by_role("button", name="Resume").click()
    await expect(row.locator("td").nth(2)).to_contain_text("09:00 Europe/Paris")
    assert "paused" not in (await listed(stack, tenant))[0]
    await row.get_by_role("button", name="Remove").click()
    await expect(page.get_by_text("No schedules yet.")).to_be_visible()
    assert await listed(stack, tenant) == []


async def _eventually_one(stack: ExecStack, tenant: Tenant) -> list[dict[str, object]]:
    async def probe() -> list[dict[str, object]] | None:
        found = await listed(stack, tenant)
        return found or None

    return await eventually(probe, what="the schedule added from the page")
