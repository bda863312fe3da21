"""The console's feed while no engine answers: GPU and host now, engines once the ports answer."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kvtop.core import Core
from kvtop.feeds.live import LiveRunner
from kvtop.sources.discover import discover


class ProbingFeed:
    """GPU and host polling run at once while the local ports are probed every ``probe_every_s``;
    the first engines found are scraped from then on (the same clock, so history carries on).
    ``notice`` is the banner while nothing is found. ``make_runner(urls)`` (from
    ``kvtop.pipeline``) builds the live runner for a list of engine URLs, into one core."""

    is_fleet = False

    def __init__(self, make_runner: Callable[[list[str]], LiveRunner], ports: tuple[int, ...],
                 probe_every_s: float = 5.0, host: str = "127.0.0.1"):
        self.make_runner = make_runner
        self.ports = ports
        self.host = host
        self.probe_every_s = probe_every_s
        self.runner = make_runner([])
        self.urls: list[str] = []
        self.notice: str | None = (
            f"no engine found on {host} ports {', '.join(map(str, ports))} (still looking every "
            f"{probe_every_s:g} s): point kvtop at one with --url http://HOST:PORT or `url` in config.toml, "
            "or try `kvtop demo`")

    @property
    def core(self) -> Core:
        return self.runner.core  # one core for the whole run: make_runner hands every runner the same

    @property
    def interval_s(self) -> float:
        return float(self.runner.interval_s)

    @interval_s.setter
    def interval_s(self, v: float) -> None:
        self.runner.interval_s = v

    def refresh_now(self) -> None:
        self.runner.refresh_now()

    def controls(self) -> None:
        return None

    async def run(self, stop: asyncio.Event | None = None) -> None:
        outer = stop or asyncio.Event()
        inner = asyncio.Event()
        task = asyncio.create_task(self.runner.run(stop=inner))
        try:
            while not outer.is_set() and not self.urls:
                try:
                    await asyncio.wait_for(outer.wait(), self.probe_every_s)
                    break
                except asyncio.TimeoutError:
                    pass
                found = await asyncio.to_thread(discover, self.ports, self.host)
                if found and not outer.is_set():
                    self.urls = found
                    inner.set()
                    await task
                    old = self.runner
                    self.runner = self.make_runner(found)
                    self.runner.t0 = old.t0  # one run clock across the switch
                    self.runner.interval_s = old.interval_s  # and the interval +/- may have changed
                    self.notice = None
                    self.core.event(self.runner.now(), "info", "engine_up", "engine found: " + ", ".join(found))
                    inner = asyncio.Event()
                    task = asyncio.create_task(self.runner.run(stop=inner))
            if not task.done():
                await outer.wait()
        finally:
            inner.set()
            await asyncio.gather(task, return_exceptions=True)
