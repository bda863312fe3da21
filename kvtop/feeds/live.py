"""The live runner: runs a run's sources, each polled on its own schedule, into the core (docs/design.md §1).

The sources come from ``kvtop.pipeline`` (the ``kvtop.feeds.sources.Source`` protocol). Each polled
source (every engine URL, the GPU, the host) runs as its own self-rescheduling asyncio task, so a
slow or dead engine delays nothing else; blocking reads (NVML, /proc) run in worker threads and
their records are ingested back on the event loop, so the core is only ever touched from one
thread. Pushing sources (probe, capture, proxy) run from ``start`` until the run ends.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvtop.core import Core
from kvtop.feeds.sources import Emit, EngineScrape, Source, SourceContext
from kvtop.model.records import Record
from kvtop.sources.scrape import EngineScraper

if TYPE_CHECKING:
    from kvtop.sources.capture.source import RequestOwners

Sink = Callable[[Record], None]


class _Loop:
    """One polled source's schedule: its wake-up event for ``refresh_now``."""

    __slots__ = ("source", "wake")

    def __init__(self, source: Source):
        self.source = source
        self.wake: asyncio.Event | None = None


class LiveRunner:
    """The feed of a live run (``kvtop.pipeline.live_feed`` builds it): its sources into one core."""

    is_fleet = False

    def __init__(
        self,
        core: Core,
        sources: Sequence[Source] = (),
        interval_s: float = 1.0,
        sinks: list[Sink] | None = None,
        timeout_s: float = 2.0,
        one_owner_per_request: bool = False,
        engine_pids: Callable[[], set[int]] | None = None,
    ):
        """``one_owner_per_request``: a request two sources observe (passive capture and the proxy
        or probe) is recorded once, by the first to see it arrive."""
        self.core = core
        self.sources = list(sources)
        self.interval_s = max(0.05, float(interval_s))
        self.notice: str | None = None
        self.sinks: list[Sink] = list(sinks or [])
        self.timeout_s = timeout_s
        self.t0 = time.monotonic()  # the run clock's origin (a feed that swaps runners carries it over)
        self._owners: RequestOwners | None = None
        self._other_emit: Emit | None = None
        if one_owner_per_request:
            # the capture machinery (its package loads the packet parsers) only for a run that captures
            from kvtop.sources.capture.source import RequestOwners

            self._owners = RequestOwners(self._ingest)
            self._other_emit = self._owners.sink("other")
        self._engine_pids = engine_pids or set
        self._loops = [_Loop(s) for s in self.sources if s.polled]
        self._loop: asyncio.AbstractEventLoop | None = None
        self.sink_failed = False
        self._opened = False  # polled sources started
        self._pushing = False  # pushing sources started
        self._stopping = False

    @property
    def scrapers(self) -> list[EngineScraper]:
        """The engine scrapers, in URL order."""
        return [s.scraper for s in self.sources if isinstance(s, EngineScrape)]

    def source(self, name: str) -> Source | None:
        """The source called ``name`` ("proxy", "capture", "gpu", ...), if the run has one."""
        return next((s for s in self.sources if s.name == name), None)

    # -- clock and ingest ---------------------------------------------------------------------
    def now(self) -> float:
        """Run clock: monotonic seconds since this runner was created (every source shares it)."""
        return time.monotonic() - self.t0

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
                if not self.sink_failed:
                    self.sink_failed = True
                    self.core.event(rec.t, "error", "source_error", f"record sink failed: {e}")

    def _context(self, src: Source) -> SourceContext:
        emit: Emit = self.emit
        if self._owners is not None and not src.polled:
            emit = self._owners.sink(src.name)
        return SourceContext(core=self.core, emit=emit, now=self.now, engine_pids=self._engine_pids)

    # -- sources ------------------------------------------------------------------------------
    async def _open(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # first run, or a new event loop: events bind to their loop
            self._loop = loop
            for lp in self._loops:
                lp.wake = asyncio.Event()
        if not self._opened:
            self._opened = True
            await asyncio.gather(*(lp.source.start(self._context(lp.source)) for lp in self._loops))

    async def start(self) -> None:
        """Open every source: the polled ones, then the pushing ones (probe, capture, proxy).

        ``run`` starts what is not started yet; a command calls this first to say what it watches.
        Raises ``OSError`` when the proxy cannot listen, having stopped the pushing sources it
        started (the polled ones stay open: ``aclose`` closes them)."""
        await self._open()
        if self._pushing:
            return
        started: list[Source] = []
        try:
            for src in self.sources:
                if not src.polled:
                    await src.start(self._context(src))
                    started.append(src)
        except BaseException:
            for src in reversed(started):
                await src.stop()
            raise
        self._pushing = True

    async def _stop_pushing(self) -> None:
        if self._pushing:
            self._pushing = False
            for src in self.sources:
                if not src.polled:
                    await src.stop()

    async def _loop_source(self, lp: _Loop) -> None:
        assert lp.wake is not None
        src = lp.source
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
                await asyncio.wait_for(lp.wake.wait(), delay)
                next_t = self.now()
            except asyncio.TimeoutError:
                pass
            lp.wake.clear()

    def _wake_all(self) -> None:
        for lp in self._loops:
            if lp.wake is not None:
                lp.wake.set()

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
        """Poll every polled source once, concurrently (a final sample at the end of a window)."""
        await self._open()
        t = self.now()
        await asyncio.gather(*(lp.source.poll(t) for lp in self._loops), return_exceptions=True)

    async def run(
        self,
        duration_s: float | None = None,
        stop: asyncio.Event | None = None,
        final_poll: bool = False,
    ) -> None:
        """Poll until ``duration_s`` has passed (from now) or ``stop`` is set; then close the sources.

        ``final_poll`` takes one more sample of every polled source after the loops stop, so a
        headless report's window ends at the duration rather than up to one interval before it.
        """
        await self._open()
        self._stopping = False
        tasks = [asyncio.create_task(self._loop_source(lp), name=f"kvtop {lp.source.name}") for lp in self._loops]
        waiters: list[asyncio.Task[object]] = []
        start_failed = True
        try:
            await self.start()
            start_failed = False
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
            await self._stop_pushing()
            # Let in-flight polls finish (each is bounded by its timeout) rather than cancel them:
            # a cancelled httpx request can wedge in httpcore's connection clean-up. Waiting
            # sources stop at once; only a poll stuck past its timeout is cancelled.
            self._stopping = True
            self._wake_all()
            _, stuck = await asyncio.wait(tasks, timeout=self.timeout_s + 2.0) if tasks else (set(), set())
            for task in stuck:
                task.cancel()
            await asyncio.gather(*waiters, return_exceptions=True)
            if start_failed:  # the proxy could not listen: the caller gets the OSError, nothing left open
                await self.aclose()
        try:
            if final_poll:
                await self.poll_all()
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """Close every source; a later ``run`` opens them again."""
        await self._stop_pushing()
        await asyncio.gather(*(lp.source.stop() for lp in self._loops), return_exceptions=True)
        self._opened = False
