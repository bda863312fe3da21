"""The Prometheus feed (`--prometheus URL`): one ``PrometheusPoll`` source into a Core.

The console's and ``kvtop snapshot``'s feed over every engine instance a Prometheus server scrapes.
It is a *fleet* feed (``is_fleet``): the console opens on its fleet screen.
"""

from __future__ import annotations

import asyncio
import time

from kvtop.core import Core
from kvtop.feeds.sources import PrometheusPoll, SourceContext
from kvtop.sources.promapi import PromAuth, PromClient
from kvtop.sources.promfleet import PromFleet


class PromFeed:
    """Polls a ``PromFleet`` into a Core: same shape as the live runner for the console
    (``run(stop=...)``, ``refresh_now``). Queries are blocking HTTP, so each poll runs in a worker
    thread; records are ingested on the event loop."""

    is_fleet = True  # the console opens on the fleet screen

    def __init__(self, core: Core, url: str, selector: str | None = None, interval_s: float = 5.0,
                 timeout_s: float = 5.0, window_s: float = 120.0, step_s: float | None = None,
                 token: str | None = None, auth: PromAuth | None = None):
        self.core = core
        self.url = url
        self.interval_s = max(0.5, interval_s)
        self.notice: str | None = None
        self._t0 = time.monotonic()
        self.fleet = PromFleet(PromClient(url, timeout_s=timeout_s, token=token, auth=auth), selector=selector,
                               step_s=step_s or max(1.0, min(self.interval_s, 15.0)), window_s=window_s,
                               clock=self.now)
        self.fleet.rate_window_s = float(core.window_s)
        self.source = PrometheusPoll(self.fleet)
        self._ctx = SourceContext(core=core, emit=core.ingest, now=self.now)
        self.source.attach(self._ctx)
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def polls(self) -> int:
        return self.source.polls

    def now(self) -> float:
        return time.monotonic() - self._t0

    def poll_once(self) -> None:
        """One blocking poll, ingested into the core (snapshot and tests use it directly)."""
        if self.source.poll_blocking():
            self.core.now = max(self.core.now, self.now())

    def controls(self) -> None:
        return None  # no trace clock: Prometheus is read live

    async def run(self, *, stop: asyncio.Event | None = None, duration_s: float | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        await self.source.start(self._ctx)
        end = None if duration_s is None else self.now() + duration_s
        while not (stop is not None and stop.is_set()) and (end is None or self.now() < end):
            await self.source.poll(self.now())
            self.core.now = max(self.core.now, self.now())
            try:
                await asyncio.wait_for(self._wake.wait(), self.interval_s)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
        await self.source.stop()

    def refresh_now(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            loop.call_soon_threadsafe(wake.set)
