"""The gateway's edge rules and console serving on a real aiohttp server over loopback (no
services behind it): CORS is off unless configured, and the console's files are served with a
fallback to index.html, never outside their directory, and a clear error while not built."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx2
from aiohttp import web
from aiohttp.test_utils import TestServer

from services.gateway.http.console import NOT_BUILT, Console
from services.gateway.http.edge import Edge
from services.gateway.http.errors import errors


def console_dir(root: Path) -> Path:
    built = root / "dist"
    (built / "assets").mkdir(parents=True)
    (built / "index.html").write_text("<p>index</p>")
    (built / "assets" / "app.js").write_text("js")
    (root / "secret.txt").write_text("outside")
    return built


async def nothing(_: web.Request) -> web.Response:
    return web.json_response({})


@asynccontextmanager
async def serving(directory: Path, edge: Edge) -> AsyncIterator[str]:
    app = web.Application(middlewares=[errors])
    Console(directory).add_routes(app)
    app.router.add_get("/v2/runs", nothing)
    edge.install(app)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        await server.close()


async def raw_get(base: str, target: str) -> tuple[int, bytes]:
    """GET `target` exactly as written (no client normalises its dots)."""
    host, port = base.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"GET {target} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
    await writer.drain()
    answer = await reader.read()
    writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


async def test_cors_is_off_by_default(tmp_path: Path) -> None:
    async with serving(console_dir(tmp_path), Edge()) as base, httpx2.AsyncClient() as http:
        preflight = await http.options(
            f"{base}/v2/runs",
            headers={"Origin": "https://app.example.com", "Access-Control-Request-Method": "GET"},
        )
        actual = await http.get(f"{base}/v2/runs", headers={"Origin": "https://app.example.com"})
    for answer in (preflight, actual):
        assert not [h for h in answer.headers if h.lower().startswith("access-control-")]
    assert actual.headers["cache-control"] == "no-store"


async def test_the_console_falls_back_to_its_index_and_never_leaves_its_directory(
    tmp_path: Path,
) -> None:
    async with serving(console_dir(tmp_path), Edge()) as base, httpx2.AsyncClient() as http:
        assert (await http.get(f"{base}/console")).text == "<p>index</p>"
        assert (await http.get(f"{base}/console/runs/run_1")).text == "<p>index</p>"
        asset = await http.get(f"{base}/console/assets/app.js")
        assert asset.text == "js" and "immutable" in asset.headers["cache-control"]
        for target in (
            "/console/../secret.txt",
            "/console/%2e%2e/secret.txt",
            "/console/..%2fsecret.txt",
            "/console/assets/%2e%2e/%2e%2e/secret.txt",
        ):
            status, body = await raw_get(base, target)
            assert b"outside" not in body, target
            assert status in (200, 404), target  # 200: the index, for a path it normalised
        status, body = await raw_get(base, "/console/%00")
        assert status == 404 and b"outside" not in body


async def test_an_unbuilt_console_says_how_to_build_it(tmp_path: Path) -> None:
    async with serving(tmp_path / "absent", Edge()) as base, httpx2.AsyncClient() as http:
        answer = await http.get(f"{base}/console/runs")
    assert answer.status_code == 404
    assert answer.json()["error"]["message"] == NOT_BUILT
    assert answer.json()["error"]["code"] == "console_not_built"
    assert "frame-ancestors 'none'" in answer.headers["content-security-policy"]
