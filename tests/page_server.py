"""A tiny loopback HTTP server (aiohttp, own thread) serving scripted pages to kvtop under test.

Each path serves a list of pages in order (the last one repeats), so a test can make the engine's
counters move between scrapes. It records when each request arrived (monotonic) and its
Authorization header, so tests can compute expected rates and check the token.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

from aiohttp import web
from local_server import serve


@dataclass
class Route:
    pages: list[str | bytes]
    content_type: str = "text/plain; version=0.0.4; charset=utf-8"
    status: int = 200
    delay_s: float = 0.0
    token: str | None = None
    hits: list[float] = field(default_factory=list)
    auth: list[str | None] = field(default_factory=list)
    queries: list[str] = field(default_factory=list)


class PageServer:
    def __init__(self) -> None:
        self.routes: dict[str, Route] = {}
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self.port = 0
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def route(self, path: str, pages: list[str | bytes] | str, **kw) -> Route:
        r = Route(pages=[pages] if isinstance(pages, (str, bytes)) else list(pages), **kw)
        self.routes[path] = r
        return r

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        r = self.routes.get(request.path)
        if r is None:
            return web.Response(status=404, text="not found")
        i = len(r.hits)
        r.hits.append(time.monotonic())
        r.auth.append(request.headers.get("Authorization"))
        r.queries.append(request.query_string)
        if r.token is not None and request.headers.get("Authorization") != f"Bearer {r.token}":
            return web.Response(status=401, text="unauthorized")
        if r.delay_s:
            await asyncio.sleep(r.delay_s)
        page = r.pages[min(i, len(r.pages) - 1)]
        body = page.encode() if isinstance(page, str) else page
        return web.Response(status=r.status, body=body, headers={"Content-Type": r.content_type})

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_route("GET", "/{tail:.*}", self._handle)
        self._runner, self.port = await serve(app)

    def start(self) -> PageServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def __enter__(self) -> PageServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
