"""The core: folds records into bounded state and derives Snapshots (docs/design.md §1).

Pure: no I/O, no threads, no Textual. Live runs, replays and simulations feed the same ``Core``;
the only difference is where the records come from. Memory is bounded whatever the run length.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Protocol

from kvtop import __version__
from kvtop.history import History
from kvtop.model.analysis import AnalysisCounters, AnalysisReport
from kvtop.model.records import EngineRecord, GpuRecord, HostRecord, Record, RequestRecord, TruthRecord
from kvtop.model.sanitize import printable, sanitize_record
from kvtop.model.series import HistogramSeries, Series, counter_rate
from kvtop.snapshot import EngineView, EventView, GpuView, RequestView, Snapshot

# Bytes/s per lane per direction by PCIe generation (8b/10b for Gen1-2, 128b/130b after).
_LANE_BYTES_PER_S = {1: 0.25e9, 2: 0.5e9, 3: 0.985e9, 4: 1.969e9, 5: 3.938e9, 6: 7.563e9}


TIMELINE_MAX_CHUNKS = 1024
MAX_MARKS = 256


class _Chunks:
    """A request's token arrivals as two flat arrays (12 bytes a chunk; a deque of tuples costs
    ~90): at 20 requests/s this is most of what the core holds. Keeps the last TIMELINE_MAX_CHUNKS."""

    __slots__ = ("t", "n")

    def __init__(self) -> None:
        self.t = array("d")
        self.n = array("I")

    def append(self, t: float, n: int) -> None:
        self.t.append(t)
        self.n.append(max(0, n))
        if len(self.t) >= 2 * TIMELINE_MAX_CHUNKS:  # trim in batches: amortised O(1)
            del self.t[:-TIMELINE_MAX_CHUNKS]
            del self.n[:-TIMELINE_MAX_CHUNKS]

    def items(self) -> tuple[tuple[float, int], ...]:
        k = max(0, len(self.t) - TIMELINE_MAX_CHUNKS)
        return tuple(zip(self.t[k:], self.n[k:], strict=True))

    def __len__(self) -> int:
        return min(len(self.t), TIMELINE_MAX_CHUNKS)


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """What the core keeps of a request once it has left the screens: its size, its worst gaps and
    how many went over the target, not its timeline."""

    id: str
    cls: str | None
    state: str  # finished, cancelled, error
    tokens: int
    arrive_t: float
    end_t: float
    max_gap_s: float | None
    gaps_over_target: int  # over the core's ITL target (0 when there is none)
    gap_p50_s: float | None
    gap_p99_s: float | None


@dataclass(frozen=True, slots=True)
class RequestTimeline:
    """One request's token arrivals and the engine events around it (request detail view)."""

    id: str
    arrive_t: float
    end_t: float | None
    state: str
    tokens: tuple[tuple[float, int], ...]  # (t, tokens in chunk); the oldest drop past TIMELINE_MAX_CHUNKS
    marks: tuple[tuple[float, str], ...]  # request-level preempt / resume events
    engine_marks: tuple[tuple[float, str, float], ...]  # (t, "preemption" | "prompt_burst", amount)


def pcie_capacity_bytes_per_s(gen: int | None, width: int | None) -> float | None:
    if not gen or not width or gen not in _LANE_BYTES_PER_S:
        return None
    return _LANE_BYTES_PER_S[gen] * width


class LiveAnalysis(Protocol):
    """What the core needs from the analysis package when it runs live (incrementally)."""

    def feed(self, rec: Record) -> None: ...

    def request_info(self, request_id: str) -> tuple[int, int, str | None]:
        """(spikes, spikes attributed to preemption, last cause) for one request."""
        ...

    def report(self, now: float) -> AnalysisReport | None: ...

    def counters(self) -> AnalysisCounters: ...

    def lag(self, now: float) -> float:
        """Seconds since the oldest spike still waiting for its evidence window ended (0 when none)."""
        ...

    def fresh(self) -> LiveAnalysis:
        """A new, empty analysis with the same settings."""
        ...


@dataclass
class _EngineState:
    url: str
    adapter: str | None
    engine: str | None
    last: EngineRecord | None = None
    last_ok_t: float | None = None
    up: bool = True
    error: str | None = None
    restarts: int = 0
    kv_usage: Series = field(default_factory=lambda: Series(3600))
    preemptions: Series = field(default_factory=lambda: Series(3600))
    prompt: Series = field(default_factory=lambda: Series(3600))
    generation: Series = field(default_factory=lambda: Series(3600))
    itl: HistogramSeries = field(default_factory=lambda: HistogramSeries(600))
    ttft: HistogramSeries = field(default_factory=lambda: HistogramSeries(600))
    preempt_rate_hist: deque[float] = field(default_factory=lambda: deque(maxlen=120))
    preempts: bool = True


@dataclass
class _RequestState:
    id: str
    arrive_t: float
    cls: str | None = None
    source: str | None = None
    state: str = "waiting"
    tokens: int = 0
    last_token_t: float | None = None
    max_gap_s: float | None = None
    end_t: float | None = None
    # (t, n) per token chunk plus preempt/resume marks, bounded, for the request detail view.
    token_times: _Chunks = field(default_factory=_Chunks)
    marks: list[tuple[float, str]] = field(default_factory=list)

    def mark(self, t: float, ev: str) -> None:
        if len(self.marks) >= MAX_MARKS:
            del self.marks[0]
        self.marks.append((t, ev))

    def summary(self, target: float | None) -> FinishedRequest:
        ts = self.token_times.t
        gaps = sorted(b - a for a, b in zip(ts, ts[1:], strict=False))
        over = sum(1 for g in gaps if g > target) if target else 0

        def q(p: float) -> float | None:
            return gaps[min(len(gaps) - 1, int(p * len(gaps)))] if gaps else None

        return FinishedRequest(self.id, self.cls, self.state, self.tokens, self.arrive_t, self.end_t or self.arrive_t,
                               self.max_gap_s, over, q(0.5), q(0.99))


ERROR_BURST_S = 1.0


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
    ):
        self.window_s = window_s
        self.itl_target_s = itl_target_s
        self.max_requests = max_requests
        self.finished_keep_s = finished_keep_s
        self.analysis = analysis
        self.source_label = printable(source_label, 300)
        self.gpu_status = "ok"
        self.host_status = "ok"
        self.capture: dict[str, Any] | None = None  # set by a live runner with --capture
        self.now = 0.0
        self._engines: OrderedDict[tuple[str, str | None], _EngineState] = OrderedDict()
        self._gpus: dict[int, tuple[GpuRecord, deque[float], deque[float]]] = {}
        self._host: HostRecord | None = None
        # the console's history charts (bounded; fed the engine, GPU and host records)
        self.history = History()
        self._requests: OrderedDict[str, _RequestState] = OrderedDict()
        # Requests that ended, in end order; past finished_keep_s they leave the screens and
        # ``_requests`` and only their summary stays (bounded).
        self._ended: deque[tuple[float, str]] = deque()
        self._finished: deque[FinishedRequest] = deque(maxlen=max_requests)
        self.finished_total = 0
        self.gaps_over_target_total = 0
        self._events: deque[EventView] = deque(maxlen=500)
        # Streams ending in error within ERROR_BURST_S of each other: an engine aborting its active
        # requests (llama.cpp's exhausted unified KV cache, an engine crash) -> one event per burst.
        self._error_burst: list[RequestRecord] = []
        self._error_burst_reported = False
        self.paused = False

    def reset(self) -> None:
        """Forget everything ingested and keep the settings (a replay seeking backwards), so a view
        holding this core stays valid."""
        analysis = self.analysis.fresh() if self.analysis is not None else None
        Core.__init__(self, window_s=self.window_s, itl_target_s=self.itl_target_s, max_requests=self.max_requests,
                      finished_keep_s=self.finished_keep_s, analysis=analysis, source_label=self.source_label)

    # -- ingest -----------------------------------------------------------------------------
    def ingest(self, rec: Record) -> None:
        self.now = max(self.now, rec.t)
        if isinstance(rec, RequestRecord):
            self._ingest_request(rec)
        elif isinstance(rec, EngineRecord):
            self._ingest_engine(rec)
            self.history.ingest(rec)
        elif isinstance(rec, GpuRecord):
            self._ingest_gpu(rec)
            self.history.ingest(rec)
        elif isinstance(rec, HostRecord):
            self._host = rec
            self.history.ingest(rec)
        elif isinstance(rec, TruthRecord):
            return  # ground truth is for scoring the analysis, never for views
        if self.analysis is not None:
            self.analysis.feed(rec)

    def event(self, t: float, severity: str, kind: str, message: str) -> None:
        # messages quote URLs and engine text: shown on terminals, so no control sequences
        self._events.append(EventView(t, severity, kind, printable(message, 300)))

    def set_gpu_status(self, status: str) -> None:
        if status != self.gpu_status and status != "ok":
            self.event(self.now, "warning", "source_error", f"GPU: {status}")
        self.gpu_status = status

    def _engine_state(self, url: str, engine: str | None, adapter: str | None) -> _EngineState:
        key = (url, engine)
        st = self._engines.get(key)
        if st is None:
            st = _EngineState(url=url, adapter=adapter, engine=engine)
            self._engines[key] = st
        return st

    def engine_down(self, url: str, t: float, error: str, adapter: str | None = None) -> None:
        """A scrape failed: mark every engine behind ``url`` down, keep its history."""
        self.now = max(self.now, t)
        states = [s for (u, _), s in self._engines.items() if u == url] or [self._engine_state(url, None, adapter)]
        for st in states:
            if st.up:
                self.event(t, "error", "engine_down", f"{url}: down ({error})")
            st.up = False
            st.error = error

    def _ingest_engine(self, rec: EngineRecord) -> None:
        # Live records are clean already; replayed traces may come from older or foreign writers.
        sanitize_record(rec)
        url = rec.url or "?"
        if not rec.up:
            # A failed scrape has no engine label: it marks every engine behind the URL down
            # (creating a placeholder only if the URL never answered).
            self.engine_down(url, rec.t, rec.warnings[0] if rec.warnings else "down", rec.adapter)
            return
        # A URL that was down before its first good scrape has a label-less placeholder: drop it
        # once the real engine labels are known.
        placeholder = self._engines.get((url, None))
        if rec.engine is not None and placeholder is not None and placeholder.last is None:
            del self._engines[(url, None)]
        st = self._engine_state(url, rec.engine, rec.adapter)
        st.adapter = rec.adapter
        if not st.up:
            self.event(rec.t, "info", "engine_up", f"{url}: reachable again")
        st.up, st.error = True, None
        prev = st.last
        restarted = prev is not None and self._restarted(prev, rec)
        if restarted:
            st.restarts += 1
            self.event(rec.t, "warning", "engine_restart", f"{url}: engine restarted (counters reset)")
            # Counters began again from zero: rates must not use the pre-restart value as a baseline.
            for s in (st.preemptions, st.prompt, st.generation):
                s.mark_counter_reset(rec.t)
            st.itl.mark_reset(rec.t)
            st.ttft.mark_reset(rec.t)
        st.last = rec
        st.last_ok_t = rec.t
        st.kv_usage.append(rec.t, rec.kv_usage)
        st.preemptions.append(rec.t, rec.preemptions_total)
        st.prompt.append(rec.t, rec.prompt_tokens_total)
        st.generation.append(rec.t, rec.generation_tokens_total)
        st.itl.append(rec.t, rec.itl)
        st.ttft.append(rec.t, rec.ttft)
        if prev is not None and prev.preemptions_total is not None and rec.preemptions_total is not None:
            d = rec.preemptions_total - prev.preemptions_total
            dt = rec.t - prev.t
            if d < 0 or restarted:
                d = rec.preemptions_total
            rate = d / dt if dt > 0 else 0.0
            st.preempt_rate_hist.append(rate)
            if d >= 1:
                self.event(rec.t, "warning" if rate < 1 else "error", "preemption_burst",
                           f"{url}: {int(d)} preemption(s) in {dt:.1f}s")

    @staticmethod
    def _restarted(prev: EngineRecord, cur: EngineRecord) -> bool:
        if prev.restart_token is not None and cur.restart_token is not None and cur.restart_token != prev.restart_token:
            return True
        for f in ("generation_tokens_total", "prompt_tokens_total", "preemptions_total", "requests_finished_total"):
            a, b = getattr(prev, f), getattr(cur, f)
            if a is not None and b is not None and b < a:
                return True
        return False

    def _ingest_gpu(self, rec: GpuRecord) -> None:
        if rec.name is not None:
            rec.name = printable(rec.name, 120)
        prev = self._gpus.get(rec.index)
        tx, rx = (prev[1], prev[2]) if prev else (deque(maxlen=120), deque(maxlen=120))
        if rec.pcie_tx_bytes_per_s is not None:
            tx.append(rec.pcie_tx_bytes_per_s)
        if rec.pcie_rx_bytes_per_s is not None:
            rx.append(rec.pcie_rx_bytes_per_s)
        if prev and rec.lost and not prev[0].lost:
            self.event(rec.t, "error", "source_error", f"GPU {rec.index}: lost (fell off the bus?)")
        self._gpus[rec.index] = (rec, tx, rx)
        if self._downtrained(rec) and not (prev and self._downtrained(prev[0])):
            self.event(rec.t, "warning", "link_downtrained",
                       f"GPU {rec.index}: PCIe link Gen{rec.pcie_link_gen} x{rec.pcie_link_width} under load "
                       f"(max Gen{rec.pcie_link_gen_max} x{rec.pcie_link_width_max})")

    @staticmethod
    def _downtrained(rec: GpuRecord) -> bool:
        # Idle links down-train on purpose; only flag it while traffic flows.
        busy = (rec.pcie_tx_bytes_per_s or 0) + (rec.pcie_rx_bytes_per_s or 0) > 1e9 or (rec.util_pct or 0) > 50
        if not busy:
            return False
        g, gm, w, wm = rec.pcie_link_gen, rec.pcie_link_gen_max, rec.pcie_link_width, rec.pcie_link_width_max
        return bool((g and gm and g < gm) or (w and wm and w < wm))

    def _ingest_request(self, rec: RequestRecord) -> None:
        if isinstance(rec.cls, str) and not rec.cls.isprintable():
            rec.cls = printable(rec.cls, 80)  # a class name comes from a client's request header
        if not isinstance(rec.id, str):
            rec.id = str(rec.id)  # older simulated traces numbered their requests
        r = self._requests.get(rec.id)
        if r is None:
            r = _RequestState(rec.id, rec.t, rec.cls, rec.source)
            self._requests[rec.id] = r
            self._trim_requests()
        ev = rec.event
        if ev in ("token", "first_token", "resync"):
            # resync: tokens after a capture hole; the time since the last token is not a gap
            if r.last_token_t is not None and ev != "resync":
                gap = rec.t - r.last_token_t
                if gap < 0:
                    return  # a token older than the last one seen (a reordered trace): not a gap
                r.max_gap_s = gap if r.max_gap_s is None else max(r.max_gap_s, gap)
            r.last_token_t = rec.t
            n = rec.n if rec.n is not None else 1
            r.tokens += n
            r.token_times.append(rec.t, n)
            r.state = "running"
        elif ev == "preempt":
            r.state = "preempted"
            r.mark(rec.t, ev)
        elif ev == "resume":
            r.state = "running"
            r.mark(rec.t, ev)
        elif ev in ("finish", "cancel", "error"):
            r.state = {"finish": "finished", "cancel": "cancelled", "error": "error"}[ev]
            if r.end_t is None:
                self._ended.append((rec.t, r.id))
            r.end_t = rec.t
            if ev == "error":
                self._note_error(rec)
        ended = self._ended
        if ended and rec.t - ended[0][0] > self.finished_keep_s:
            self._retire(rec.t)

    def _retire(self, now: float) -> None:
        """Requests that ended more than finished_keep_s ago leave the screens: keep their summary."""
        ended, target = self._ended, self.itl_target_s
        while ended and now - ended[0][0] > self.finished_keep_s:
            _t, rid = ended.popleft()
            r = self._requests.get(rid)
            if r is None or r.end_t is None:
                continue  # trimmed already, or an id that started again
            del self._requests[rid]
            s = r.summary(target)
            self._finished.append(s)
            self.finished_total += 1
            self.gaps_over_target_total += s.gaps_over_target

    def finished_requests(self) -> tuple[FinishedRequest, ...]:
        """Summaries of the requests that left the screens, oldest first (the last max_requests)."""
        return tuple(self._finished)

    def _note_error(self, rec: RequestRecord) -> None:
        burst = self._error_burst
        if burst and rec.t - burst[-1].t > ERROR_BURST_S:
            burst.clear()
            self._error_burst_reported = False
        burst.append(rec)
        if len(burst) >= 2 and not self._error_burst_reported:
            self._error_burst_reported = True
            kinds = sorted({b.error or "error" for b in burst})
            self.event(rec.t, "error", "requests_aborted",
                       f"{len(burst)}+ streams ended in error together ({', '.join(kinds)}): the engine aborted "
                       "its active requests")

    def _trim_requests(self) -> None:
        while len(self._requests) > self.max_requests:
            # drop the oldest ended request first; else the oldest of all
            for k, v in self._requests.items():
                if v.end_t is not None:
                    del self._requests[k]
                    break
            else:
                self._requests.popitem(last=False)

    # -- derive -----------------------------------------------------------------------------
    def snapshot(self, now: float | None = None) -> Snapshot:
        if self._ended:
            self._retire(self.now)
        now = self.now if now is None else now
        w = self.window_s
        engines = []
        for st in self._engines.values():
            rec = st.last
            ev = EngineView(
                url=st.url,
                adapter=st.adapter,
                up=st.up and rec is not None,
                engine=st.engine,
                error=st.error,
                stale_s=None if st.last_ok_t is None else round(now - st.last_ok_t, 3),
                preempts=st.preempts,
                restarts=st.restarts,
            )
            if rec is not None:
                ev = _replace(
                    ev,
                    model=rec.model,
                    kv_usage=rec.kv_usage,
                    running=rec.running,
                    waiting=rec.waiting,
                    preemptions_total=rec.preemptions_total,
                    preemptions_per_s=counter_rate(st.preemptions, w, now),
                    prompt_tokens_per_s=counter_rate(st.prompt, w, now),
                    generation_tokens_per_s=counter_rate(st.generation, w, now),
                    itl_p50_s=st.itl.quantile(0.5, w, now),
                    itl_p99_s=st.itl.quantile(0.99, w, now),
                    ttft_p50_s=st.ttft.quantile(0.5, w, now),
                    ttft_p99_s=st.ttft.quantile(0.99, w, now),
                    kv_capacity_tokens=rec.kv_capacity_tokens,
                    block_size=rec.block_size,
                    kv_usage_history=tuple(st.kv_usage.values(120)),
                    preemptions_history=tuple(st.preempt_rate_hist),
                    warnings=tuple(rec.warnings),
                )
            engines.append(ev)
        # stored readings are never changed after ingest, so snapshots share them rather than copy
        gpus = tuple(
            GpuView(record=grec,
                    pcie_capacity_bytes_per_s=pcie_capacity_bytes_per_s(grec.pcie_link_gen, grec.pcie_link_width),
                    link_downtrained=self._downtrained(grec), pcie_tx_history=tuple(tx), pcie_rx_history=tuple(rx))
            for grec, tx, rx in sorted(self._gpus.values(), key=lambda x: x[0].index)
        )
        requests = []
        for r in self._requests.values():
            if r.end_t is not None and now - r.end_t > self.finished_keep_s:
                continue
            spikes, pre, cause = self.analysis.request_info(r.id) if self.analysis else (0, 0, None)
            cur_gap = None
            if r.end_t is None and r.last_token_t is not None:
                cur_gap = max(0.0, now - r.last_token_t)
            requests.append(
                RequestView(
                    id=r.id, state=r.state, cls=r.cls, source=r.source, tokens=r.tokens,
                    # max(0): a reordered trace can end a request before its first record
                    age_s=round(max(0.0, (r.end_t if r.end_t is not None else now) - r.arrive_t), 3),
                    current_gap_s=cur_gap, max_gap_s=r.max_gap_s, spikes=spikes, preempt_spikes=pre,
                    last_cause=cause,
                )
            )
        analysis = self.analysis.report(now) if self.analysis else None
        return Snapshot(
            kvtop_version=__version__,
            taken_at=datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z"),
            t=now,
            window_s=w,
            gpu_status=self.gpu_status,
            gpus=gpus,
            host=self._host,
            engines=tuple(engines),
            requests=tuple(requests),
            events=tuple(self._events),
            itl_target_s=self.itl_target_s,
            analysis=analysis,
            paused=self.paused,
            source_label=self.source_label,
            host_status=self.host_status,
            capture=self.capture,
        )

    def request_timeline(self, request_id: str) -> RequestTimeline | None:
        """Token times of one request plus engine preemption rises / prompt bursts in its span."""
        r = self._requests.get(request_id)
        if r is None:
            return None
        t0, t1 = r.arrive_t, (r.end_t if r.end_t is not None else self.now)
        return RequestTimeline(
            id=r.id, arrive_t=r.arrive_t, end_t=r.end_t, state=r.state,
            tokens=r.token_times.items(), marks=tuple(r.marks), engine_marks=self.engine_marks(t0, t1),
        )

    def engine_marks(self, t0: float, t1: float) -> tuple[tuple[float, str, float], ...]:
        """Scrape instants in [t0, t1] where any engine's preemption counter rose, or its prompt
        token rate jumped to more than 3x its median over the span (a prefill burst)."""
        out: list[tuple[float, str, float]] = []
        for st in self._engines.values():
            prev: tuple[float, float] | None = None
            for t, v in st.preemptions.items():
                if prev is not None and t0 <= t <= t1 and v > prev[1]:
                    out.append((t, "preemption", v - prev[1]))
                prev = (t, v)
            rates: list[tuple[float, float]] = []
            prev = None
            for t, v in st.prompt.items():
                if prev is not None and t0 <= t <= t1 and t > prev[0] and v >= prev[1]:
                    rates.append((t, (v - prev[1]) / (t - prev[0])))
                prev = (t, v)
            if len(rates) >= 3:
                med = sorted(r for _, r in rates)[len(rates) // 2]
                out.extend((t, "prompt_burst", r) for t, r in rates if r > 3 * med and r > 0)
        out.sort()
        return tuple(out)

    def set_engine_capabilities(self, url: str, preempts: bool) -> None:
        for (u, _), st in self._engines.items():
            if u == url:
                st.preempts = preempts


def _replace(obj: Any, **kw: Any) -> Any:
    import dataclasses

    return dataclasses.replace(obj, **kw)
