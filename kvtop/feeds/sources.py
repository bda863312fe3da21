"""The one ``Source`` protocol every live source satisfies, and one implementation per source.

A source is started with a ``SourceContext`` (the run's clock, the record path into the core and
its sinks, the core's status lines), then either *polled* (``polled = True``: engine scrape, GPU,
host, Prometheus; the feed calls ``poll(t)`` on its cadence) or left to *push* records on its own
until ``stop`` (probe canaries, passive capture, the recording proxy). ``kvtop.pipeline`` builds the
list a run watches; the feeds (``kvtop.feeds.live.LiveRunner``, ``kvtop.feeds.prometheus.PromFeed``)
only run it. The I/O itself stays in ``kvtop.sources``; what is here is how each reader's records,
failures and statuses reach a Core, which is why it lives with the feeds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from kvtop.core import Core
from kvtop.model.records import GpuRecord, HostRecord, Record, RequestRecord
from kvtop.sources.gpu import GpuSource  # NVML itself loads when a GpuSource is made
from kvtop.sources.host import HostSource
from kvtop.sources.promapi import PromError
from kvtop.sources.scrape import EngineScraper
from kvtop.sources.witness import WitnessError, WitnessReader

if TYPE_CHECKING:
    from kvtop.sources.capture.http import CaptureStats
    from kvtop.sources.capture.source import CaptureSource
    from kvtop.sources.promfleet import PromFleet
    from kvtop.sources.proxy import ProxyPool, RecordingProxy

Emit = Callable[[Record], None]
Clock = Callable[[], float]


@dataclasses.dataclass(frozen=True)
class SourceContext:
    """What a started source may use: the core (status lines, events), the record path, the clock."""

    core: Core
    emit: Emit  # into the core and every sink, on the event loop's thread
    now: Clock  # the run clock every source of the run shares
    engine_pids: Callable[[], set[int]] = set  # local engine processes (GPU/host attribution)


class Source(Protocol):
    """One live source of records."""

    name: str  # for its task and its error events ("engine http://…", "gpu", "probe")
    polled: bool  # True: the feed calls poll(t) every interval; False: it pushes between start and stop

    async def start(self, ctx: SourceContext) -> None:
        """Open (a source that cannot open says so on the core and stays quiet; only a bind failure
        of the proxy raises ``OSError``, which a command turns into its one-line error)."""

    async def poll(self, t: float) -> None:
        """One sample into ``ctx.emit`` (pushing sources: nothing)."""

    async def stop(self) -> None:
        """Close; a later ``start`` opens it again."""


class _Pushing:
    """Base of the sources that push records themselves: nothing to poll."""

    polled = False

    async def poll(self, t: float) -> None:
        return None


# -- polled ------------------------------------------------------------------------------------

class EngineScrape:
    """One engine's /metrics through its adapter; names the engine's preemption semantics once known."""

    polled = True

    def __init__(self, scraper: EngineScraper):
        self.scraper = scraper
        self.name = f"engine {scraper.shown_url}"
        self._ctx: SourceContext | None = None
        self._told = False

    async def start(self, ctx: SourceContext) -> None:
        self._ctx = ctx

    async def poll(self, t: float) -> None:
        ctx = self._ctx
        assert ctx is not None, "poll before start"
        for rec in await self.scraper.scrape(t):
            ctx.emit(rec)
        if not self._told and self.scraper.adapter_cls is not None:
            self._told = True
            ctx.core.set_engine_capabilities(self.scraper.url, bool(self.scraper.adapter_cls.preempts))

    async def stop(self) -> None:
        await self.scraper.aclose()


class GpuPoll:
    """NVML readings (blocking: opened and read in a worker thread); the core's GPU status follows."""

    name = "gpu"
    polled = True

    def __init__(self) -> None:
        self._gpu: GpuSource | None = None
        self._lock = threading.Lock()
        self._ctx: SourceContext | None = None
        self.status = "ok"

    def _set_status(self, status: str) -> None:
        self.status = status
        if self._ctx is not None:
            self._ctx.core.set_gpu_status(status)

    async def start(self, ctx: SourceContext) -> None:
        self._ctx = ctx
        if self._gpu is not None:
            return
        try:
            self._gpu = await asyncio.to_thread(GpuSource, engine_pids=ctx.engine_pids)
        except Exception as e:
            self._set_status(f"GPU source failed to start: {e}")
            return
        self._set_status(str(self._gpu.status))

    async def poll(self, t: float) -> None:
        gpu, ctx = self._gpu, self._ctx
        if gpu is None or ctx is None:
            return

        def poll() -> list[GpuRecord]:
            with self._lock:
                # stamped when read, not when asked: a poll that waited behind a slow one (a hung
                # driver call) would otherwise divide the counters' bytes by the wrong interval
                return list(gpu.poll(ctx.now()))

        try:
            recs = await asyncio.to_thread(poll)
        except Exception as e:
            self._set_status(f"GPU poll failed: {e}")
            return
        for rec in recs:
            ctx.emit(rec)
        if gpu.status != self.status:
            self._set_status(str(gpu.status))

    async def stop(self) -> None:
        gpu, self._gpu = self._gpu, None
        if gpu is None:
            return

        def close() -> None:
            with self._lock:
                gpu.close()

        try:
            await asyncio.to_thread(close)
        except Exception:
            pass


class HostPoll:
    """/proc and cgroup readings (blocking: read in a worker thread)."""

    name = "host"
    polled = True

    def __init__(self) -> None:
        self._host: HostSource | None = None
        self._lock = threading.Lock()
        self._ctx: SourceContext | None = None

    async def start(self, ctx: SourceContext) -> None:
        self._ctx = ctx
        if self._host is not None:
            return
        try:
            self._host = await asyncio.to_thread(HostSource, engine_pids=ctx.engine_pids)
        except Exception as e:
            ctx.core.event(ctx.now(), "warning", "source_error", f"host source failed to start: {e}")

    async def poll(self, t: float) -> None:
        host, ctx = self._host, self._ctx
        if host is None or ctx is None:
            return

        def poll() -> HostRecord:
            with self._lock:
                return host.poll(t)

        try:
            rec = await asyncio.to_thread(poll)
        except Exception as e:
            ctx.core.event(t, "warning", "source_error", f"host poll failed: {e}")
            return
        ctx.emit(rec)

    async def stop(self) -> None:
        self._host = None


class PrometheusPoll:
    """Every engine instance a Prometheus server scrapes, read back as engine records (blocking HTTP:
    each poll runs in a worker thread); a failed poll marks every known instance down."""

    name = "prometheus"
    polled = True

    def __init__(self, fleet: PromFleet):
        self.fleet = fleet
        self._ctx: SourceContext | None = None
        self.polls = 0

    def attach(self, ctx: SourceContext) -> None:
        """Bind to a run without starting anything (``poll_blocking`` needs no event loop)."""
        self._ctx = ctx

    async def start(self, ctx: SourceContext) -> None:
        self.attach(ctx)

    def _ingest(self, ctx: SourceContext, recs: list[Record]) -> None:
        self.fleet.error = None
        for r in recs:
            ctx.emit(r)
        self.polls += 1

    def failed(self, why: str) -> None:
        ctx = self._ctx
        assert ctx is not None, "poll before start"
        if why != self.fleet.error:
            ctx.core.event(ctx.now(), "error", "source_error", f"Prometheus: {why}")
        self.fleet.error = why
        for tg in self.fleet.targets.values():
            ctx.core.engine_down(tg.url, ctx.now(), why, tg.adapter)

    def poll_blocking(self) -> bool:
        """One poll on this thread (``kvtop snapshot --prometheus`` and tests); whether it answered."""
        ctx = self._ctx
        assert ctx is not None, "poll before start"
        try:
            recs = self.fleet.poll()
        except PromError as e:
            self.failed(str(e))
            return False
        except Exception as e:  # an answer this code did not expect: one line, never a traceback
            self.failed(f"poll failed: {str(e).splitlines()[0][:160] if str(e) else type(e).__name__}")
            return False
        self._ingest(ctx, list(recs))
        return True

    async def poll(self, t: float) -> None:
        ctx = self._ctx
        assert ctx is not None, "poll before start"
        try:
            recs = await asyncio.to_thread(self.fleet.poll)
        except PromError as e:
            self.failed(str(e))
        except Exception as e:  # an odd answer must not end the feed
            self.failed(f"poll failed: {e}")
        else:
            self._ingest(ctx, list(recs))

    async def stop(self) -> None:
        self.fleet.client.close()


class WitnessTail:
    """An engine's witness file (``kvtop.witness``), read as it grows: its steps join the run as
    ``step`` records on the run's clock. A file that is not there yet is waited for; one that is not a
    witness file stops this source with one line on the core, never the run."""

    polled = True

    def __init__(self, path: str, engine_url: str | None):
        self.path = path
        self.engine_url = engine_url
        self.name = f"witness {path}"
        self._ctx: SourceContext | None = None
        self._reader: WitnessReader | None = None
        self._failed = False

    async def start(self, ctx: SourceContext) -> None:
        self._ctx = ctx
        if self._reader is None:
            # the engine writes wall-clock seconds; the run's clock starts at now() == 0
            self._reader = WitnessReader(self.path, time.time() - ctx.now(), self.engine_url)

    async def poll(self, t: float) -> None:
        ctx, reader = self._ctx, self._reader
        if ctx is None or reader is None or self._failed:
            return
        # the engine's wall-clock times to the run's monotonic clock, at the offset of now: one taken
        # at start would shift every later step by a wall-clock step or slew during a long run
        reader.wall_zero = time.time() - ctx.now()
        try:
            recs = await asyncio.to_thread(reader.read)
        except (WitnessError, OSError) as e:
            self._failed = True
            ctx.core.event(ctx.now(), "error", "source_error", f"witness: {e}")
            return
        for rec in recs:
            ctx.emit(rec)

    async def stop(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.close()


# -- pushing -----------------------------------------------------------------------------------

class ProbeStreams(_Pushing):
    """kvtop's own canary streams against one engine (``--probe RATE``)."""

    name = "probe"

    def __init__(self, base_url: str, rate_per_s: float, max_tokens: int = 32, stop_timeout_s: float = 4.0):
        self.base_url = base_url
        self.rate_per_s = rate_per_s
        self.max_tokens = max_tokens
        self.stop_timeout_s = stop_timeout_s  # an in-flight stream gets this long to finish
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self, ctx: SourceContext) -> None:
        from kvtop.sources.probe import Probe  # aiohttp's client: only for a run that probes

        probe = Probe(self.base_url, self.rate_per_s, ctx.emit, ctx.now, max_tokens=self.max_tokens)
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(probe.run(self._stop), name="kvtop probe")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        self._stop.set()
        await asyncio.wait([task], timeout=self.stop_timeout_s)
        task.cancel()


class PassiveCapture(_Pushing):
    """The engine's own port observed passively (``--capture``); the core's capture line says how it
    goes, or why it cannot (no privilege), and the run carries on without it."""

    name = "capture"

    def __init__(self, port: int):
        self.port = port
        self.capture: CaptureSource | None = None
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self, ctx: SourceContext) -> None:
        if self.capture is not None:
            return
        # the packet socket and the HTTP parser load only for a run that captures
        from kvtop.sources.capture.packets import CaptureUnavailable
        from kvtop.sources.capture.source import CaptureSource

        port = self.port

        def show(st: CaptureStats) -> None:
            ctx.core.capture = {"port": port, "status": "ok", **dataclasses.asdict(st)}

        cap = CaptureSource(port, ctx.emit, ctx.now, on_check=show,
                            notice=lambda msg: ctx.core.event(ctx.now(), "warning", "capture", msg))
        try:
            cap.open()
        except CaptureUnavailable as e:
            ctx.core.capture = {"port": port, "status": str(e)}
            ctx.core.event(ctx.now(), "warning", "capture", str(e))
            return
        show(cap.stats)
        self.capture = cap
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(cap.run(self._stop), name="kvtop capture")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            self._stop.set()
            await asyncio.wait([task], timeout=2.0)
        self.capture = None


class ProxyRecorder(_Pushing):
    """The recording reverse proxy in front of one engine: each request's token timeline.

    ``start`` raises ``OSError`` when it cannot listen (the commands say so in one line)."""

    name = "proxy"

    def __init__(self, upstream: str, host: str = "127.0.0.1", port: int = 0, workers: int = 1,
                 cls: str | None = None, loop: str = "asyncio"):
        self.upstream = upstream
        self.host = host
        self.port = port
        self.workers = workers
        self.cls = cls
        self.loop = loop
        self.proxy: RecordingProxy | ProxyPool | None = None
        self._seen_stopped = 0  # requests recorded by the proxy stopped last

    @property
    def url(self) -> str | None:
        return self.proxy.url if self.proxy is not None else None

    @property
    def requests_seen(self) -> int:
        return self.proxy.requests_seen if self.proxy is not None else self._seen_stopped

    async def start(self, ctx: SourceContext) -> None:
        await self.open(ctx.emit, ctx.now)

    async def open(self, emit: Callable[[RequestRecord], None], now: Clock) -> None:
        """Listen, recording through ``emit`` on clock ``now``: ``start`` without a Core (``kvtop proxy``)."""
        if self.proxy is not None:
            return
        from kvtop.sources.proxy import make_proxy  # aiohttp's server: only for a run that proxies

        proxy = make_proxy(self.upstream, emit, now, host=self.host, port=self.port, cls=self.cls,
                           workers=self.workers, loop=self.loop)
        await proxy.start()
        self.proxy = proxy

    async def stop(self) -> None:
        # in-flight streams are cut off now and recorded as cancelled (proxy_stopped)
        proxy, self.proxy = self.proxy, None
        if proxy is not None:
            await proxy.stop()
            self._seen_stopped = proxy.requests_seen
