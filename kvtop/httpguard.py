"""Bounds on a small HTTP port's connections (the agent's /metrics): how many may be open, how long a
request's head may take to arrive, and how long a connection may sit idle.

aiohttp waits for a request's head without a deadline and accepts connections until the process runs
out of file descriptors: 300 connections that each sent half a request line held an agent's port and
its recording proxy's (they share the descriptor table) for good. A metrics port serves a scraper and
the odd curl; these bounds cost them nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

MAX_CONNECTIONS = 128  # open at once; past it a new connection is closed at once
HEAD_S = 10.0  # from a request's first byte to the end of its head
IDLE_S = 120.0  # a kept-alive connection with no request coming (Prometheus scrapes at most every 60 s)


class _Book:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open: set[_Guarded] = set()
        self.refused = 0
        self.timed_out = 0


class _Guarded(asyncio.Protocol):
    """Passes everything to the server's own protocol, and closes the connection that breaks a bound."""

    def __init__(self, inner: asyncio.Protocol, book: _Book, head_s: float, idle_s: float) -> None:
        self.inner = inner
        self.book = book
        self.head_s = head_s
        self.idle_s = idle_s
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.tail = b""  # the last bytes of a head still arriving (its end may span two reads)
        self.in_head = False
        self.admitted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if len(self.book.open) >= self.book.limit:
            self.book.refused += 1
            transport.abort()
            return
        self.admitted = True
        self.book.open.add(self)
        self.inner.connection_made(transport)
        self._arm(self.idle_s)

    def _arm(self, seconds: float) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = asyncio.get_running_loop().call_later(seconds, self._expire)

    def _expire(self) -> None:
        self.book.timed_out += 1
        if self.transport is not None:
            self.transport.abort()

    def data_received(self, data: bytes) -> None:
        if not self.admitted:
            return
        if not self.in_head:
            self.in_head = True
            self._arm(self.head_s)
        seen = self.tail + data
        if b"\r\n\r\n" in seen or b"\n\n" in seen:
            # a whole head arrived: the body (bounded by aiohttp) and the answer take what they take;
            # then the connection may idle until the next request
            self.in_head = False
            self.tail = b""
            self._arm(self.idle_s)
        else:
            self.tail = seen[-3:]
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.admitted else None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.admitted:
            self.book.open.discard(self)
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.admitted:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.admitted:
            self.inner.resume_writing()


class GuardedServer:
    """``asyncio`` server for an aiohttp ``web.Server`` (``AppRunner.server``) with the bounds above."""

    def __init__(self, factory: Callable[[], Any], limit: int = MAX_CONNECTIONS, head_s: float = HEAD_S,
                 idle_s: float = IDLE_S) -> None:
        self.factory = factory
        self.book = _Book(limit)
        self.head_s = head_s
        self.idle_s = idle_s
        self.server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen; returns the bound port."""
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(
            lambda: _Guarded(self.factory(), self.book, self.head_s, self.idle_s), host, port, reuse_address=True)
        socks = list(self.server.sockets)
        return int(socks[0].getsockname()[1]) if socks else port

    @property
    def connections(self) -> int:
        return len(self.book.open)

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            for g in list(self.book.open):
                if g.transport is not None:
                    g.transport.abort()
            await self.server.wait_closed()
            self.server = None
