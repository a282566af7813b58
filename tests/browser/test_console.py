"""The web console in headless chromium (Debian's, by its executable path) against the stack
as real processes: sign-in, a run appearing live and streaming, a question answered and an
approval decided from the page (the run resumes), a reload mid-stream that loses and repeats
nothing, the retry indicator counting down while the model server answers 529, the same "not
found" page for another tenant's run as for a random id, a mutation without the CSRF token
refused, sign-out ending the session, a parent run's tree with the child its delegate call
started. Screenshots go to tests/browser/screenshots/.

Run with `make browser` (it builds the console and installs chromium when missing); the
default `make test` collection leaves these out (marker `browser`).
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import socket
import subprocess
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
import pytest_asyncio
from aiohttp import web
from playwright.async_api import (
    Browser,
    ConsoleMessage,
    Page,
    Request,
    async_playwright,
    expect,
)

from tests.system.execution_support import ExecStack, Tenant, exec_stack, wait_for_status
from tether import apikeys
from tether.client import TetherClient
from tether.testing.model_server import ErrorTurn, TextTurn, ToolUseTurn

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
DIST = ROOT / "web" / "console" / "dist"
SCREENSHOTS = Path(__file__).resolve().parent / "screenshots"
AXE = ROOT / "node_modules" / "axe-core" / "axe.min.js"
EMBED = ROOT / "web" / "examples" / "embed" / "dist"
TIMEOUT_MS = 20_000
expect.set_options(timeout=TIMEOUT_MS)


def chromium() -> str:
    path = shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(path).exists():
        pytest.fail("Debian's chromium is not installed: `make browser` installs it")
    return path


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(
    pg_server_url: str, template_db: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ExecStack]:
    if not (DIST / "index.html").exists():
        vite = str(ROOT / "node_modules" / ".bin" / "vite")
        build = [vite, "build", "web/console", "--logLevel", "warn"]
        await asyncio.to_thread(subprocess.run, build, cwd=ROOT, check=True)
    # The OAuth round trip ends on the console's /connected page, so its port is chosen first;
    # and the embedding app's origin is the one CORS allows.
    http_port, embed_port = free_port(), free_port()
    async with exec_stack(
        pg_server_url,
        template_db,
        redis_url,
        Path(tmp_path_factory.mktemp("browser")),
        workers=1,
        extra_env={
            "TETHER_GATEWAY_CONSOLE_DIR": str(DIST),
            "TETHER_GATEWAY_HTTP_PORT": str(http_port),
            "TETHER_GATEWAY_CORS_ORIGINS": f"http://127.0.0.1:{embed_port}",
            "TETHER_INTERACTIONS_OAUTH_REDIRECT_URI": (
                f"http://127.0.0.1:{http_port}/console/connected"
            ),
        },
    ) as running:
        running.embed_port = embed_port  # type: ignore[attr-defined]
        yield running


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def browser() -> AsyncIterator[Browser]:
    async with async_playwright() as playwright:
        launched = await playwright.chromium.launch(executable_path=chromium())
        try:
            yield launched
        finally:
            await launched.close()


class Watched:
    """A page with what it did: its requests and its CSP violations and script errors."""

    def __init__(self, page: Page) -> None:
        self.page = page
        self.requests: list[Request] = []
        self.problems: list[str] = []
        page.on("request", self._request)
        page.on("pageerror", self._error)
        page.on("console", self._console)

    def _request(self, request: Request) -> None:
        self.requests.append(request)

    def _error(self, exc: Exception) -> None:
        self.problems.append(f"page error: {exc}")

    def _console(self, message: ConsoleMessage) -> None:
        if "Content Security Policy" in message.text:
            self.problems.append(message.text)

    def posts(self, suffix: str) -> list[Request]:
        return [r for r in self.requests if r.method == "POST" and r.url.endswith(suffix)]


@pytest_asyncio.fixture(loop_scope="session")
async def watched(browser: Browser) -> AsyncIterator[Watched]:
    context = await browser.new_context(viewport={"width": 1200, "height": 900})
    context.set_default_timeout(TIMEOUT_MS)
    page = Watched(await context.new_page())
    try:
        yield page
    finally:
        await context.close()
    assert page.problems == [], "the console broke its CSP or threw"


def base(stack: ExecStack) -> str:
    return f"http://{stack.services.http_addresses()['gateway']}"


async def shot(page: Page, name: str, locator: Any = None) -> None:
    SCREENSHOTS.mkdir(exist_ok=True)
    target = locator if locator is not None else page
    await target.screenshot(path=str(SCREENSHOTS / f"{name}.png"))


async def sign_in(
    w: Watched, stack: ExecStack, tenant: Tenant, path: str = "/console/", *, axe: bool = False
) -> None:
    page = w.page
    await page.goto(base(stack) + path)
    if axe:
        await expect(page.get_by_label("API key")).to_be_visible()
        assert await axe_violations(page) == []
        await shot(page, "sign-in")
    await page.get_by_label("API key").fill(tenant.api_key)
    await page.get_by_role("button", name="Sign in").click()
    await expect(page.get_by_role("button", name="Sign out")).to_be_visible()
    # The key went in one request body only: never a URL, never the page's storage.
    assert not [r for r in w.requests if tenant.api_key in r.url]
    storage = await page.evaluate("JSON.stringify([{...localStorage}, {...sessionStorage}])")
    assert tenant.api_key not in storage
    assert await page.get_by_label("API key").count() == 0


async def axe_violations(page: Page) -> list[dict[str, Any]]:
    """axe-core's WCAG 2 A/AA violations on the page (run through the DevTools protocol, which
    the page's CSP does not govern)."""
    await page.evaluate(AXE.read_text())
    found: list[dict[str, Any]] = await page.evaluate(
        """async () => (await axe.run(document, {runOnly: ['wcag2a', 'wcag2aa']})).violations
            .map(v => ({id: v.id, nodes: v.nodes.map(n => n.target.join(' '))}))"""
    )
    return found


async def mid_stream(page: Page, some: str, last: str) -> None:
    """Waits until the run is running and its newest assistant part shows some of its text
    (`some`) but not yet its end (`last`)."""
    await page.wait_for_function(
        """([some, last]) => {
            const status = document.querySelector('[data-testid="run-status"]');
            const parts = document.querySelectorAll('.transcript .part.assistant p');
            const text = parts.length ? parts[parts.length - 1].textContent : '';
            return status && status.textContent === 'running'
                && text.includes(some) && !text.includes(last);
        }""",
        arg=[some, last],
    )


def words(n: int, label: str) -> list[str]:
    return [f"{label}{i} " for i in range(n)]


def prompt(label: str) -> str:
    return f"{label} {uuid.uuid4().hex[:8]}"


async def test_a_run_appears_live_and_streams_into_the_page(
    stack: ExecStack, watched: Watched
) -> None:
    tenant = await stack.tenant()
    page = watched.page
    await sign_in(watched, stack, tenant, axe=True)
    await expect(page.get_by_role("heading", name="Runs")).to_be_visible()
    await expect(page.locator(".live.on")).to_be_visible()

    chunks = words(24, "streamed")
    text = prompt("stream to the console")
    stack.model.script(text, [TextTurn("".join(chunks), chunks=chunks, delay_ms=200)])
    run_id = await tenant.send(text)
    row = page.locator(f'tr[data-run-id="{run_id}"]')
    await expect(row).to_be_visible()  # pushed by the live list, no reload
    await shot(page, "runs-list")

    await row.get_by_role("link").click()
    assistant = page.locator(".transcript .part.assistant")
    await mid_stream(page, "streamed", "streamed23")
    await shot(page, "run-mid-stream")
    await expect(page.get_by_test_id("run-status")).to_have_text("completed")
    await expect(assistant).to_have_count(1)
    assert (await assistant.locator("p").inner_text()).strip() == "".join(chunks).strip()
    assert await axe_violations(page) == []
    # The list shows the run's end too (the live list, back on the runs page).
    await page.go_back()
    await expect(page.locator(f'tr[data-run-id="{run_id}"] .status')).to_have_text("completed")
    assert await axe_violations(page) == []
    # Filters: by status, then by conversation (the live list reopens with each).
    listed = page.locator(f'tr[data-run-id="{run_id}"]')
    await page.get_by_label("Status").select_option("RUN_STATUS_FAILED")
    await expect(listed).to_have_count(0)
    await page.get_by_label("Status").select_option("RUN_STATUS_COMPLETED")
    await expect(listed).to_have_count(1)
    conversation = await listed.locator(".conv").inner_text()
    await page.get_by_label("Conversation").fill("c-nobody")
    await page.get_by_role("button", name="Filter").click()
    await expect(listed).to_have_count(0)
    await page.get_by_label("Conversation").fill(conversation)
    await page.get_by_role("button", name="Filter").click()
    await expect(listed).to_have_count(1)


QUESTIONS = {
    "questions": [
        {"key": "size", "prompt": "Which size?", "options": ["S", "M", "L"]},
        {
            "key": "colours",
            "prompt": "Which colours?",
            "options": ["red", "blue", "green"],
            "multiple": True,
            "allow_other": True,
        },
        {"key": "note", "prompt": "Anything else?"},
    ]
}


async def test_a_question_is_answered_from_the_page_once_and_the_run_resumes(
    stack: ExecStack, watched: Watched
) -> None:
    tenant = await stack.tenant()
    text = prompt("order a shirt")
    stack.model.script(text, [ToolUseTurn("ask_questions", QUESTIONS), TextTurn("Ordering M.")])
    run_id = await tenant.send(text)
    await wait_for_status(stack.db_url, run_id, "waiting-for-question")
    page = watched.page
    await sign_in(watched, stack, tenant, f"/console/runs/{run_id}")
    card = page.get_by_role("form", name="Question")
    await expect(card).to_be_visible()
    await card.get_by_label("M", exact=True).check()
    await card.get_by_label("red").check()
    await card.get_by_label("Other answer for Which colours?").fill("teal")
    await card.get_by_label("Anything else?").fill("gift wrap")
    await shot(page, "question-card", card)
    assert await axe_violations(page) == []
    send = card.get_by_role("button", name="Send answer")
    await send.click()
    await expect(card.get_by_role("status")).to_have_text("Answered; the run resumes.")
    await expect(send).to_be_disabled()
    await send.click(force=True)  # a second click on the resolved card
    await expect(page.get_by_test_id("run-status")).to_have_text("completed")
    await expect(page.locator(".transcript")).to_contain_text("Ordering M.")
    answers = watched.posts(f"/v2/runs/{run_id}/answer")
    assert len(answers) == 1
    assert json.loads(answers[0].post_data or "{}") == {
        "answers": {
            "size": {"values": ["M"]},
            "colours": {"values": ["red", "teal"]},
            "note": {"values": ["gift wrap"]},
        }
    }
    assert answers[0].headers.get("x-csrf-token")


async def test_an_approval_is_decided_from_the_page_once_and_the_run_resumes(
    stack: ExecStack, watched: Watched
) -> None:
    tenant = await stack.tenant()
    text = prompt("publish something")
    stack.model.script(
        text, [ToolUseTurn("publish_post", {"text": "Hello from the console"}), TextTurn("Posted.")]
    )
    run_id = await tenant.send(text)
    await wait_for_status(stack.db_url, run_id, "waiting-for-approval")
    page = watched.page
    await sign_in(watched, stack, tenant, f"/console/runs/{run_id}")
    card = page.get_by_role("region", name="Approval")
    await expect(card).to_contain_text("publish_post")
    await expect(card).to_contain_text("publish")  # the risk category
    tool_input = json.loads(await card.get_by_label("Tool input").inner_text())
    assert tool_input == {"text": "Hello from the console"}
    await expect(card.get_by_role("button", name="Always allow")).to_be_visible()  # policy permits
    await shot(page, "approval-card", card)
    assert await axe_violations(page) == []
    await card.get_by_role("button", name="Allow once").click()
    await expect(card.get_by_role("status")).to_contain_text("Decided: Allow once")
    await card.get_by_role("button", name="Deny").click(force=True)
    await expect(page.get_by_test_id("run-status")).to_have_text("completed")
    decisions = watched.posts(f"/v2/runs/{run_id}/decision")
    assert [json.loads(d.post_data or "{}") for d in decisions] == [{"decision": "allow-once"}]


async def test_a_connection_card_logs_in_and_the_round_trip_resumes_the_run(
    stack: ExecStack, watched: Watched
) -> None:
    tenant = await stack.tenant()
    text = prompt("what is on my calendar")
    stack.model.script(text, [ToolUseTurn("calendar_list_events"), TextTurn("You have two.")])
    run_id = await tenant.send(text)
    await wait_for_status(stack.db_url, run_id, "waiting-for-connection")
    page = watched.page
    await sign_in(watched, stack, tenant, f"/console/runs/{run_id}")
    card = page.get_by_role("region", name="Connection")
    await expect(card).to_contain_text("You have not connected democal yet.")
    await shot(page, "connection-card", card)
    await card.get_by_role("link", name="Sign in to democal").click()
    # The provider consents at once and sends the browser back to /console/connected.
    await expect(page.get_by_role("status")).to_have_text("Connected; the run resumes.")
    assert "code=" not in page.url, "the OAuth code left the address bar"
    await page.get_by_role("link", name="Back to the run").click()
    await expect(page.get_by_test_id("run-status")).to_have_text("completed")
    await expect(page.locator(".transcript")).to_contain_text("You have two.")
    completions = watched.posts(f"/v2/runs/{run_id}/connection")
    assert len(completions) == 1


async def test_a_reload_mid_stream_loses_nothing_and_repeats_nothing(
    stack: ExecStack, watched: Watched
) -> None:
    tenant = await stack.tenant()
    first, second = words(20, "first"), words(30, "second")
    text = prompt("two turns")
    stack.model.script(
        text,
        [
            ToolUseTurn("get_time", {}, text="".join(first), delay_ms=60),
            TextTurn("".join(second), chunks=second, delay_ms=150),
        ],
    )
    page = watched.page
    await sign_in(watched, stack, tenant)
    run_id = await tenant.send(text)
    await page.goto(f"{base(stack)}/console/runs/{run_id}")
    await mid_stream(page, "second", "second29")
    before = len(watched.requests)
    await page.reload()
    await expect(page.get_by_test_id("run-status")).to_have_text("completed")
    # It resumed from the last event it had seen, not from the start of the log.
    streams = [r for r in watched.requests[before:] if r.url.endswith(f"/v2/runs/{run_id}/events")]
    assert int(streams[0].headers.get("last-event-id", "0")) > 0
    async with httpx2.AsyncClient(base_url=base(stack)) as http:
        stored = (
            await http.get(
                f"/v2/runs/{run_id}", headers={"Authorization": f"Bearer {tenant.api_key}"}
            )
        ).json()["parts"]
    shown = await page.locator(".transcript [data-part]").evaluate_all(
        "els => els.map(e => Number(e.dataset.part))"
    )
    expected = [p.get("index", 0) for p in stored if "toolResult" not in p]
    assert shown == expected, "every part once, in order"
    texts = await page.locator(".transcript .part.assistant p").all_inner_texts()
    assert [t.strip() for t in texts] == ["".join(first).strip(), "".join(second).strip()]


async def test_a_gateway_crash_mid_stream_is_resumed_from_the_cursor(
    stack: ExecStack, watched: Watched
) -> None:
    """The network breaks under an open page (closing the lid, a proxy restart): here the gateway
    is killed and started again on its ports mid-stream; the page reconnects by itself."""
    tenant = await stack.tenant()
    chunks = words(40, "lid")
    text = prompt("a long answer")
    stack.model.script(text, [TextTurn("".join(chunks), chunks=chunks, delay_ms=150)])
    page = watched.page
    await sign_in(watched, stack, tenant)
    run_id = await tenant.send(text)
    await page.goto(f"{base(stack)}/console/runs/{run_id}")
    await mid_stream(page, "lid", "lid39")
    before = len(watched.requests)
    await stack.services.restart("gateway")
    await expect(page.get_by_test_id("run-status")).to_have_text("completed")
    streams = [r for r in watched.requests[before:] if r.url.endswith(f"/v2/runs/{run_id}/events")]
    assert streams, "the page reconnected"
    assert all(int(r.headers.get("last-event-id", "0")) > 0 for r in streams), "from its cursor"
    texts = await page.locator(".transcript .part.assistant p").all_inner_texts()
    assert [t.strip() for t in texts] == ["".join(chunks).strip()]


async def test_the_retry_indicator_counts_down_while_the_model_answers_529(
    stack: ExecStack, watched: Watched
) -> None:
    tenant = await stack.tenant()
    text = prompt("overloaded")
    stack.model.script(text, [ErrorTurn(529, retry_after=6), TextTurn("Back again.")])
    page = watched.page
    await sign_in(watched, stack, tenant)
    run_id = await tenant.send(text)
    await page.goto(f"{base(stack)}/console/runs/{run_id}")
    indicator = page.get_by_test_id("retry-indicator")
    await expect(indicator).to_contain_text("Attempt 1 of 3 failed")
    await expect(indicator).to_contain_text("529")
    countdown = page.get_by_test_id("retry-countdown")
    await expect(countdown).to_contain_text("Next attempt (2 of 3) in")
    seen = await countdown.inner_text()
    await expect(countdown).not_to_have_text(seen)  # it counts down by itself
    await shot(page, "retry-indicator")
    await expect(page.get_by_test_id("run-status")).to_have_text("completed")
    await expect(indicator).to_have_count(0)
    await expect(page.locator(".transcript")).to_contain_text("Back again.")


async def test_another_tenants_run_shows_the_same_not_found_page_as_a_random_id(
    stack: ExecStack, watched: Watched
) -> None:
    mine, theirs = await stack.tenant(), await stack.tenant()
    text = prompt("someone else's")
    stack.model.script(text, [TextTurn("private")])
    their_run = await theirs.send(text)
    page = watched.page
    await sign_in(watched, stack, mine, f"/console/runs/{their_run}")
    await expect(page.get_by_role("heading", name="Not found")).to_be_visible()
    theirs_page = await page.locator("main").inner_text()
    await shot(page, "not-found")
    await page.goto(f"{base(stack)}/console/runs/run_{uuid.uuid4().hex}")
    await expect(page.get_by_role("heading", name="Not found")).to_be_visible()
    assert await page.locator("main").inner_text() == theirs_page
    assert "private" not in theirs_page


async def test_a_run_is_cancelled_and_retried_from_its_page_with_its_lineage(
    stack: ExecStack, watched: Watched
) -> None:
    tenant = await stack.tenant()
    text = prompt("cancel me")
    stack.model.script(text, [ToolUseTurn("publish_post", {"text": "never"}), TextTurn("Again.")])
    run_id = await tenant.send(text)
    await wait_for_status(stack.db_url, run_id, "waiting-for-approval")
    page = watched.page
    await sign_in(watched, stack, tenant, f"/console/runs/{run_id}")
    # The card is open before the cancel (its read may still be in flight when the page shows).
    await expect(page.get_by_role("region", name="Approval")).to_be_visible()
    await page.get_by_role("button", name="Cancel run").click()
    await expect(page.get_by_test_id("run-status")).to_have_text("cancelled")
    await expect(page.get_by_role("region", name="Approval")).to_contain_text(
        "This approval is no longer open."
    )
    await page.get_by_role("button", name="Retry").click()
    await expect(page).not_to_have_url(re.compile(f"{run_id}$"))
    lineage = page.get_by_role("region", name="Lineage")
    await expect(lineage.get_by_role("link", name=run_id)).to_be_visible()
    await expect(lineage).to_contain_text("(this run)")


async def test_a_mutation_without_the_csrf_token_is_refused_and_sign_out_ends_the_session(
    stack: ExecStack, watched: Watched
) -> None:
    tenant = await stack.tenant()
    text = prompt("park me")
    stack.model.script(text, [ToolUseTurn("publish_post", {"text": "x"})])
    run_id = await tenant.send(text)
    await wait_for_status(stack.db_url, run_id, "waiting-for-approval")
    page = watched.page
    await sign_in(watched, stack, tenant)
    refused = await page.evaluate(
        """async (runId) => {
            const r = await fetch(`/v2/runs/${runId}/cancel`, {method: 'POST', body: '{}',
                headers: {'Content-Type': 'application/json'}});
            return [r.status, await r.json()];
        }""",
        run_id,
    )
    assert refused[0] == 403
    assert refused[1]["error"]["status"] == "PERMISSION_DENIED"
    assert "X-CSRF-Token" in refused[1]["error"]["message"]
    row = await wait_for_status(stack.db_url, run_id, "waiting-for-approval")
    assert row.status == "waiting-for-approval", "the refused mutation changed nothing"

    # A second tab on the live list: its stream ends when the session does.
    other = await page.context.new_page()
    await other.goto(f"{base(stack)}/console/")
    await expect(other.locator(".live.on")).to_be_visible()

    cookies = {c["name"]: c["value"] for c in await page.context.cookies()}
    session = cookies["tether_session"]
    async with httpx2.AsyncClient(base_url=base(stack)) as http:
        cookie = {"Cookie": f"tether_session={session}"}
        assert (await http.get("/v2/session", headers=cookie)).status_code == 200
        await page.get_by_role("button", name="Sign out").click()
        await expect(page.get_by_label("API key")).to_be_visible()
        after = await http.get("/v2/runs", headers=cookie)
        assert after.status_code == 401
    await expect(other.get_by_role("alert", name="Session ended")).to_be_visible()
    await page.reload()
    await expect(page.get_by_label("API key")).to_be_visible()


class EmbeddingApp:
    """Another product's web app on its own origin: serves web/examples/embed's build, and its
    backend mints short-lived tokens from an API key the browser never sees."""

    def __init__(self, gateway: str, port: int) -> None:
        self.gateway = gateway
        self.port = port
        self.api_key = ""
        self.minted: list[str] = []
        self.runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/token", self.token)
        app.router.add_static("/assets", EMBED / "assets")
        app.router.add_get("/", self.index)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def index(self, request: web.Request) -> web.FileResponse:
        return web.FileResponse(EMBED / "index.html")

    async def token(self, request: web.Request) -> web.Response:
        async with httpx2.AsyncClient(base_url=self.gateway) as http:
            minted = await http.post(
                "/v2/tokens",
                json={"ttlSeconds": 60},
                headers={"Authorization": f"Bearer {self.api_key}"},
            )
        body = minted.json()
        self.minted.append(body["token"])
        return web.json_response({"token": body["token"]}, status=minted.status_code)


@pytest_asyncio.fixture(loop_scope="session")
async def embedding_app(stack: ExecStack) -> AsyncIterator[EmbeddingApp]:
    if not (EMBED / "index.html").exists():
        vite = str(ROOT / "node_modules" / ".bin" / "vite")
        build = [vite, "build", "web/examples/embed", "--logLevel", "warn"]
        await asyncio.to_thread(subprocess.run, build, cwd=ROOT, check=True)
    app = EmbeddingApp(base(stack), stack.embed_port)  # type: ignore[attr-defined]
    await app.start()
    try:
        yield app
    finally:
        await app.stop()


async def test_another_apps_page_embeds_the_approval_card_with_short_lived_tokens_over_cors(
    stack: ExecStack, watched: Watched, embedding_app: EmbeddingApp
) -> None:
    tenant = await stack.tenant()
    embedding_app.api_key = tenant.api_key
    text = prompt("publish from the product")
    stack.model.script(
        text, [ToolUseTurn("publish_post", {"text": "Embedded hello"}), TextTurn("Done.")]
    )
    run_id = await tenant.send(text)
    await wait_for_status(stack.db_url, run_id, "waiting-for-approval")
    page = watched.page
    origin = f"http://127.0.0.1:{embedding_app.port}"
    await page.goto(f"{origin}/?gateway={base(stack)}#run={run_id}")
    card = page.get_by_role("region", name="Approval")
    await expect(card).to_contain_text("Embedded hello")
    await shot(page, "embedded-approval")
    await card.get_by_role("button", name="Allow once").click()
    await expect(page.get_by_test_id("embed-status")).to_have_text("RUN_STATUS_COMPLETED")
    await expect(page.get_by_test_id("embed-result")).to_have_text("Done.")
    to_gateway = [r for r in watched.requests if r.url.startswith(base(stack))]
    assert to_gateway, "the page called the gateway itself, cross-origin"
    for request in to_gateway:
        assert (await request.all_headers()).get("authorization", "").startswith("Bearer tt_")
    assert embedding_app.minted and all(t.startswith("tt_") for t in embedding_app.minted)
    assert not [r for r in watched.requests if tenant.api_key in r.url]
    storage = await page.evaluate("JSON.stringify([{...localStorage}, {...sessionStorage}])")
    assert tenant.api_key not in storage


async def test_a_parent_runs_page_shows_its_tree_with_the_child_its_delegate_call_started(
    stack: ExecStack, watched: Watched
) -> None:
    tenant = await stack.tenant(scopes=(*apikeys.CLIENT_SCOPES, apikeys.AGENTS_WRITE))
    async with TetherClient(stack.addr("gateway"), tenant.api_key) as tc:
        # The first agent applied takes the tenant's runs; it may delegate once the other exists.
        await tc.apply_agent(json.dumps({"name": "lead"}))
        await tc.apply_agent(json.dumps({"name": "researcher"}))
        await tc.apply_agent(json.dumps({"name": "lead", "delegation": {"agents": ["researcher"]}}))
    text, asked = prompt("plan the trip"), prompt("find trains")
    stack.model.script(
        text,
        [
            ToolUseTurn("delegate", {"agent": "researcher", "message": asked}),
            TextTurn("Trains are found."),
        ],
    )
    chunks = words(8, "train")
    stack.model.script(asked, [TextTurn("".join(chunks), chunks=chunks, delay_ms=150)])
    parent_id = await tenant.send(text)

    page = watched.page
    await sign_in(watched, stack, tenant, f"/console/runs/{parent_id}")
    tree = page.get_by_role("region", name="Run tree")
    root = tree.locator(f'li[data-run-id="{parent_id}"]')
    child = root.locator("li")
    await expect(child).to_have_count(1)
    # Read again as the parent resumes and ends: the child is shown as it ended.
    await expect(page.get_by_test_id("run-status")).to_have_text("completed")
    await expect(child.locator(".status")).to_have_text("completed")
    await expect(tree.get_by_role("link", name=parent_id)).to_have_attribute("aria-current", "page")
    await expect(root.locator(":scope > .spend").last).to_contain_text("with the runs below")
    assert await axe_violations(page) == []
    await shot(page, "run-tree", tree)

    child_id = await child.get_attribute("data-run-id")
    assert child_id and child_id != parent_id
    await child.get_by_role("link", name=child_id).click()
    await expect(page.get_by_role("heading", name=child_id)).to_be_visible()
    await expect(tree.get_by_role("link", name=child_id)).to_have_attribute("aria-current", "page")
    await expect(tree.get_by_role("link", name=parent_id)).to_be_visible()
