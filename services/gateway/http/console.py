"""The web console's static files at /console, from its build directory: a path naming a file
serves it, any other path under /console serves index.html (the console routes in the page),
and a path escaping the directory is not found."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from tether.errors import NotFound

NOT_BUILT = "the console is not built; run `make console`"


class Console:
    """Serves one build directory."""

    def __init__(self, directory: Path) -> None:
        self._root = directory.resolve()

    def add_routes(self, app: web.Application) -> None:
        """Add /console and /console/* to `app`."""
        app.router.add_get("/console", self.serve)
        app.router.add_get("/console/{path:.*}", self.serve)

    async def serve(self, request: web.Request) -> web.StreamResponse:
        index = self._root / "index.html"
        if not index.is_file():
            raise NotFound(NOT_BUILT, code="console_not_built")
        wanted = request.match_info.get("path", "")
        absent = NotFound(f"no file {request.path[:200]!r} in the console")
        try:
            target = (self._root / wanted).resolve()
            is_file = target.is_file()
        except (ValueError, OSError) as exc:  # a NUL, a name too long for the file system
            raise absent from exc
        if not target.is_relative_to(self._root):
            raise absent
        if wanted and is_file:
            response = web.FileResponse(target)
            # Vite names assets by their content: they never change under one name.
            immutable = wanted.startswith("assets/")
            response.headers["Cache-Control"] = (
                "public, max-age=31536000, immutable" if immutable else "no-cache"
            )
            return response
        response = web.FileResponse(index)
        response.headers["Cache-Control"] = "no-cache"
        return response
