"""The console's agents page in headless chromium against the stack as real processes: an agent
created, changed, diffed and rolled back from the page, and a stale edit (another version
published meanwhile) refused with the conflict shown and nothing written. Run with
`.venv/bin/python -m pytest -q -m browser tests/browser/test_console_agents.py`."""

from __future__ import annotations

import json
from typing import Any

import httpx2
import pytest
from playwright.async_api import expect

from tests.browser.test_console import Watched, axe_violations, base, shot, sign_in
from tests.system.execution_support import ExecStack, Tenant
from tether import apikeys

pytestmark = pytest.mark.browser

AGENT_SCOPES = (*apikeys.CLIENT_SCOPES, apikeys.AGENTS_READ, apikeys.AGENTS_WRITE)


def document(instructions: str) -> str:
    return json.dumps(
        {
            "name": "helper",
            "instructions": instructions,
            "tools": ["get_time"],
            "routes": [{"channel": "web"}],
        },
        indent=2,
    )


async def agent_api(stack: ExecStack, tenant: Tenant, method: str, path: str, **body: Any) -> Any:
    """A call on the agents' HTTP routes with the tenant's key, as another person would make it."""
    async with httpx2.AsyncClient(base_url=base(stack)) as http:
        response = await http.request(
            method,
            f"/v2/agents{path}",
            headers={"Authorization": f"Bearer {tenant.api_key}"},
            **({"json": body} if body else {}),
        )
    assert response.status_code < 300, response.text
    return response.json()


async def test_agents_are_changed_diffed_and_rolled_back_from_the_console_a_stale_edit_refused(
    stack: ExecStack, watched: Watched
) -> None:
    tenant = await stack.tenant(scopes=AGENT_SCOPES)
    page = watched.page
    await sign_in(watched, stack, tenant)
    await page.get_by_role("navigation", name="Pages").get_by_role("link", name="Agents").click()
    await expect(page.get_by_role("heading", name="Agents")).to_be_visible()
    await expect(page.get_by_text("No agents yet.")).to_be_visible()

    # A new agent from the list page's form: its page opens on version 1.
    create = page.get_by_role("form", name="New agent")
    await create.get_by_label("Document (JSON or YAML)").fill(document("You are Helper, brief."))
    await create.get_by_role("button", name="Apply").click()
    await expect(page.get_by_role("heading", name="Agent helper")).to_be_visible()
    await expect(page.get_by_test_id("published-version")).to_have_text("1")

    # A change applied on its base version publishes version 2.
    edit = page.get_by_role("form", name="Edit agent")
    await expect(edit.get_by_test_id("base-version")).to_contain_text("version 1 is published")
    editor = edit.get_by_label("Document (JSON or YAML)")
    await editor.fill(document("You are Helper v2, chatty."))
    await edit.get_by_role("button", name="Apply").click()
    await expect(edit.get_by_role("status")).to_have_text("Created and published version 2.")
    await expect(page.get_by_test_id("published-version")).to_have_text("2")
    applies = watched.posts("/v2/agents")
    assert [json.loads(a.post_data or "{}").get("baseVersion") for a in applies] == [None, 1]
    assert all(a.headers.get("x-csrf-token") for a in applies)

    # The diff between the two versions shows the changed line, and only it.
    await page.get_by_label("From version", exact=True).select_option("1")
    await page.get_by_label("To version", exact=True).select_option("2")
    diff = page.get_by_label("Diff from version 1 to 2")
    await expect(diff.locator(".diff-removed")).to_have_text(
        ['-   "instructions": "You are Helper, brief.",']
    )
    await expect(diff.locator(".diff-added")).to_have_text(
        ['+   "instructions": "You are Helper v2, chatty.",']
    )
    await shot(page, "agent-diff", diff)

    # Someone else publishes version 3; this page's edit, still on base 2, is refused (409) and
    # says so, and nothing is written.
    other = await agent_api(
        stack, tenant, "POST", "", spec=document("You are Helper v3."), baseVersion=2
    )
    assert (other["version"], other["created"]) == (3, True)
    await editor.fill(document("You are Helper v2, on a stale base."))
    await edit.get_by_role("button", name="Apply").click()
    conflict = edit.get_by_role("alert")
    await expect(conflict).to_contain_text(
        "Conflict: version 2 is no longer the published version; nothing was applied."
    )
    await expect(conflict).to_contain_text("Load the published version")
    await expect(editor).to_have_value(document("You are Helper v2, on a stale base."))
    await shot(page, "agent-conflict", edit)
    assert watched.posts("/v2/agents")[-1].response is not None
    stale = await watched.posts("/v2/agents")[-1].response()
    assert stale is not None and stale.status == 409
    assert (await stale.json())["error"]["status"] == "ABORTED"
    versions = await agent_api(stack, tenant, "GET", "/helper/versions")
    assert [v["version"] for v in versions["versions"]] == [1, 2, 3]
    await conflict.get_by_role("button", name="Load the published version").click()
    await expect(edit.get_by_test_id("base-version")).to_contain_text("version 3 is published")
    await expect(editor).to_have_value(document("You are Helper v3."))

    # A rollback to version 1 publishes it again.
    await page.get_by_role("button", name="Roll back to version 1").click()
    await expect(page.get_by_role("status").filter(has_text="published again")).to_have_text(
        "Version 1 is published again; runs routed from now on get it."
    )
    await expect(page.get_by_test_id("published-version")).to_have_text("1")
    shown = await agent_api(stack, tenant, "GET", "/helper")
    assert (shown["publishedVersion"], shown["agent"]["version"]) == (1, 1)
    rollbacks = watched.posts("/v2/agents/helper/rollback")
    assert [json.loads(r.post_data or "{}") for r in rollbacks] == [
        {"toVersion": 1, "baseVersion": 3}
    ]
    assert await axe_violations(page) == []
    await shot(page, "agent-page")

    # The list: published version, default, routes. An agent without routes, the tenant's first
    # such, becomes its default.
    fallback = json.dumps({"name": "fallback", "instructions": "You take the rest."})
    await agent_api(stack, tenant, "POST", "", spec=fallback)
    await page.get_by_role("link", name="All agents").click()
    rows = page.locator("table.agents tbody tr")
    await expect(rows.nth(0).locator("td")).to_have_text(
        ["fallback", "1", "default", "none: takes the unrouted runs"]
    )
    await expect(rows.nth(1).locator("td")).to_have_text(["helper", "1", "", "channel web"])
    assert await axe_violations(page) == []


async def test_a_rollback_from_a_stale_view_shows_the_conflict_and_changes_nothing(
    stack: ExecStack, watched: Watched
) -> None:
    tenant = await stack.tenant(scopes=AGENT_SCOPES)
    for words in ("You are Helper, brief.", "You are Helper v2, chatty."):
        await agent_api(stack, tenant, "POST", "", spec=document(words))
    page = watched.page
    await sign_in(watched, stack, tenant, "/console/agents/helper")
    await expect(page.get_by_test_id("published-version")).to_have_text("2")

    # Someone else publishes version 3 while this page still shows version 2 as published.
    other = await agent_api(stack, tenant, "POST", "", spec=document("You are Helper v3."))
    assert other["version"] == 3
    await page.get_by_role("button", name="Roll back to version 1").click()
    conflict = page.get_by_role("alert").filter(has_text="Conflict")
    await expect(conflict).to_contain_text(
        "Conflict: version 2 is no longer the published version; nothing was rolled back."
    )
    await expect(conflict).to_contain_text("at version 3, not 2")
    await shot(page, "agent-rollback-conflict", conflict)
    (refused,) = watched.posts("/v2/agents/helper/rollback")
    assert json.loads(refused.post_data or "{}") == {"toVersion": 1, "baseVersion": 2}
    answer = await refused.response()
    assert answer is not None and answer.status == 409
    assert (await answer.json())["error"]["status"] == "ABORTED"
    shown = await agent_api(stack, tenant, "GET", "/helper")
    assert (shown["publishedVersion"], shown["agent"]["version"]) == (3, 3)
    versions = await agent_api(stack, tenant, "GET", "/helper/versions")
    assert [v["version"] for v in versions["versions"]] == [1, 2, 3]

    # Loading the published version clears the conflict and shows version 3.
    await conflict.get_by_role("button", name="Load the published version").click()
    await expect(page.get_by_test_id("published-version")).to_have_text("3")
    await expect(conflict).to_have_count(0)
    assert await axe_violations(page) == []


async def test_the_render_panel_shows_the_request_for_a_sample_message_without_a_model_call(
    stack: ExecStack, watched: Watched
) -> None:
    tenant = await stack.tenant(scopes=AGENT_SCOPES)
    helper = json.dumps({"name": "helper", "instructions": "You are Helper, brief.", "tools": []})
    await agent_api(stack, tenant, "POST", "", spec=helper)
    support = json.dumps(
        {
            "name": "support",
            "instructions": "You are Support, on WhatsApp.",
            "tools": ["get_time"],
            "routes": [{"channel": "whatsapp"}],
        }
    )
    await agent_api(stack, tenant, "POST", "", spec=support)
    heard_before = len(stack.model.requests)
    page = watched.page
    await sign_in(watched, stack, tenant, "/console/agents/support")
    panel = page.get_by_role("form", name="Render")
    message = "Where is my parcel?"
    await panel.get_by_label("Message").fill(message)
    await panel.get_by_label("Channel").fill("whatsapp")
    await panel.get_by_role("button", name="Render").click()
    rendered = panel.get_by_role("region", name="Rendered request")
    await expect(rendered.get_by_test_id("rendered-agent")).to_have_text("support version 1")
    await expect(rendered.get_by_test_id("routed-agent")).to_have_text("support version 1")
    request = json.loads(await rendered.get_by_test_id("rendered-request").inner_text())
    assert "You are Support, on WhatsApp." in json.dumps(request["system"])
    assert [t["name"] for t in request["tools"]] == ["get_time"]
    assert message in json.dumps(request["messages"])
    await shot(page, "agent-render", panel)
    # For the web channel no route claims the message: the default, helper, would take it.
    await panel.get_by_label("Channel").fill("web")
    await panel.get_by_role("button", name="Render").click()
    await expect(rendered.get_by_test_id("routed-agent")).to_have_text("helper version 1")
    assert len(stack.model.requests) == heard_before, "a render called the model"
    renders = watched.posts("/v2/agents/support/render")
    assert [json.loads(r.post_data or "{}") for r in renders] == [
        {"message": message, "source": "", "channel": "whatsapp"},
        {"message": message, "source": "", "channel": "web"},
    ]
