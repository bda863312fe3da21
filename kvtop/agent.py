"""The node agent behind `kvtop agent`: live sources + analysis, published to Prometheus.

``build_agent`` takes the pipeline's live feed (Core, analysis and every source: engines, GPU, host,
probe, passive capture, the recording proxy) and adds what only the agent has: the exporter and the
rotating trace. ``Agent.run`` serves ``/metrics`` (prometheus-client exposition), ``/report``
(the agent's own JSON summary: what the spike counters count) and ``/healthz`` with aiohttp on
the same event loop that polls the sources.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from kvtop import __version__
from kvtop.analysis.live import LiveAnalyzer
from kvtop.core import Core
from kvtop.errors import RunFailure
from kvtop.feeds.live import LiveRunner
from kvtop.feeds.sources import ProxyRecorder
from kvtop.httpguard import GuardedServer
from kvtop.log import ServerLog
from kvtop.model.sanitize import output_json, redact_url
from kvtop.model.trace import make_header
from kvtop.model.trace_rotate import RotatingTrace
from kvtop.otlp import LiveExport
from kvtop.pipeline import SourceOptions, live_feed
from kvtop.views.exporter import CONTENT_TYPE, AgentMetrics, engine_label

log = logging.getLogger("kvtop.agent")

DEFAULT_PORT = 9470
# The shape of GET /report (kvtop/schemas/agent-report.schema.json); the number changes when a field
# changes meaning or goes away, not when one is added.
REPORT_SCHEMA = "kvtop-agent-report/1"
DEFAULT_LISTEN = f"127.0.0.1:{DEFAULT_PORT}"


@dataclass
class AgentOptions:
    sources: SourceOptions  # what it watches: engines, GPU, host, --probe, --capture, --proxy-listen
    listen: tuple[str, int] = ("127.0.0.1", DEFAULT_PORT)
    probe_max_tokens: int = 32
    trace_dir: str | None = None
    trace_max_bytes: int = 64 << 20
    trace_max_age_s: float = 600.0
    trace_keep_bytes: int = 1 << 30
    trace_keep_age_s: float = 86400.0
    otlp_endpoint: str | None = None  # OTLP/HTTP traces URL: one span per ended request (kvtop.otlp)

    @property
    def urls(self) -> tuple[str, ...]:
        return self.sources.urls

    @property
    def interval_s(self) -> float:
        return self.sources.interval_s


class Agent:
    def __init__(self, opts: AgentOptions, core: Core, runner: LiveRunner, metrics: AgentMetrics,
                 trace: RotatingTrace | None = None):
        self.opts = opts
        self.core = core
        self.runner = runner
        self.metrics = metrics
        self.trace = trace
        self.url: str | None = None
        self._http: GuardedServer | None = None
        self._app_runner: web.AppRunner | None = None
        self.otlp: LiveExport | None = None
        if opts.otlp_endpoint:
            self.otlp = LiveExport(opts.otlp_endpoint, time.time() - runner.now())

    # -- one tick: refresh the exported state ---------------------------------------------------
    def tick(self) -> None:
        now = self.runner.now()
        self.core.now = max(self.core.now, now)
        snap = self.core.snapshot(now)
        if self.trace is not None:
            self.trace.flush_if_due()
            self.metrics.dropped = self.trace.dropped + int(self.runner.sink_failed)
        analysis = self.core.analysis
        self.metrics.update(snap, analysis.counters() if analysis is not None else None,
                            stale_after_s=max(10.0, 5 * self.opts.interval_s), analysis_lag_s=analysis.lag(now) if analysis is not None else 0.0)
        if self.otlp is not None and isinstance(analysis, LiveAnalyzer):
            eng = snap.engines[0] if snap.engines else None
            self.otlp.tick(analysis.an, now, eng.model if eng else None, eng.adapter if eng else None)

    def report(self) -> dict[str, Any]:
        """What the agent's spike counters hold, as JSON (the same numbers /metrics carries)."""
        analysis = self.core.analysis
        totals = analysis.counters() if analysis is not None else None
        rep = analysis.report(self.core.now) if analysis is not None else None
        v = rep.verdict if rep is not None else None
        return {
            "kvtop_version": __version__,
            "schema": REPORT_SCHEMA,
            "engine": self.metrics.request_engine,
            "spikes_by_cause": dict(totals.spikes_by_cause) if totals else {},
            "stall_seconds_by_cause": {k: round(v, 6) for k, v in totals.stall_s_by_cause.items()} if totals else {},
            "preemptions_attributed": totals.preemptions_attributed if totals else 0,
            "verdict": {"action": v.action if v else None, "mechanism": v.mechanism if v else None,
                        "confidence": v.confidence if v else None},
            "itl_target_s": rep.itl_target_s if rep is not None else None,
            # a down engine's last gauges are not its state now (/metrics drops them too): null
            "engines": [
                {"engine": engine_label(e.url, e.engine), "up": e.up, "kv_usage": e.kv_usage if e.up else None,
                 "preemptions_total": e.preemptions_total, "preemptions_per_s": e.preemptions_per_s if e.up else None,
                 "itl_p99_s": e.itl_p99_s if e.up else None}
                for e in self.core.snapshot().engines
            ],
        }

    # -- HTTP -----------------------------------------------------------------------------------
    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def _report(self, request: web.Request) -> web.Response:
        return web.Response(text=json.dumps(output_json(self.report()), allow_nan=False), content_type="application/json")

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def start_http(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/report", self._report)
        app.router.add_get("/healthz", self._health)
        self._app_runner = web.AppRunner(app, access_log=None, logger=ServerLog())
        await self._app_runner.setup()
        host, port = self.opts.listen
        assert self._app_runner.server is not None
        # bounded connections: idle or half-sent ones held the port (and, out of descriptors, the proxy)
        self._http = GuardedServer(self._app_runner.server)
        bound = await self._http.start(host, port)
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{bound}"

    async def run(self, stop: asyncio.Event, duration_s: float | None = None) -> None:
        try:
            await self.start_http()
        except OSError as e:
            await self.runner.aclose()
            host, port = self.opts.listen
            raise RunFailure(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
        tasks: list[asyncio.Task[None]] = []
        try:
            try:
                await self.runner.start()  # the proxy listens (or says why not) before the line says so
            except OSError as e:
                await self.runner.aclose()
                assert self.opts.sources.proxy_listen is not None  # only the proxy raises OSError
                host, port = self.opts.sources.proxy_listen
                raise RunFailure(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
            tasks.append(asyncio.create_task(self._tick_loop(stop)))
            self.tick()
            src = self.opts.sources
            what = [f"metrics {self.url}/metrics", f"{len(src.urls)} engine(s)"]
            proxy = self.runner.source("proxy")
            if isinstance(proxy, ProxyRecorder):
                what.append(f"proxy {proxy.url}")
            if src.probe_rate:
                what.append(f"probe {src.probe_rate:g}/s")
            if src.capture_port is not None:
                what.append(f"capture port {src.capture_port}")
            if self.trace is not None:
                what.append(f"trace segments in {self.trace.dir}")
            if self.otlp is not None:
                what.append(f"OTLP spans to {self.otlp.sender.url}")
            log.info(f"{', '.join(what)} (Ctrl-C to stop)", extra={"fields": {"event": "started", "url": self.url}})
            await self.runner.run(duration_s=duration_s, stop=stop)  # the proxy stops with the run
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self._http is not None:
                await self._http.close()
            if self._app_runner is not None:
                await self._app_runner.cleanup()
            if self.trace is not None:
                await asyncio.to_thread(self.trace.close)
            if self.otlp is not None:
                analysis = self.core.analysis
                if isinstance(analysis, LiveAnalyzer):
                    eng = next(iter(self.core.snapshot(self.runner.now()).engines), None)
                    self.otlp.final(analysis.an, eng.model if eng else None, eng.adapter if eng else None)
                await asyncio.to_thread(self.otlp.close)

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
    runner = live_feed(opts.sources, label="agent", probe_max_tokens=opts.probe_max_tokens)
    core = runner.core
    urls = list(opts.urls)
    metrics = AgentMetrics(request_engine=engine_label(urls[0]) if urls else None)
    runner.sinks.append(metrics.sink)
    trace = None
    if opts.trace_dir:

        def header() -> dict[str, Any]:
            shown = [redact_url(u) for u in urls]  # a trace never keeps the URL's credentials
            cls = runner.scrapers[0].adapter_cls if runner.scrapers else None  # known once it answered
            return make_header(engine={"url": shown[0] if shown else None, "adapter": cls.name if cls else None},
                               recorder="kvtop agent",
                               interval_s=opts.interval_s, urls=shown, agent_wall_t0=time.time() - runner.now())

        trace = RotatingTrace(opts.trace_dir, header, max_bytes=opts.trace_max_bytes, max_age_s=opts.trace_max_age_s,
                              keep_bytes=opts.trace_keep_bytes, keep_age_s=opts.trace_keep_age_s)
        runner.sinks.append(trace.write)
    return Agent(opts, core, runner, metrics, trace)
