"""Incremental analysis for the live console and `kvtop snapshot` (the core's ``LiveAnalysis``).

``Core(analysis=LiveAnalyzer(...))`` calls ``feed`` for every record. Work per record is O(1)
(a dictionary update per token, a list append per long gap); spikes are attributed once their
evidence window has passed, so a tick costs O(new records + newly settled spikes). Memory is bounded:
at most ``max_requests`` request states, ``keep_spikes`` listed spikes and ``horizon_s`` of evidence.
``report(now)`` is the same ``AnalysisReport`` ``kvtop analyze`` builds; it is rebuilt at most once per
``report_every_s`` of stream time (the views poll it several times a second).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

from kvtop.analysis.analyzer import Analyzer
from kvtop.analysis.engines import engine_semantics
from kvtop.analysis.report import build_report
from kvtop.analysis.streams import StreamStore
from kvtop.model.analysis import AnalysisCounters, AnalysisReport
from kvtop.model.records import (
    EngineRecord,
    GpuRecord,
    HostRecord,
    Record,
    RequestRecord,
    StepRecord,
    TruthRecord,
    to_dict,
)


class LiveAnalyzer:
    def __init__(self, itl_target_s: float | None = None, adapter: str | None = None, model: str | None = None,
                 model_config: dict[str, Any] | None = None, kv_bytes_per_token: float | None = None,
                 kv_dtype: str = "bf16", tp: int = 1, max_requests: int = 5000, keep_spikes: int = 500,
                 horizon_s: float = 120.0, report_every_s: float = 1.0, interval_s: float | None = None,
                 header: dict[str, Any] | None = None):
        # a fresh analyzer with the same settings, for the core's reset (a replay seeking backwards)
        self._fresh: Callable[[], LiveAnalyzer] = partial(
            LiveAnalyzer, itl_target_s=itl_target_s, adapter=adapter, model=model, model_config=model_config,
            kv_bytes_per_token=kv_bytes_per_token, kv_dtype=kv_dtype, tp=tp, max_requests=max_requests,
            keep_spikes=keep_spikes, horizon_s=horizon_s, report_every_s=report_every_s, interval_s=interval_s,
            header=header)
        self.an = Analyzer(itl_target_s=itl_target_s, max_requests=max_requests, keep_spikes=keep_spikes,
                           horizon_s=horizon_s)
        # ``interval_s``: how often the engines are scraped (until two scrapes show it)
        # a replayed trace's own header (the engine's limits, its scrape period, its target: what
        # ``kvtop analyze`` reads of the same trace), else what the caller knows
        h = dict(header or {})
        eng = h.get("engine")
        h["engine"] = {**(eng if isinstance(eng, dict) else {}),
                       **{k: v for k, v in (("adapter", adapter), ("model", model)) if v is not None}}
        if interval_s is not None or "interval_s" not in h:
            h["interval_s"] = interval_s
        self.an.set_header(h)
        self.model_config = model_config
        self.kv_bytes = kv_bytes_per_token
        self.kv_dtype = kv_dtype
        self.tp = tp
        self.report_every_s = report_every_s
        self._adapter: str | None = None
        self._settings: dict[str, str] = {}
        self._cached: tuple[float, int, AnalysisReport] | None = None
        self._warn: list[str] = []
        if adapter:
            self._set_adapter(adapter)

    def fresh(self) -> LiveAnalyzer:
        return self._fresh()

    def _set_adapter(self, name: str) -> None:
        self._adapter = name
        sem = engine_semantics(name)
        self._settings = sem.settings
        self.an.use_engine(sem, name)
        self._warn = [sem.warning] if sem.warning else []

    def feed(self, rec: Record) -> None:
        an = self.an
        if isinstance(rec, RequestRecord):
            an.records += 1
            if rec.event == "token":
                an.token(rec.id, rec.t, rec.n)
            else:
                an.request_event(rec.t, rec.id, rec.event, rec.n, rec.prompt_tokens, rec.cls, rec.completion_tokens,
                                 engine=rec.engine, finish_reason=rec.finish_reason, incomplete=rec.incomplete)
                if rec.event == "finish" and (rec.engine_ttft_s is not None or rec.engine_queue_s is not None
                                              or rec.engine_decode_s is not None):
                    an.engine_times(to_dict(rec))
        elif isinstance(rec, EngineRecord):
            if rec.adapter and rec.adapter != self._adapter:
                self._set_adapter(rec.adapter)
            if rec.model and not (an.header.get("engine") or {}).get("model"):
                an.header["engine"]["model"] = rec.model
            an.feed_dict(to_dict(rec))
        elif isinstance(rec, (GpuRecord, HostRecord, StepRecord)):
            an.feed_dict(to_dict(rec))
        elif isinstance(rec, TruthRecord):
            return  # ground truth is never analysis input

    @property
    def streams(self) -> StreamStore:
        return self.an.gaps.streams

    def request_info(self, request_id: str) -> tuple[int, int, str | None]:
        return self.an.request_info(request_id)

    def counters(self) -> AnalysisCounters:
        an = self.an
        return AnalysisCounters({str(c): n for c, n in an.cause_counts.items()},
                                {str(c): s for c, s in an.cause_seconds.items()}, an.acc.preempted_requests)

    def finish(self) -> None:
        """The source has no more records (a replay reached its trace's end): judge the spikes still
        waiting for evidence, as ``kvtop analyze`` does at a trace's end."""
        self.an.finish()
        self._cached = None

    def lag(self, now: float) -> float:
        pending = self.an.gaps.pending
        return max(0.0, now - pending[0].gap.t_end) if pending else 0.0

    def report(self, now: float) -> AnalysisReport | None:
        an = self.an
        if an.records == 0:
            return None
        c = self._cached
        if c is not None and 0 <= now - c[0] < self.report_every_s:
            return c[2]
        an.tick(now)
        rep = replace(build_report(an, self.model_config, self.kv_bytes, self.kv_dtype, self.tp, self._settings,
                                   self._adapter, list(self._warn)), pending_spikes=len(an.gaps.pending))
        self._cached = (now, an.records, rep)
        return rep
