"""The Core: the trackers composed. It hands each record to its tracker (and to the live analysis),
keeps the latest host reading and the sources' status lines, and derives the Snapshot."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Protocol

from kvtop import __version__
from kvtop.analysis.streams import StreamStore
from kvtop.core.engines import EngineTracker
from kvtop.core.events import EventLog
from kvtop.core.gpus import GpuTracker
from kvtop.core.requests import FinishedRequest, RequestTracker
from kvtop.history import History
from kvtop.model.analysis import AnalysisCounters, AnalysisReport
from kvtop.model.records import (
    EngineRecord,
    GpuRecord,
    HostRecord,
    Record,
    RequestRecord,
    StepRecord,
    TruthRecord,
)
from kvtop.model.sanitize import printable
from kvtop.snapshot import RequestTimeline, Snapshot


class LiveAnalysis(Protocol):
    """What the core needs from the analysis package when it runs live (incrementally)."""

    def feed(self, rec: Record) -> None: ...

    @property
    def streams(self) -> StreamStore | None:
        """The analysis's per-stream store, which the request view shares (None: it keeps none)."""
        ...

    def request_info(self, request_id: str) -> tuple[int, int, str | None]:
        """(spikes, spikes attributed to preemption, last cause) for one request (asked only of an
        analysis without a store)."""
        ...

    def report(self, now: float) -> AnalysisReport | None: ...

    def counters(self) -> AnalysisCounters: ...

    def lag(self, now: float) -> float:
        """Seconds since the oldest spike still waiting for its evidence window ended (0 when none)."""
        ...

    def fresh(self) -> LiveAnalysis:
        """A new, empty analysis with the same settings."""
        ...


# a recorded run without GPU records: the trace does not say why, so neither does the replay
GPU_NOT_RECORDED = ("no GPU record in this trace (recorded with --no-gpu, without NVIDIA's driver library or on a "
                    "host without a GPU, or a simulation)")


class Core:
    """Folds records; ``snapshot()`` derives the immutable view."""

    def __init__(
        self,
        window_s: float = 60.0,
        itl_target_s: float | None = None,
        max_requests: int = 5000,
        finished_keep_s: float = 30.0,
        analysis: LiveAnalysis | None = None,
        source_label: str = "live",
        gpu_status: str = "ok",
    ):
        """``gpu_status``: what to say of the GPUs until a GPU record comes (a replay: GPU_NOT_RECORDED)."""
        self.window_s = window_s
        self.itl_target_s = itl_target_s
        self.max_requests = max_requests
        self.finished_keep_s = finished_keep_s
        self.analysis = analysis
        self.source_label = printable(source_label, 300)
        self._gpu_status0 = self.gpu_status = gpu_status
        self.host_status = "ok"
        self.capture: dict[str, Any] | None = None  # set by a live runner with --capture
        self.now = 0.0
        self.paused = False
        self.log = EventLog()
        self.engines = EngineTracker(self.log)
        self.gpus = GpuTracker(self.log)
        store = analysis.streams if analysis is not None else None
        self.requests = RequestTracker(self.log, itl_target_s, max_requests, finished_keep_s, store=store,
                                       info=analysis.request_info if analysis is not None and store is None else None)
        self._host: HostRecord | None = None  # the latest reading: nothing is derived from it
        # the console's history charts (bounded; fed the engine, GPU and host records)
        self.history = History()

    def reset(self) -> None:
        """Forget everything ingested and keep the settings (a replay seeking backwards), so a view
        holding this core stays valid."""
        analysis = self.analysis.fresh() if self.analysis is not None else None
        Core.__init__(self, window_s=self.window_s, itl_target_s=self.itl_target_s, max_requests=self.max_requests,
                      finished_keep_s=self.finished_keep_s, analysis=analysis, source_label=self.source_label,
                      gpu_status=self._gpu_status0)

    # -- ingest -----------------------------------------------------------------------------
    def ingest(self, rec: Record) -> None:
        self.now = max(self.now, rec.t)
        if isinstance(rec, RequestRecord):
            self.requests.ingest(rec)
        elif isinstance(rec, EngineRecord):
            self.engines.ingest(rec)
            self.history.ingest(rec)
        elif isinstance(rec, GpuRecord):
            if self.gpu_status == GPU_NOT_RECORDED:
                self.gpu_status = "ok"
            self.gpus.ingest(rec)
            self.history.ingest(rec)
        elif isinstance(rec, HostRecord):
            self._host = rec
            self.history.ingest(rec)
        elif isinstance(rec, StepRecord):
            self.requests.engine_step(rec)
        elif isinstance(rec, TruthRecord):
            return  # ground truth is for scoring the analysis, never for views
        if self.analysis is not None:
            self.analysis.feed(rec)

    def event(self, t: float, severity: str, kind: str, message: str) -> None:
        """An event a source or front end reports (a feed that stopped, a failed tick)."""
        self.log.add(t, severity, kind, message)

    def set_gpu_status(self, status: str) -> None:
        if status != self.gpu_status and status != "ok":
            self.event(self.now, "warning", "source_error", f"GPU: {status}")
        self.gpu_status = status

    def engine_down(self, url: str, t: float, error: str, adapter: str | None = None) -> None:
        """A scrape failed: mark every engine behind ``url`` down, keep its history."""
        self.now = max(self.now, t)
        self.engines.down(url, t, error, adapter)

    def set_engine_capabilities(self, url: str, preempts: bool) -> None:
        self.engines.set_capabilities(url, preempts)

    # -- derive -----------------------------------------------------------------------------
    def snapshot(self, now: float | None = None, *, history_s: float | None = None, timeline: bool = False,
                 request_id: str | None = None) -> Snapshot:
        """The state at ``now`` (default: the latest record's time). A console asks for more:
        ``history_s``, the chart series over that many seconds before ``now``; ``timeline``, the
        timeline of ``request_id``, or when that is None of the listed request with the worst gap."""
        self.requests.retire(self.now)
        now = self.now if now is None else now
        engines = self.engines.views(now, self.window_s)
        gpus = self.gpus.views()
        requests = self.requests.views(now)
        analysis = self.analysis.report(now) if self.analysis else None
        # derived here, not in a view, so every front end logs it
        self.log.note_verdict(now, analysis.verdict if analysis is not None else None)
        detail = None
        if timeline:
            if request_id is None and requests:
                # nothing chosen: the request with the worst gap is what an operator wants first
                request_id = max(requests, key=lambda r: (r.max_gap_s or 0.0, r.id)).id
            detail = self.request_timeline(request_id) if request_id is not None else None
        return Snapshot(
            kvtop_version=__version__,
            taken_at=datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z"),
            t=now,
            window_s=self.window_s,
            gpu_status=self.gpu_status,
            gpus=gpus,
            host=self._host,
            engines=engines,
            requests=requests,
            events=self.log.views(),
            itl_target_s=self.itl_target_s,
            analysis=analysis,
            paused=self.paused,
            source_label=self.source_label,
            host_status=self.host_status,
            capture=self.capture,
            finished_total=self.requests.finished_total,
            gaps_over_target_total=self.requests.gaps_over_target_total,
            history=self.history.window(now - history_s) if history_s is not None else None,
            detail=detail,
        )

    def request_timeline(self, request_id: str) -> RequestTimeline | None:
        """Token times of one request plus engine preemption rises / prompt bursts in its span."""
        return self.requests.timeline(request_id, self.now, self.engines.marks)

    def engine_marks(self, t0: float, t1: float) -> tuple[tuple[float, str, float], ...]:
        return self.engines.marks(t0, t1)

    def finished_requests(self) -> tuple[FinishedRequest, ...]:
        """Summaries of the requests that left the screens, oldest first (the last max_requests)."""
        return self.requests.finished()

    @property
    def finished_total(self) -> int:
        return self.requests.finished_total

    @property
    def gaps_over_target_total(self) -> int:
        return self.requests.gaps_over_target_total
