"""The agent's metrics port under connections that never finish a request (tests/test_agent_cli.py
runs the agent itself; here the bounds themselves, small enough to watch)."""

from __future__ import annotations

import asyncio

import httpx
from aiohttp import web

from kvtop.httpguard import GuardedServer


async def _serve(limit: int, head_s: float, idle_s: float) -> tuple[web.AppRunner, GuardedServer, str]:
    async def ok(_r: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    app = web.Application()
    app.router.add_get("/healthz", ok)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    assert runner.server is not None
    guard = GuardedServer(runner.server, limit=limit, head_s=head_s, idle_s=idle_s)
    port = await guard.start("127.0.0.1", 0)
    return runner, guard, f"http://127.0.0.1:{port}"


async def test_half_sent_requests_are_closed_and_new_connections_past_the_limit_refused():
    # 300 connections that each sent half a request line held an agent's port (and its descriptors)
    # for good: /healthz and the proxy stopped answering
    runner, guard, url = await _serve(limit=8, head_s=0.5, idle_s=5.0)
    port = int(url.rsplit(":", 1)[1])
    writers = []
    try:
        for _ in range(8):
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"GET /metrics HTTP/1.1\r\n")
            await w.drain()
            writers.append((r, w))
        await asyncio.sleep(0.1)
        assert guard.connections == 8
        r9, w9 = await asyncio.open_connection("127.0.0.1", port)  # past the limit: closed at once
        assert await asyncio.wait_for(r9.read(), 2) == b""
        await asyncio.sleep(0.8)  # the half-sent heads time out
        assert guard.connections == 0 and guard.book.timed_out == 8
        async with httpx.AsyncClient() as c:
            assert (await c.get(url + "/healthz", timeout=2)).text == "ok\n"
            # a kept-alive client is served again and again
            for _ in range(3):
                assert (await c.get(url + "/healthz", timeout=2)).status_code == 200
    finally:
        for _r, w in writers:
            w.close()
        await guard.close()
        await runner.cleanup()
