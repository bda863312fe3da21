"""The live runner: polls every source on its own schedule and feeds the core (docs/design.md §1).

Each source (every engine URL, the GPU, the host) runs as its own self-rescheduling asyncio task,
so a slow or dead engine delays nothing else. Blocking reads (NVML, /proc) run in worker threads;
their records are ingested back on the event loop, so the core is only ever touched from one thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from kvtop.core import Core
from kvtop.model.records import GpuRecord, Record
from kvtop.sources.scrape import EngineScraper

Sink = Callable[[Record], None]


class _Source:
    """One polled source: its poll coroutine and a wake-up event for ``refresh_now``."""

    __slots__ = ("name", "poll", "wake")

    def __init__(self, name: str, poll: Callable[[float], Awaitable[None]]):
        self.name = name
        self.poll = poll
        self.wake: asyncio.Event | None = None


class LiveRunner:
    def __init__(
        self,
        core: Core,
        urls: list[str],
        interval_s: float = 1.0,
        gpu: bool = True,
        host: bool = True,
        token: str | None = None,
        adapter: str | None = None,
        sinks: list[Sink] | None = None,
        timeout_s: float = 2.0,
        probe_rate: float | None = None,
        probe_max_tokens: int = 32,
        capture_port: int | None = None,
    ):
        self.core = core
        # --capture: passive observation of the engine port (opened by run(); the command checks
        # privileges first); a request seen by the capture and by the proxy or probe is kept once
        self.capture_port = capture_port
        self.capture: Any = None
        self._owners: Any = None
        self._other_emit: Callable[[Any], None] | None = None
        if capture_port is not None:
            from kvtop.sources.capture import RequestOwners

            self._owners = RequestOwners(self._ingest)
            self._other_emit = self._owners.sink("other")
        # --probe: kvtop's own canary streams against the first engine (off unless asked)
        self.probe_rate = probe_rate
        self.probe_max_tokens = probe_max_tokens
        self.urls = list(urls)
        self.interval_s = max(0.05, float(interval_s))
        self.notice: str | None = None
        self.sinks: list[Sink] = list(sinks or [])
        self._t0 = time.monotonic()
        self.scrapers = [
            EngineScraper(u, adapter=adapter, token=token, timeout_s=timeout_s, clock=self.now) for u in self.urls
        ]
        self._want_gpu = gpu
        self._want_host = host
        self._gpu: Any = None
        self._host: Any = None
        self._gpu_lock = threading.Lock()
        self._host_lock = threading.Lock()
        self._pids: Callable[[], set[int]] | None = None
        self._sources: list[_Source] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._detected: set[int] = set()
        self._sink_failed = False
        self._opened = False
        self._stopping = False
        self.timeout_s = timeout_s
        self.gpu_status = "ok" if gpu else "disabled (--no-gpu)"
        if not gpu:
            core.set_gpu_status(self.gpu_status)
        if not host:
            core.host_status = "off (--no-host)"

    # -- clock and ingest ---------------------------------------------------------------------
    def now(self) -> float:
        """Run clock: monotonic seconds since this runner was created (every source shares it)."""
        return time.monotonic() - self._t0

    def emit(self, rec: Record) -> None:
        """Ingest one record and hand it to every sink. Call on the event loop's thread."""
        if self._other_emit is not None:
            self._other_emit(rec)
            return
        self._ingest(rec)

    def _ingest(self, rec: Record) -> None:
        self.core.ingest(rec)
        for sink in self.sinks:
            try:
                sink(rec)
            except Exception as e:  # a failing recorder must not stop monitoring
                if not self._sink_failed:
                    self._sink_failed = True
                    self.core.event(rec.t, "error", "source_error", f"record sink failed: {e}")

    # -- engine pids (GPU/host sources use them to find the engine's processes) ---------------
    def _engine_pids(self) -> set[int]:
        """PIDs of local engines behind the URLs (cached; empty for remote engines)."""
        if self._pids is None:
            try:
                from kvtop.sources.procs import EnginePids
            except ImportError:
                return set()
            self._pids = EnginePids(self.urls)
        return self._pids()

    # -- sources ------------------------------------------------------------------------------
    def _engine_poll(self, idx: int) -> Callable[[float], Awaitable[None]]:
        scraper = self.scrapers[idx]

        async def poll(t: float) -> None:
            for rec in await scraper.scrape(t):
                self.emit(rec)
            if idx not in self._detected and scraper.adapter_cls is not None:
                self._detected.add(idx)
                self.core.set_engine_capabilities(scraper.url, bool(scraper.adapter_cls.preempts))

        return poll

    def _set_gpu_status(self, status: str) -> None:
        self.gpu_status = status
        self.core.set_gpu_status(status)

    async def _open_gpu(self) -> None:
        try:
            from kvtop.sources.gpu import GpuSource
        except ImportError:
            self._set_gpu_status("GPU source unavailable")
            return
        try:
            self._gpu = await asyncio.to_thread(GpuSource, engine_pids=self._engine_pids)
        except Exception as e:
            self._set_gpu_status(f"GPU source failed to start: {e}")
            return
        self._set_gpu_status(str(getattr(self._gpu, "status", "ok")))

    async def _gpu_poll(self, t: float) -> None:
        if self._gpu is None:
            return

        def poll() -> list[GpuRecord]:
            with self._gpu_lock:
                return list(self._gpu.poll(t))

        try:
            recs = await asyncio.to_thread(poll)
        except Exception as e:
            self._set_gpu_status(f"GPU poll failed: {e}")
            return
        for rec in recs:
            self.emit(rec)
        status = str(getattr(self._gpu, "status", "ok"))
        if status != self.gpu_status:
            self._set_gpu_status(status)

    async def _open_host(self) -> None:
        try:
            from kvtop.sources.host import HostSource
        except ImportError:
            self.core.event(self.now(), "warning", "source_error", "host source unavailable")
            return

        def make() -> Any:
            try:
                return HostSource(engine_pids=self._engine_pids)
            except TypeError:
                return HostSource()

        try:
            self._host = await asyncio.to_thread(make)
        except Exception as e:
            self.core.event(self.now(), "warning", "source_error", f"host source failed to start: {e}")

    async def _host_poll(self, t: float) -> None:
        if self._host is None:
            return

        def poll() -> Any:
            with self._host_lock:
                return self._host.poll(t)

        try:
            rec = await asyncio.to_thread(poll)
        except Exception as e:
            self.core.event(t, "warning", "source_error", f"host poll failed: {e}")
            return
        if rec is not None:
            self.emit(rec)

    async def _setup(self) -> None:
        loop = asyncio.get_running_loop()
        if not self._sources:
            for i, s in enumerate(self.scrapers):
                self._sources.append(_Source(f"engine {s.shown_url}", self._engine_poll(i)))
            if self._want_gpu:
                self._sources.append(_Source("gpu", self._gpu_poll))
            if self._want_host:
                self._sources.append(_Source("host", self._host_poll))
        if self._loop is not loop:  # first run, or a new event loop: events bind to their loop
            self._loop = loop
            for src in self._sources:
                src.wake = asyncio.Event()
        opens = []
        if self._want_gpu and self._gpu is None and not self._opened:
            opens.append(self._open_gpu())
        if self._want_host and self._host is None and not self._opened:
            opens.append(self._open_host())
        self._opened = True
        await asyncio.gather(*opens)

    async def _loop_source(self, src: _Source) -> None:
        assert src.wake is not None
        next_t = self.now()
        while not self._stopping:
            try:
                await src.poll(self.now())
            except asyncio.CancelledError:
                raise
            except Exception as e:  # keep polling: one bad poll must not end a source
                self.core.event(self.now(), "error", "source_error", f"{src.name}: {e}")
            # fixed cadence: a slow poll shortens the wait instead of drifting the schedule
            next_t += self.interval_s
            delay = next_t - self.now()
            if delay < 0:
                next_t = self.now()
                delay = 0.0
            try:
                await asyncio.wait_for(src.wake.wait(), delay)
                next_t = self.now()
            except asyncio.TimeoutError:
                pass
            src.wake.clear()

    def _wake_all(self) -> None:
        for src in self._sources:
            if src.wake is not None:
                src.wake.set()

    # -- control ------------------------------------------------------------------------------
    def refresh_now(self) -> None:
        """Poll every source right away (safe from any thread)."""
        loop = self._loop
        if loop is None:
            return

        wake = self._wake_all
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            wake()
        else:
            loop.call_soon_threadsafe(wake)

    def controls(self) -> None:
        """A live run has no trace clock to move."""
        return None

    async def poll_all(self) -> None:
        """Poll every source once, concurrently (used for a final sample at the end of a window)."""
        await self._setup()
        t = self.now()
        await asyncio.gather(*(src.poll(t) for src in self._sources), return_exceptions=True)

    async def run(
        self,
        duration_s: float | None = None,
        stop: asyncio.Event | None = None,
        final_poll: bool = False,
    ) -> None:
        """Poll until ``duration_s`` has passed (from now) or ``stop`` is set; then close the sources.

        ``final_poll`` takes one more sample of every source after the loops stop, so a headless
        report's window ends at the duration rather than up to one interval before it.
        """
        await self._setup()
        self._stopping = False
        tasks = [asyncio.create_task(self._loop_source(src), name=f"kvtop {src.name}") for src in self._sources]
        waiters: list[asyncio.Task[Any]] = []
        probe_stop = asyncio.Event()
        probe_task = None
        if self.probe_rate and self.scrapers:
            from kvtop.sources.probe import Probe

            probe = Probe(self.scrapers[0].base_url, self.probe_rate, self.emit, self.now,
                          max_tokens=self.probe_max_tokens)
            probe_task = asyncio.create_task(probe.run(probe_stop), name="kvtop probe")
        capture_task = None
        if self.capture_port is not None and self.capture is None:
            from kvtop.sources.capture import CaptureSource, CaptureUnavailable

            port = self.capture_port

            def show(st: Any) -> None:
                self.core.capture = {"port": port, "status": "ok", **dataclasses.asdict(st)}

            cap = CaptureSource(port, self._owners.sink("capture"), self.now, on_check=show,
                                notice=lambda msg: self.core.event(self.now(), "warning", "capture", msg))
            try:
                cap.open()
            except CaptureUnavailable as e:
                self.core.capture = {"port": port, "status": str(e)}
                self.core.event(self.now(), "warning", "capture", str(e))
            else:
                show(cap.stats)
                self.capture = cap
                capture_task = asyncio.create_task(cap.run(probe_stop), name="kvtop capture")
        try:
            if stop is not None:
                waiters.append(asyncio.create_task(stop.wait()))
            if duration_s is not None:
                waiters.append(asyncio.create_task(asyncio.sleep(max(0.0, duration_s))))
            if waiters:
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            else:
                await asyncio.gather(*tasks)
        finally:
            for w in waiters:
                w.cancel()
            if probe_task is not None:
                probe_stop.set()
                await asyncio.wait([probe_task], timeout=self.timeout_s + 2.0)
                probe_task.cancel()
            if capture_task is not None:
                probe_stop.set()
                await asyncio.wait([capture_task], timeout=2.0)
                self.capture = None
            # Let in-flight polls finish (each is bounded by its timeout) rather than cancel them:
            # a cancelled httpx request can wedge in httpcore's connection clean-up. Waiting
            # sources stop at once; only a poll stuck past its timeout is cancelled.
            self._stopping = True
            self._wake_all()
            _, stuck = await asyncio.wait(tasks, timeout=self.timeout_s + 2.0) if tasks else (set(), set())
            for task in stuck:
                task.cancel()
            await asyncio.gather(*waiters, return_exceptions=True)
        try:
            if final_poll:
                await self.poll_all()
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        await asyncio.gather(*(s.aclose() for s in self.scrapers), return_exceptions=True)
        gpu, self._gpu = self._gpu, None
        if gpu is not None and hasattr(gpu, "close"):

            def close() -> None:
                with self._gpu_lock:
                    gpu.close()

            try:
                await asyncio.to_thread(close)
            except Exception:
                pass
        self._host = None
        self._opened = False  # a later run() opens them again
