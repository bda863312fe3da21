"""Request tracker: per-request state from RequestRecords (tokens, gaps, preempt/resume marks), the
summaries of requests that left the screens, and the one request event (streams aborted
together); derives the RequestViews and a request's timeline for the detail view.

Its requests sit in a per-stream store of the kind gap detection keeps its streams in
(``kvtop.analysis.streams.Streams``: same order, cap and eviction). The spikes of a request and
their last cause are the analysis's, read from its store when the views are derived; tokens, gaps
and end times are this fold's own: they count what a client saw, in order (that module says why the
analysis counts differently).
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtop.analysis.streams import Streams
from kvtop.core.events import EventLog
from kvtop.model.records import RequestRecord, StepRecord
from kvtop.model.sanitize import printable
from kvtop.snapshot import RequestTimeline, RequestView

TIMELINE_MAX_CHUNKS = 1024
# After an incident the worst stalls must stay findable while the charts still show them: of the
# requests that ended and left the screens, the KEEP_WORST with the largest gap stay listed, with
# their timelines, until KEEP_WORST_S (the console's longest chart window) after they ended.
KEEP_WORST = 20
KEEP_WORST_S = 3600.0
MAX_MARKS = 256
ERROR_BURST_S = 1.0


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
    steps: deque[tuple[float, float, str]] = field(default_factory=lambda: deque(maxlen=TIMELINE_MAX_CHUNKS))

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


class RequestTracker:
    def __init__(self, log: EventLog, itl_target_s: float | None, max_requests: int, finished_keep_s: float):
        self._log = log
        self.itl_target_s = itl_target_s
        self.max_requests = max_requests
        self.finished_keep_s = finished_keep_s
        # at most max_requests: the oldest ended request is dropped first, else the oldest of all
        self._requests: Streams[_RequestState] = Streams(max_requests)
        # Requests that ended, in end order; past finished_keep_s they leave the screens and
        # ``_requests`` and only their summary stays (bounded).
        self._ended: deque[tuple[float, str]] = deque()
        self._finished: deque[FinishedRequest] = deque(maxlen=max_requests)
        self._worst: dict[str, _RequestState] = {}  # retired, kept for their stall (KEEP_WORST)
        self._kept_info: dict[str, tuple[int, int, str | None]] = {}  # their spikes, as the analysis last said
        self.finished_total = 0
        self.gaps_over_target_total = 0
        # Streams ending in error within ERROR_BURST_S of each other: an engine aborting its active
        # requests (llama.cpp's exhausted unified KV cache, an engine crash) -> one event per burst.
        self._error_burst: list[RequestRecord] = []
        self._error_burst_reported = False

    def __len__(self) -> int:
        """Requests held with their timelines (on the screens, or ended and not yet retired)."""
        return len(self._requests)

    def ingest(self, rec: RequestRecord) -> None:
        if isinstance(rec.cls, str) and not rec.cls.isprintable():
            rec.cls = printable(rec.cls, 80)  # a class name comes from a client's request header
        if not isinstance(rec.id, str):
            rec.id = str(rec.id)  # older simulated traces numbered their requests
        r = self._requests.get(rec.id)
        if r is None:
            r = self._requests.add(rec.id, _RequestState(rec.id, rec.t, rec.cls, rec.source))
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
            self.retire(rec.t)

    def engine_step(self, rec: StepRecord) -> None:
        """A witness step: each held request's part in it, and its preemptions and resumptions as marks."""
        for r in rec.reqs:
            st = self._requests.get(str(r[0]))
            if st is not None:
                st.steps.append((rec.t, rec.end, "r" if r[3] else ("p" if r[2] else "d")))
        for rid in rec.preempted:
            st = self._requests.get(rid)
            if st is not None:
                st.mark(rec.t, "preempt")
        for rid in rec.resumed:
            st = self._requests.get(rid)
            if st is not None:
                st.mark(rec.t, "resume")

    def retire(self, now: float) -> None:
        """Requests that ended more than finished_keep_s ago leave the screens: keep their summary."""
        ended, target = self._ended, self.itl_target_s
        while ended and now - ended[0][0] > self.finished_keep_s:
            _t, rid = ended.popleft()
            r = self._requests.get(rid)
            if r is None or r.end_t is None:
                continue  # trimmed already, or an id that started again
            self._requests.drop(rid)
            s = r.summary(target)
            self._finished.append(s)
            self.finished_total += 1
            self.gaps_over_target_total += s.gaps_over_target
            self._keep_if_worst(r, now)

    def _keep_if_worst(self, r: _RequestState, now: float) -> None:
        """Keep a retired request while it is among the KEEP_WORST largest gaps of the last
        KEEP_WORST_S; a request with a gap over the target only, when there is a target."""
        worst = self._worst
        for rid in [k for k, w in worst.items() if now - (w.end_t or 0.0) > KEEP_WORST_S]:
            del worst[rid]
            self._kept_info.pop(rid, None)
        gap = r.max_gap_s
        if gap is None or (self.itl_target_s is not None and gap <= self.itl_target_s):
            return
        if len(worst) >= KEEP_WORST:
            least = min(worst.values(), key=lambda w: (w.max_gap_s or 0.0, w.id))
            if (least.max_gap_s or 0.0) >= gap:
                return
            del worst[least.id]
            self._kept_info.pop(least.id, None)
        worst[r.id] = r

    def finished(self) -> tuple[FinishedRequest, ...]:
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
            self._log.add(rec.t, "error", "requests_aborted",
                          f"{len(burst)}+ streams ended in error together ({', '.join(kinds)}): the engine aborted "
                          "its active requests")

    def views(self, now: float, info: Callable[[str], tuple[int, int, str | None]] | None) -> tuple[RequestView, ...]:
        """The requests on the screens at ``now``; ``info`` gives a request's (spikes, spikes
        attributed to preemption, last cause) from the analysis."""
        out = []
        kept = [w for w in self._worst.values() if self._requests.get(w.id) is None and now - (w.end_t or 0.0) <= KEEP_WORST_S]
        for r in [*self._requests, *kept]:
            is_kept = r.end_t is not None and now - r.end_t > self.finished_keep_s
            if is_kept and r.id not in self._worst:
                continue
            got = info(r.id) if info is not None else (0, 0, None)
            if is_kept:
                # the analysis may forget an ended stream before this list does: its last answer stays
                if got == (0, 0, None):
                    got = self._kept_info.get(r.id, got)
                else:
                    self._kept_info[r.id] = got
            spikes, pre, cause = got
            cur_gap = None
            if r.end_t is None and r.last_token_t is not None:
                cur_gap = max(0.0, now - r.last_token_t)
            out.append(
                RequestView(
                    id=r.id, state=r.state, cls=r.cls, source=r.source, tokens=r.tokens,
                    # max(0): a reordered trace can end a request before its first record
                    age_s=round(max(0.0, (r.end_t if r.end_t is not None else now) - r.arrive_t), 3),
                    current_gap_s=cur_gap, max_gap_s=r.max_gap_s, spikes=spikes, preempt_spikes=pre,
                    last_cause=cause, kept=is_kept,
                )
            )
        return tuple(out)

    def timeline(self, request_id: str, now: float,
                 engine_marks: Callable[[float, float], tuple[tuple[float, str, float], ...]]) -> RequestTimeline | None:
        """Token times of one request plus the engine marks in its span (up to ``now`` while it runs)."""
        r = self._requests.get(request_id) or self._worst.get(request_id)
        if r is None:
            return None
        t0, t1 = r.arrive_t, (r.end_t if r.end_t is not None else now)
        return RequestTimeline(
            id=r.id, arrive_t=r.arrive_t, end_t=r.end_t, state=r.state,
            tokens=r.token_times.items(), marks=tuple(r.marks), engine_marks=engine_marks(t0, t1),
            steps=tuple(r.steps),
        )
