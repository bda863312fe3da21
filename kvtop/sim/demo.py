"""``kvtop demo``: the simulated engine + load generator on loopback, watched by the live runner.

``DemoFeed.run(stop)`` starts the simulated server on an ephemeral loopback port, the load
generator against it, and the live runner (``kvtop.live.LiveRunner``) scraping it into the core —
all on the caller's event loop, so the console can run it as its feed. The load generator's
client-side request records go into the core through the runner, exactly as the recording proxy's do.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from kvtop.core import Core
from kvtop.model.records import Record
from kvtop.sim.loadgen import run_load
from kvtop.sim.server import SimServer
from kvtop.sim.workload import Workload


class _MiniRunner:
    """Fallback scrape loop (used only when ``kvtop.live`` is not installed): /metrics -> vLLM adapter -> core."""

    def __init__(self, core: Core, urls: list[str], interval_s: float = 1.0):
        self.core = core
        self.urls = urls
        self.interval_s = interval_s
        self._t0 = time.monotonic()
        self._wake = asyncio.Event()

    def now(self) -> float:
        return time.monotonic() - self._t0

    def emit(self, rec: Record) -> None:
        self.core.ingest(rec)

    def refresh_now(self) -> None:
        self._wake.set()

    async def _poll(self, session: Any, adapter: Any) -> None:
        for url in self.urls:
            t = self.now()
            try:
                async with session.get(f"{url}/metrics") as r:
                    text = await r.text()
            except Exception as e:  # the engine may be gone: show it, keep going
                self.core.engine_down(url, t, f"{type(e).__name__}: {e}", adapter="vllm")
                continue
            for rec in adapter.parse(text, t):
                rec.url = url
                self.emit(rec)

    async def run(self, duration_s: float | None = None, stop: asyncio.Event | None = None,
                  final_poll: bool = False) -> None:
        import aiohttp

        from kvtop.plugin import load_adapter

        adapter = load_adapter("vllm")()
        end = None if duration_s is None else self.now() + duration_s
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            while (end is None or self.now() < end) and not (stop is not None and stop.is_set()):
                await self._poll(session, adapter)
                wait = self.interval_s if end is None else min(self.interval_s, max(0.0, end - self.now()))
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), wait)
                except asyncio.TimeoutError:
                    pass
            if final_poll:
                await self._poll(session, adapter)


def make_runner(core: Core, urls: list[str], interval_s: float) -> Any:
    try:
        from kvtop.live import LiveRunner
    except ImportError:
        return _MiniRunner(core, urls, interval_s)
    try:
        # No GPU behind a simulated engine (its row would describe this machine's GPUs, not the
        # demo's); the host row is this machine's memory, real and useful as a live example.
        runner = LiveRunner(core, urls, interval_s=interval_s, gpu=False, host=True)
    except TypeError:
        return LiveRunner(core, urls, interval_s)
    core.set_gpu_status("none: the engine is simulated")
    return runner


def live_analysis(workload: Workload) -> Any:
    """The live analysis for the core. The simulated engine's KV geometry is known, so the cost
    model gets bytes per token without a model config."""
    from kvtop.analysis.live import LiveAnalyzer

    e = workload.engine
    return LiveAnalyzer(itl_target_s=e.itl_target_s, adapter="vllm", model=e.model,
                        kv_bytes_per_token=e.bytes_per_token)


class DemoFeed:
    """A console feed: simulated engine + load generator + live runner on one event loop."""

    def __init__(self, core: Core, workload: Workload, seed: int = 1, speed: float = 1.0,
                 interval_s: float = 1.0, host: str = "127.0.0.1"):
        self.core = core
        self.workload = workload
        self.seed = seed
        self.speed = speed
        self.interval_s = interval_s
        self.host = host
        self.runner: Any = None
        self.server: SimServer | None = None
        self.url: str | None = None

    def refresh_now(self) -> None:
        fn = getattr(self.runner, "refresh_now", None)
        if fn is not None:
            fn()

    async def run(self, stop: asyncio.Event | None = None, duration_s: float | None = None) -> None:
        self.server = SimServer(self.workload, speed=self.speed, seed=self.seed, host=self.host)
        self.url = await self.server.start()
        self.runner = make_runner(self.core, [self.url], self.interval_s)
        horizon = duration_s * self.speed + 60 if duration_s is not None else 10 * 365 * 86400.0
        load = asyncio.create_task(run_load(self.url, self.workload, horizon, self.seed, self.runner.emit,
                                            speed=self.speed, clock=self.runner.now))
        try:
            await self.runner.run(duration_s=duration_s, stop=stop, final_poll=duration_s is not None)
        finally:
            load.cancel()
            await asyncio.gather(load, return_exceptions=True)
            await self.server.stop()
