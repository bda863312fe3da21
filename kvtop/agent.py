"""The node agent behind `kvtop agent`: live sources + analysis, published to Prometheus.

``build_agent`` is the one place that wires Core, LiveRunner, request observation (proxy, probe,
passive capture), the exporter and the rotating trace together, so a shared pipeline builder can
take it over whole. ``Agent.run`` serves ``/metrics`` (prometheus-client exposition), ``/report``
(the agent's own JSON summary: what the spike counters count) and ``/healthz`` with aiohttp on
the same event loop that polls the sources.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from kvtop.core import Core
from kvtop.feeds.live import LiveRunner
from kvtop.views.exporter import CONTENT_TYPE, AgentMetrics, engine_label

DEFAULT_PORT = 9470
DEFAULT_LISTEN = f"127.0.0.1:{DEFAULT_PORT}"


@dataclass
class AgentOptions:
    urls: list[str]
    listen: tuple[str, int] = ("127.0.0.1", DEFAULT_PORT)
    interval_s: float = 1.0
    timeout_s: float = 2.0
    itl_target_s: float | None = None
    token: str | None = None
    adapter: str | None = None
    gpu: bool = True
    host: bool = True
    proxy_listen: tuple[str, int] | None = None
    probe_rate: float | None = None
    probe_max_tokens: int = 32
    trace_dir: str | None = None
    trace_max_bytes: int = 64 << 20
    trace_max_age_s: float = 600.0
    trace_keep_bytes: int = 1 << 30
    trace_keep_age_s: float = 86400.0
    capture_port: int | None = None  # --capture: the engine port observed passively (the live runner runs it)
    extra: dict[str, Any] = field(default_factory=dict)


class Agent:
    def __init__(self, opts: AgentOptions, core: Core, runner: LiveRunner, metrics: AgentMetrics,
                 trace: Any = None):
        self.opts = opts
        self.core = core
        self.runner = runner
        self.metrics = metrics
        self.trace = trace
        self.url: str | None = None
        self.proxy: Any = None
        self._site: web.TCPSite | None = None
        self._app_runner: web.AppRunner | None = None

    # -- one tick: refresh the exported state ---------------------------------------------------
    def tick(self) -> None:
        now = self.runner.now()
        self.core.now = max(self.core.now, now)
        snap = self.core.snapshot(now)
        if self.trace is not None:
            self.trace.flush_if_due()
            self.metrics.dropped = self.trace.write_errors + int(self.runner._sink_failed)
        self.metrics.update(snap, self.core.analysis, stale_after_s=max(10.0, 5 * self.opts.interval_s),
                            analysis_lag_s=self.core.analysis.lag(now) if self.core.analysis else 0.0)

    def report(self) -> dict[str, Any]:
        """What the agent's spike counters hold, as JSON (the same numbers /metrics carries)."""
        analysis = self.core.analysis
        totals = analysis.counters() if analysis is not None else None
        rep = analysis.report(self.core.now) if analysis is not None else None
        v = rep.verdict if rep is not None else None
        return {
            "engine": self.metrics.request_engine,
            "spikes_by_cause": dict(totals.spikes_by_cause) if totals else {},
            "stall_seconds_by_cause": {k: round(v, 6) for k, v in totals.stall_s_by_cause.items()} if totals else {},
            "preemptions_attributed": totals.preemptions_attributed if totals else 0,
            "verdict": {"action": v.action if v else None, "mechanism": v.mechanism if v else None,
                        "confidence": v.confidence if v else None},
            "itl_target_s": rep.itl_target_s if rep is not None else None,
            "engines": [
                {"engine": engine_label(e.url, e.engine), "up": e.up, "kv_usage": e.kv_usage,
                 "preemptions_total": e.preemptions_total, "preemptions_per_s": e.preemptions_per_s,
                 "itl_p99_s": e.itl_p99_s}
                for e in self.core.snapshot().engines
            ],
        }

    # -- HTTP -----------------------------------------------------------------------------------
    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def _report(self, request: web.Request) -> web.Response:
        from kvtop.model.trace import _finite

        return web.Response(text=json.dumps(_finite(self.report()), allow_nan=False), content_type="application/json")

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def start_http(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/report", self._report)
        app.router.add_get("/healthz", self._health)
        self._app_runner = web.AppRunner(app, access_log=None)
        await self._app_runner.setup()
        host, port = self.opts.listen
        self._site = web.TCPSite(self._app_runner, host, port)
        await self._site.start()
        server = getattr(self._site, "_server", None)
        socks = getattr(server, "sockets", None) or []
        bound = socks[0].getsockname()[1] if socks else port
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{bound}"

    async def run(self, stop: asyncio.Event, duration_s: float | None = None) -> None:
        from kvtop.errors import UsageError

        try:
            await self.start_http()
        except OSError as e:
            await self.runner.aclose()
            host, port = self.opts.listen
            raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
        tasks: list[asyncio.Task[Any]] = []
        try:
            if self.opts.proxy_listen is not None:
                from kvtop.sources.proxy import make_proxy

                host, port = self.opts.proxy_listen
                self.proxy = make_proxy(self.runner.scrapers[0].base_url, self.runner.emit, self.runner.now,
                                        host=host, port=port)
                try:
                    await self.proxy.start()
                except OSError as e:
                    self.proxy = None
                    raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
            tasks.append(asyncio.create_task(self._tick_loop(stop)))
            self.tick()
            what = [f"metrics {self.url}/metrics", f"{len(self.opts.urls)} engine(s)"]
            if self.proxy is not None:
                what.append(f"proxy {self.proxy.url}")
            if self.opts.probe_rate:
                what.append(f"probe {self.opts.probe_rate:g}/s")
            if self.opts.capture_port is not None:
                what.append(f"capture port {self.opts.capture_port}")
            if self.trace is not None:
                what.append(f"trace segments in {self.trace.dir}")
            print(f"kvtop agent: {', '.join(what)} (Ctrl-C to stop)", file=sys.stderr, flush=True)
            await self.runner.run(duration_s=duration_s, stop=stop)
        finally:
            stop.set()
            if self.proxy is not None:
                await self.proxy.stop()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self._app_runner is not None:
                await self._app_runner.cleanup()
            if self.trace is not None:
                await asyncio.to_thread(self.trace.close)

    async def _tick_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=self.opts.interval_s)
            except asyncio.TimeoutError:
                pass
            try:
                self.tick()
            except Exception as e:  # a bad tick must not end the agent: say so, try again next time
                self.core.event(self.runner.now(), "error", "source_error", f"agent tick failed: {e}")


def build_agent(opts: AgentOptions) -> Agent:
    """The pipeline's live feed (Core + sources + analysis) plus the exporter and the rotating trace."""
    from kvtop.pipeline import SourceOptions, live_feed

    src = SourceOptions(urls=tuple(opts.urls), interval_s=opts.interval_s, timeout_s=opts.timeout_s, token=opts.token,
                        adapter=opts.adapter, gpu=opts.gpu, host=opts.host, probe_rate=opts.probe_rate,
                        itl_target_s=opts.itl_target_s, capture_port=opts.capture_port)
    runner = live_feed(src, label="agent", probe_max_tokens=opts.probe_max_tokens)
    core = runner.core
    metrics = AgentMetrics(request_engine=engine_label(opts.urls[0]) if opts.urls else None)
    runner.sinks.append(metrics.sink)
    trace = None
    if opts.trace_dir:
        from kvtop.model.trace import make_header
        from kvtop.model.trace_rotate import RotatingTrace

        def header() -> dict[str, Any]:
            return make_header(engine={"url": opts.urls[0] if opts.urls else None}, recorder="kvtop agent",
                               interval_s=opts.interval_s, urls=opts.urls, agent_wall_t0=time.time() - runner.now())

        trace = RotatingTrace(opts.trace_dir, header, max_bytes=opts.trace_max_bytes, max_age_s=opts.trace_max_age_s,
                              keep_bytes=opts.trace_keep_bytes, keep_age_s=opts.trace_keep_age_s)
        runner.sinks.append(trace.write)
    return Agent(opts, core, runner, metrics, trace)
