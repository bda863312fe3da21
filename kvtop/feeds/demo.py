"""``kvtop demo``: the simulated engine + load generator on loopback, watched by the live runner.

``DemoFeed.run(stop)`` starts the simulated server on an ephemeral loopback port, the load
generator against it, and the live runner (``kvtop.feeds.live.LiveRunner``) scraping it into the core —
all on the caller's event loop, so the console can run it as its feed. The load generator's
client-side request records go into the core through the runner, exactly as the recording proxy's do.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kvtop.core import Core
from kvtop.feeds.live import LiveRunner
from kvtop.sim.loadgen import run_load
from kvtop.sim.server import SimServer
from kvtop.sim.workload import Workload


class DemoFeed:
    """A console feed: simulated engine + load generator + live runner on one event loop."""

    is_fleet = False

    def __init__(self, core: Core, workload: Workload, make_runner: Callable[[str, float], LiveRunner],
                 seed: int = 1, speed: float = 1.0, interval_s: float = 1.0, host: str = "127.0.0.1"):
        """``make_runner(url, interval_s)`` (from ``kvtop.pipeline``): the live runner that watches
        the simulated engine at ``url``, into ``core``."""
        self.core = core
        self.make_runner = make_runner
        self.workload = workload
        self.seed = seed
        self.speed = speed
        self._interval_s = interval_s
        self.notice: str | None = None
        self.host = host
        self.runner: LiveRunner | None = None
        self.server: SimServer | None = None
        self.url: str | None = None

    def refresh_now(self) -> None:
        if self.runner is not None:
            self.runner.refresh_now()

    @property
    def interval_s(self) -> float:
        return self._interval_s

    @interval_s.setter
    def interval_s(self, v: float) -> None:
        self._interval_s = v
        if self.runner is not None:  # the runner that scrapes the simulated engine follows
            self.runner.interval_s = v

    def controls(self) -> None:
        return None

    async def run(self, stop: asyncio.Event | None = None, duration_s: float | None = None) -> None:
        self.server = SimServer(self.workload, speed=self.speed, seed=self.seed, host=self.host)
        self.url = await self.server.start()
        self.runner = self.make_runner(self.url, self.interval_s)
        self.core.set_gpu_status("none: the engine is simulated")
        horizon = duration_s * self.speed + 60 if duration_s is not None else 10 * 365 * 86400.0
        load = asyncio.create_task(run_load(self.url, self.workload, horizon, self.seed, self.runner.emit,
                                            speed=self.speed, clock=self.runner.now))
        try:
            await self.runner.run(duration_s=duration_s, stop=stop, final_poll=duration_s is not None)
        finally:
            load.cancel()
            await asyncio.gather(load, return_exceptions=True)
            await self.server.stop()
