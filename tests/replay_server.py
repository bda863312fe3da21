"""A loopback aiohttp server, in its own thread, replaying fixed pages to kvtop under test.

``routes`` maps a path to ``(body, content_type)``; a list body is served page by page (the last
repeats) so counters can move between scrapes. ``hits`` counts requests per path.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from aiohttp import web
from local_server import serve

PROM = "text/plain; version=0.0.4; charset=utf-8"


@contextmanager
def replay_server(routes: dict[str, tuple[str | list[str], str]],
                  bearer: str | None = None) -> Iterator[tuple[str, dict[str, int]]]:
    """``bearer``: every request without ``Authorization: Bearer <bearer>`` is refused (401)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    hits: dict[str, int] = {}

    async def handle(request: web.Request) -> web.Response:
        if bearer is not None and request.headers.get("Authorization") != f"Bearer {bearer}":
            return web.Response(status=401, text="unauthorized")
        if request.path not in routes:
            return web.Response(status=404, text="not found")
        hits[request.path] = hits.get(request.path, 0) + 1
        body, ctype = routes[request.path]
        if isinstance(body, list):
            body = body[min(hits[request.path], len(body)) - 1]
        return web.Response(body=body.encode(), headers={"Content-Type": ctype})

    async def start() -> tuple[web.AppRunner, int]:
        app = web.Application()
        app.router.add_route("GET", "/{tail:.*}", handle)
        return await serve(app)

    runner, port = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    try:
        yield f"http://127.0.0.1:{port}", hits
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
