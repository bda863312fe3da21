"""The one place that wires a run: a Core, its live analysis, its sources and the feed that runs them.

Every command that watches something (snapshot, record, agent, proxy, the console, replay, demo)
asks this module for a feed (or, for ``kvtop proxy``, its one source) instead of building Core +
sources + analysis by hand, so a live run, a replay and the demo analyse the same way, and a new
source (``kvtop.feeds.sources.Source``) is added to a run here and nowhere else. Headless: nothing
here imports Textual.

A *feed* is what the console consumes: it owns ``core`` (which a replay seek may replace), runs on
the caller's event loop until ``stop`` is set, and can be asked to poll now. A replay feed also
offers ``controls()`` (pause, step, seek on the trace clock); a live feed returns None there. A
fleet feed (``is_fleet``: Prometheus) opens the console on its fleet screen.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

from kvtop.core import Core
from kvtop.core.core import GPU_NOT_RECORDED
from kvtop.snapshot import SnapshotSource

# Every command's parser imports this module (for SourceOptions): the feeds, the sources and the
# analysis (httpx, numpy, the adapters) load inside the function that wires them, so `kvtop --help`
# and a replay never pay for a live run's imports.
if TYPE_CHECKING:
    from kvtop.feeds.demo import DemoFeed
    from kvtop.feeds.live import LiveRunner, Sink
    from kvtop.feeds.probing import ProbingFeed
    from kvtop.feeds.prometheus import PromFeed
    from kvtop.feeds.replay import ReplayFeed  # see the note on imports above
    from kvtop.feeds.sources import ProxyRecorder, Source
    from kvtop.sim.workload import Workload
    from kvtop.sources.promapi import PromAuth


DEFAULT_INTERVAL_S = 1.0
DEFAULT_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class SourceOptions:
    """What a live run watches and how, after every range check."""

    urls: tuple[str, ...] = ()
    interval_s: float = DEFAULT_INTERVAL_S
    timeout_s: float = DEFAULT_TIMEOUT_S
    token: str | None = None
    adapter: str | None = None
    gpu: bool = True
    host: bool = True
    probe_rate: float | None = None
    itl_target_s: float | None = None
    capture_port: int | None = None  # --capture: the engine port observed passively (0: the first engine's)
    proxy_listen: tuple[str, int] | None = None  # --proxy-listen: the recording proxy, before the first URL
    proxy_workers: int = 1
    witness: str | None = None  # --witness: the first engine's step log (kvtop.witness)


class ReplayControls(Protocol):
    """The trace clock of a seekable feed."""

    t: float
    duration: float

    @property
    def paused(self) -> bool: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def step(self, n_seconds: float) -> int: ...

    def seek(self, t: float) -> int: ...

    def warning(self) -> str | None:
        """What of the trace could not be read so far (malformed lines, a cut file), None if nothing."""
        ...


class Feed(Protocol):
    """What the console (and every headless runner) drives."""

    interval_s: float  # how often its sources poll; the console's +/- keys set it
    notice: str | None  # a one-line banner the console shows while it stands (e.g. "no engine yet")

    @property
    def is_fleet(self) -> bool:
        """Whether it watches a fleet (many engine instances through Prometheus): the console
        opens on its fleet screen."""

    @property
    def core(self) -> SnapshotSource:
        """What it fills: a front end reads it through the Snapshot only (the runners that wire a
        Core keep their own reference to it)."""
        ...

    async def run(self, *, stop: asyncio.Event | None = None) -> None: ...

    def refresh_now(self) -> None: ...

    def controls(self) -> ReplayControls | None: ...


class HeaderAnalysis(TypedDict, total=False):
    """What a trace header tells the analysis (``replay_feed``), each key only when the header has it."""

    adapter: str
    model: str
    kv_bytes_per_token: float
    itl_target_s: float
    interval_s: float  # the scrape period it was recorded with


def make_core(label: str, itl_target_s: float | None = None, window_s: float = 60.0, analysis: bool = True,
              adapter: str | None = None, model: str | None = None,
              kv_bytes_per_token: float | None = None, interval_s: float | None = None,
              gpu_status: str = "ok", header: dict[str, Any] | None = None) -> Core:
    """A Core with the live analysis attached (spikes, causes, verdict) unless ``analysis`` is False;
    ``adapter``, ``model`` and ``kv_bytes_per_token`` tell the cost model what is known of the engine;
    ``interval_s`` how often its engines are scraped; ``header``: a replayed trace's header, read by
    the analysis as ``kvtop analyze`` reads it (the engine's current limits among it)."""
    live = None
    if analysis:
        from kvtop.analysis.analyzer import header_itl_target  # see the note on imports above
        from kvtop.analysis.live import LiveAnalyzer

        # the header's own target is the header's (its source says so, as analyze's does)
        own = header is not None and itl_target_s is not None and itl_target_s == header_itl_target(header)
        live = LiveAnalyzer(itl_target_s=None if own else itl_target_s, adapter=adapter, model=model,
                            kv_bytes_per_token=kv_bytes_per_token, interval_s=interval_s, header=header)
    return Core(window_s=window_s, itl_target_s=itl_target_s, source_label=label, analysis=live, gpu_status=gpu_status)


def live_sources(opts: SourceOptions, probe_max_tokens: int = 32) -> list[Source]:
    """What a live run watches, in the order the runner starts them: every engine URL, the GPU, the
    host, then the request observers (probe canaries, passive capture, the recording proxy)."""
    from kvtop.feeds.sources import (  # see the note on imports above
        EngineScrape,
        GpuPoll,
        HostPoll,
        PassiveCapture,
        ProbeStreams,
        ProxyRecorder,
        WitnessTail,
    )
    from kvtop.sources.capture.options import resolve_capture_port
    from kvtop.sources.scrape import EngineScraper

    scrapers = [EngineScraper(u, adapter=opts.adapter, token=opts.token, timeout_s=opts.timeout_s)
                for u in opts.urls]
    sources: list[Source] = [EngineScrape(s) for s in scrapers]
    if opts.gpu:
        sources.append(GpuPoll())
    if opts.host:
        sources.append(HostPoll())
    if opts.probe_rate and scrapers:
        # an in-flight canary gets the scrape timeout and a little more to finish at the end
        sources.append(ProbeStreams(scrapers[0].base_url, opts.probe_rate, max_tokens=probe_max_tokens,
                                    stop_timeout_s=opts.timeout_s + 2.0))
    capture = opts.capture_port
    if capture == 0 and opts.urls:  # --capture without a port: the (discovered) engine's
        capture = resolve_capture_port(0, scrapers[0].base_url)
    if capture:
        sources.append(PassiveCapture(capture))
    if opts.witness is not None:
        sources.append(WitnessTail(opts.witness, scrapers[0].base_url if scrapers else None))
    if opts.proxy_listen is not None and scrapers:
        host, port = opts.proxy_listen
        sources.append(ProxyRecorder(scrapers[0].base_url, host=host, port=port, workers=opts.proxy_workers))
    return sources


def live_feed(opts: SourceOptions, label: str = "live", window_s: float = 60.0, analysis: bool = True,
              sinks: list[Sink] | None = None, core: Core | None = None, probe_max_tokens: int = 32) -> LiveRunner:
    """Engines, GPU, host (and --probe canaries, --capture, --proxy-listen) polled into an analysed
    Core (a fresh one unless ``core`` is given)."""
    from kvtop.feeds.live import LiveRunner  # see the note on imports above
    from kvtop.feeds.sources import PassiveCapture

    if core is None:
        core = make_core(label, opts.itl_target_s, window_s=window_s, analysis=analysis, interval_s=opts.interval_s)
    sources = live_sources(opts, probe_max_tokens)
    runner = LiveRunner(core, sources, interval_s=opts.interval_s, sinks=sinks, timeout_s=opts.timeout_s,
                        one_owner_per_request=any(isinstance(s, PassiveCapture) for s in sources),
                        engine_pids=_engine_pids(opts.urls))
    # every scraper stamps its records on the run's clock, when the response arrived
    for scraper in runner.scrapers:
        scraper.clock = runner.now
    if not opts.gpu:
        core.set_gpu_status("disabled (--no-gpu)")
    if not opts.host:
        core.host_status = "off (--no-host)"
    return runner


def _engine_pids(urls: tuple[str, ...]) -> Callable[[], set[int]]:
    """PIDs of the local engines behind ``urls`` (found on first use, cached; empty for remote ones)."""
    found: list[Callable[[], set[int]]] = []

    def pids() -> set[int]:
        if not found:
            try:
                # psutil loads only when a GPU or host source first asks (not for replay or analyze)
                from kvtop.sources.procs import EnginePids
            except ImportError:
                return set()
            found.append(EnginePids(list(urls)))
        return found[0]()

    return pids


def probing_feed(opts: SourceOptions, ports: tuple[int, ...]) -> ProbingFeed:
    """The console's feed when no engine answers yet: GPU and host now, the engines ``ports`` will
    answer on once they do, all into one analysed Core."""
    from kvtop.feeds.probing import ProbingFeed  # see the note on imports above

    core = make_core("live", opts.itl_target_s)

    def make_runner(urls: list[str]) -> LiveRunner:
        return live_feed(dataclasses.replace(opts, urls=tuple(urls)), label="live", core=core)

    return ProbingFeed(make_runner, ports)


def recording_proxy(upstream: str, listen: tuple[str, int], workers: int = 1, cls: str | None = None,
                    loop: str = "asyncio") -> ProxyRecorder:
    """``kvtop proxy``: the recording proxy alone, a source the command starts with its own
    ``SourceContext`` (records to a trace file and stderr, no Core to fill)."""
    from kvtop.feeds.sources import ProxyRecorder  # see the note on imports above

    host, port = listen
    return ProxyRecorder(upstream, host=host, port=port, workers=workers, cls=cls, loop=loop)


def replay_feed(path: str | os.PathLike[str], speed: float = 0.0, itl_target_s: float | None = None,
                label: str | None = None) -> ReplayFeed:
    """A trace fed through an analysed Core; a backward seek starts over on a fresh one.

    The analysis takes what the trace header knows (adapter, model, KV bytes per token, the ITL
    target it was recorded against) the way ``kvtop analyze`` does; ``itl_target_s`` overrides.
    Raises TraceError / OSError for a missing or non-trace file.
    """
    from kvtop.feeds.replay import ReplayFeed  # see the note on imports above

    label = label or f"replay {Path(path).name}"
    # opening the feed reads the header; its core is replaced before a record is fed
    feed = ReplayFeed(path, Core(source_label=label), speed=speed)
    known = _analysis_from_header(feed.header)
    target = itl_target_s if itl_target_s is not None else known.get("itl_target_s")

    def factory() -> Core:
        return make_core(label, target, adapter=known.get("adapter"), model=known.get("model"),
                         kv_bytes_per_token=known.get("kv_bytes_per_token"), interval_s=known.get("interval_s"),
                         gpu_status=GPU_NOT_RECORDED, header=feed.header)

    feed.core = factory()
    feed.core_factory = factory
    return feed


def _analysis_from_header(header: dict[str, Any]) -> HeaderAnalysis:
    out = HeaderAnalysis()
    engine = header.get("engine")
    if isinstance(engine, dict):
        if isinstance(engine.get("adapter"), str):
            out["adapter"] = engine["adapter"]
        if isinstance(engine.get("model"), str):
            out["model"] = engine["model"]
    kv = header.get("kv")
    if isinstance(kv, dict):
        bpt = kv.get("bytes_per_token")
        if isinstance(bpt, (int, float)) and not isinstance(bpt, bool) and bpt > 0:
            out["kv_bytes_per_token"] = float(bpt)
    from kvtop.analysis.analyzer import header_interval, header_itl_target  # see the note on imports above

    target = header_itl_target(header)
    if target is not None:
        out["itl_target_s"] = target
    iv = header_interval(header)
    if iv is not None:
        out["interval_s"] = iv
    return out


def demo_feed(workload: Workload, seed: int = 1, speed: float = 1.0, interval_s: float = 1.0,
              window_s: float = 60.0, core: Core | None = None) -> DemoFeed:
    """The simulated engine + its load generator, watched by a live runner into an analysed Core
    (a fresh one unless ``core`` is given).

    The simulated engine's KV geometry is known, so the cost model gets bytes per token without a
    model config."""
    from kvtop.feeds.demo import DemoFeed  # see the note on imports above

    e = workload.engine
    if core is None:
        core = make_core(f"demo {workload.name}", e.itl_target_s, window_s=window_s, adapter="vllm",
                         model=e.model, kv_bytes_per_token=e.bytes_per_token)
    watched = core

    def make_runner(url: str, interval_s: float) -> LiveRunner:
        # No GPU behind a simulated engine (its row would describe this machine's GPUs, not the
        # demo's); the host row is this machine's memory, real and useful as a live example.
        return live_feed(SourceOptions(urls=(url,), interval_s=interval_s, gpu=False, host=True), core=watched)

    return DemoFeed(core, workload, make_runner, seed=seed, speed=speed, interval_s=interval_s)


async def run_for(feed: Feed, until: Callable[[], bool]) -> None:
    """Run ``feed`` headless until it ends or ``until()`` holds."""
    stop = asyncio.Event()
    task = asyncio.create_task(feed.run(stop=stop))
    try:
        while not task.done() and not until():
            await asyncio.wait([task], timeout=0.05)
    finally:
        stop.set()
        await task


def prometheus_feed(url: str, selector: str | None = None, itl_target_s: float | None = None,
                    window_s: float = 120.0, interval_s: float = 5.0, step_s: float | None = None,
                    timeout_s: float = 5.0, token: str | None = None, core_window_s: float | None = None,
                    auth: PromAuth | None = None) -> PromFeed:
    """Every engine instance a Prometheus server scrapes, read back into an analysed Core
    (`--prometheus URL`); the engines' history over ``window_s`` is there from the first poll, and
    rates and quantiles cover ``core_window_s`` (default: the whole window)."""
    from kvtop.feeds.prometheus import PromFeed  # see the note on imports above

    core = make_core(f"prometheus {url}", itl_target_s, window_s=core_window_s or window_s)
    core.gpu_status = "not read (engines come from Prometheus)"
    return PromFeed(core, url, selector=selector, interval_s=interval_s, timeout_s=timeout_s, window_s=window_s,
                    step_s=step_s, token=token, auth=auth)
