"""The one place that wires a run: a Core, its live analysis and the feed that fills it.

Every command that watches something (snapshot, record, the console, replay, demo) asks this module
for a feed instead of building Core + sources + analysis by hand, so a live run, a replay and the
demo analyse the same way. Headless: nothing here imports Textual.

A *feed* is what the console consumes: it owns ``core`` (which a replay seek may replace), runs on
the caller's event loop until ``stop`` is set, and can be asked to poll now. A replay feed also
offers ``controls()`` (pause, step, seek on the trace clock); a live feed returns None there.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from kvtop.core import Core

if TYPE_CHECKING:
    from kvtop.feeds.demo import DemoFeed
    from kvtop.feeds.live import LiveRunner, Sink
    from kvtop.feeds.replay import ReplayFeed
    from kvtop.sim.workload import Workload
    from kvtop.sources.promfleet import PromFeed


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
    capture_port: int | None = None  # --capture: the engine port observed passively


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


class Feed(Protocol):
    """What the console (and every headless runner) drives."""

    interval_s: float  # how often its sources poll; the console's +/- keys set it
    notice: str | None  # a one-line banner the console shows while it stands (e.g. "no engine yet")

    @property
    def core(self) -> Core: ...

    async def run(self, *, stop: asyncio.Event | None = None) -> None: ...

    def refresh_now(self) -> None: ...

    def controls(self) -> ReplayControls | None: ...


class StaticFeed:
    """A feed over a core that something else fills (tests, screenshots): nothing to run."""

    def __init__(self, core: Core):
        self._core = core
        self.interval_s = 1.0
        self.notice: str | None = None

    @property
    def core(self) -> Core:
        return self._core

    async def run(self, stop: asyncio.Event | None = None) -> None:
        if stop is not None:
            await stop.wait()

    def refresh_now(self) -> None:
        pass

    def controls(self) -> ReplayControls | None:
        return None


def make_core(label: str, itl_target_s: float | None = None, window_s: float = 60.0, analysis: bool = True,
              **analysis_kw: Any) -> Core:
    """A Core with the live analysis attached (spikes, causes, verdict) unless ``analysis`` is False."""
    live = None
    if analysis:
        from kvtop.analysis.live import LiveAnalyzer

        live = LiveAnalyzer(itl_target_s=itl_target_s, **analysis_kw)
    return Core(window_s=window_s, itl_target_s=itl_target_s, source_label=label, analysis=live)


def live_feed(opts: SourceOptions, label: str = "live", window_s: float = 60.0, analysis: bool = True,
              sinks: list[Sink] | None = None, core: Core | None = None, probe_max_tokens: int = 32) -> LiveRunner:
    """Engines, GPU, host (and --probe canaries, --capture) polled into a fresh analysed Core."""
    from kvtop.feeds.live import LiveRunner

    if core is None:
        core = make_core(label, opts.itl_target_s, window_s=window_s, analysis=analysis)
    return LiveRunner(core, list(opts.urls), interval_s=opts.interval_s, gpu=opts.gpu, host=opts.host,
                      token=opts.token, adapter=opts.adapter, timeout_s=opts.timeout_s,
                      probe_rate=opts.probe_rate, probe_max_tokens=probe_max_tokens, sinks=sinks,
                      capture_port=opts.capture_port)


def replay_feed(path: str | os.PathLike[str], speed: float = 0.0, itl_target_s: float | None = None,
                label: str | None = None) -> ReplayFeed:
    """A trace fed through an analysed Core; a backward seek starts over on a fresh one.

    The analysis takes what the trace header knows (adapter, model, KV bytes per token, the ITL
    target it was recorded against) the way ``kvtop analyze`` does; ``itl_target_s`` overrides.
    Raises TraceError / OSError for a missing or non-trace file.
    """
    from kvtop.feeds.replay import ReplayFeed

    label = label or f"replay {Path(path).name}"
    # opening the feed reads the header; its core is replaced before a record is fed
    feed = ReplayFeed(path, Core(source_label=label), speed=speed)
    kw = _analysis_from_header(feed.header)
    header_target = kw.pop("itl_target_s", None)
    target = itl_target_s if itl_target_s is not None else header_target

    def factory() -> Core:
        return make_core(label, target, **kw)

    feed.core = factory()
    feed.core_factory = factory
    return feed


def _analysis_from_header(header: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
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
    from kvtop.analysis.analyzer import header_itl_target

    target = header_itl_target(header)
    if target is not None:
        out["itl_target_s"] = target
    return out


def demo_feed(workload: Workload, seed: int = 1, speed: float = 1.0, interval_s: float = 1.0,
              window_s: float = 60.0) -> DemoFeed:
    """The simulated engine + its load generator, watched by a live runner into an analysed Core.

    The simulated engine's KV geometry is known, so the cost model gets bytes per token without a
    model config."""
    from kvtop.feeds.demo import DemoFeed

    e = workload.engine
    core = make_core(f"demo {workload.name}", e.itl_target_s, window_s=window_s, adapter="vllm", model=e.model,
                     kv_bytes_per_token=e.bytes_per_token)
    return DemoFeed(core, workload, seed=seed, speed=speed, interval_s=interval_s)


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
                    timeout_s: float = 5.0, token: str | None = None, core_window_s: float | None = None) -> PromFeed:
    """Every engine instance a Prometheus server scrapes, read back into an analysed Core
    (`--prometheus URL`); the engines' history over ``window_s`` is there from the first poll, and
    rates and quantiles cover ``core_window_s`` (default: the whole window)."""
    from kvtop.sources.promfleet import PromFeed

    core = make_core(f"prometheus {url}", itl_target_s, window_s=core_window_s or window_s)
    core.gpu_status = "not read (engines come from Prometheus)"
    return PromFeed(core, url, selector=selector, interval_s=interval_s, timeout_s=timeout_s, window_s=window_s,
                    step_s=step_s, token=token)
