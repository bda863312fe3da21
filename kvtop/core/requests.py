"""Request tracker: the requests on the screens, the summaries of requests that left them, and the
one request event (streams aborted together); derives the RequestViews and a request's timeline
for the detail view.

A request is one record of the per-stream store (``kvtop.analysis.streams``): its facts (tokens,
gaps, end) and its spikes are the analysis's, and its timeline (token chunks, preempt/resume marks,
engine steps, state) is this tracker's part of the same record. With a live analysis the store is
the analysis's and the analysis folds the facts; without one the tracker keeps a store and folds
them itself with the same functions.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvtop.analysis.streams import (
    TIMELINE_MAX_CHUNKS,
    ReqState,
    StreamStore,
    Timeline,
    fold_arrive,
    fold_end,
    fold_resync,
    fold_token,
)
from kvtop.core.events import EventLog
from kvtop.model.records import RequestRecord, StepRecord
from kvtop.model.sanitize import printable
from kvtop.snapshot import RequestTimeline, RequestView

__all__ = ["TIMELINE_MAX_CHUNKS", "FinishedRequest", "RequestTracker"]

# After an incident the worst stalls must stay findable while the charts still show them: of the
# requests that ended and left the screens, the KEEP_WORST with the largest gap stay listed, with
# their timelines, until KEEP_WORST_S (the console's longest chart window) after they ended.
KEEP_WORST = 20
KEEP_WORST_S = 3600.0
ERROR_BURST_S = 1.0
_END_STATE = {"finish": "finished", "cancel": "cancelled", "error": "error"}


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


def _max_gap(r: ReqState) -> float | None:
    """The longest token-to-token gap, None before the second token (as the console shows it)."""
    return r.max_gap if r.max_gap >= 0 else None


def _state(r: ReqState, tl: Timeline) -> str:
    return _END_STATE.get(r.ended_by or "", tl.state) if r.end_t is not None else tl.state


def _summary(r: ReqState, tl: Timeline, target: float | None) -> FinishedRequest:
    ts = tl.chunks.t
    gaps = sorted(b - a for a, b in zip(ts, ts[1:], strict=False))
    over = sum(1 for g in gaps if g > target) if target else 0

    def q(p: float) -> float | None:
        return gaps[min(len(gaps) - 1, int(p * len(gaps)))] if gaps else None

    end = r.end_t if r.end_t is not None else tl.seen_t
    return FinishedRequest(r.id, r.cls, _state(r, tl), r.tokens, tl.seen_t, end, _max_gap(r), over, q(0.5), q(0.99))


class RequestTracker:
    def __init__(self, log: EventLog, itl_target_s: float | None, max_requests: int, finished_keep_s: float,
                 store: StreamStore | None = None,
                 info: Callable[[str], tuple[int, int, str | None]] | None = None):
        """``store``: the live analysis's per-stream store, which then folds the facts; without it the
        tracker keeps its own (at most ``max_requests``). ``info``: (spikes, spikes attributed to
        preemption, last cause) of a request from an analysis that keeps no store."""
        self._log = log
        self.itl_target_s = itl_target_s
        self.max_requests = max_requests
        self.finished_keep_s = finished_keep_s
        self._fold = store is None
        # the oldest ended stream is dropped first when the store is full, else the oldest of all
        self._requests: StreamStore = StreamStore(max_requests) if store is None else store
        self._info = info
        # Requests that ended, in end order; past finished_keep_s they leave the screens and only
        # their summary stays (bounded).
        self._ended: deque[tuple[float, str]] = deque()
        self._finished: deque[FinishedRequest] = deque(maxlen=max_requests)
        self._worst: dict[str, ReqState] = {}  # retired, kept for their stall (KEEP_WORST)
        self.finished_total = 0
        self.gaps_over_target_total = 0
        # Streams ending in error within ERROR_BURST_S of each other: an engine aborting its active
        # requests (llama.cpp's exhausted unified KV cache, an engine crash) -> one event per burst.
        self._error_burst: list[RequestRecord] = []
        self._error_burst_reported = False

    def __len__(self) -> int:
        """Requests held with their timelines (on the screens, or ended and not yet retired)."""
        return sum(1 for r in self._requests if r.timeline is not None and not r.timeline.retired)

    def ingest(self, rec: RequestRecord) -> None:
        if isinstance(rec.cls, str) and not rec.cls.isprintable():
            rec.cls = printable(rec.cls, 80)  # a class name comes from a client's request header
        if not isinstance(rec.id, str):
            rec.id = str(rec.id)  # older simulated traces numbered their requests
        r = self._requests.req(rec.id)
        tl = r.timeline
        if tl is None or tl.retired:
            if tl is not None:
                self._forget_worst(r)
            tl = r.timeline = Timeline(rec.t, rec.source)
        ev = rec.event
        if ev in ("token", "first_token", "resync"):
            chunks = tl.chunks
            if not chunks.t or rec.t >= chunks.t[-1]:  # the detail view draws the chunks in time order
                chunks.append(rec.t, rec.n if rec.n is not None else 1)
            tl.state = "running"
        elif ev == "preempt":
            tl.state = "preempted"
            tl.mark(rec.t, ev)
        elif ev == "resume":
            tl.state = "running"
            tl.mark(rec.t, ev)
        elif ev in _END_STATE:
            if r.end_t is None:
                self._ended.append((rec.t, r.id))
            # a request the server refused (HTTP 4xx before any token: a bad request, too long a
            # prompt) is the client's error, no sign that the engine dropped what it was running
            if ev == "error" and not (isinstance(rec.status, int) and 400 <= rec.status < 500 and not r.tokens):
                self._note_error(rec)
        if self._fold:
            k = rec.n if rec.n else 1
            if ev in ("token", "first_token"):
                fold_token(r, rec.t, k)
            elif ev == "resync":
                fold_resync(r, rec.t, k)
            elif ev == "arrive":
                fold_arrive(r, rec.t, rec.cls)
            elif ev in _END_STATE:
                fold_end(r, rec.t, ev)
        ended = self._ended
        if ended and rec.t - ended[0][0] > self.finished_keep_s:
            self.retire(rec.t)

    def engine_step(self, rec: StepRecord) -> None:
        """A witness step: each held request's part in it, and its preemptions and resumptions as marks."""
        for r in rec.reqs:
            tl = self._timeline(str(r[0]))
            if tl is not None:
                tl.steps.append((rec.t, rec.end, "r" if r[3] else ("p" if r[2] else "d")))
        for rid in rec.preempted:
            tl = self._timeline(rid)
            if tl is not None:
                tl.mark(rec.t, "preempt")
        for rid in rec.resumed:
            tl = self._timeline(rid)
            if tl is not None:
                tl.mark(rec.t, "resume")

    def _timeline(self, rid: str) -> Timeline | None:
        r = self._requests.get(rid)
        tl = r.timeline if r is not None else None
        return tl if tl is not None and not tl.retired else None

    def retire(self, now: float) -> None:
        """Requests that ended more than finished_keep_s ago leave the screens: keep their summary."""
        ended, target = self._ended, self.itl_target_s
        while ended and now - ended[0][0] > self.finished_keep_s:
            _t, rid = ended.popleft()
            r = self._requests.get(rid)
            tl = r.timeline if r is not None else None
            if r is None or tl is None or tl.retired or r.end_t is None:
                continue  # trimmed already, or an id that started again
            tl.retired = True
            if self._fold:
                self._requests.drop(rid)  # nobody else reads this store
            s = _summary(r, tl, target)
            self._finished.append(s)
            self.finished_total += 1
            self.gaps_over_target_total += s.gaps_over_target
            if not self._keep_if_worst(r, now):
                r.timeline = None

    def _keep_if_worst(self, r: ReqState, now: float) -> bool:
        """Keep a retired request while it is among the KEEP_WORST largest gaps of the last
        KEEP_WORST_S; a request with a gap over the target only, when there is a target."""
        worst = self._worst
        for w in [w for w in worst.values() if now - (w.end_t or 0.0) > KEEP_WORST_S]:
            self._forget_worst(w)
        gap = _max_gap(r)
        if gap is None or (self.itl_target_s is not None and gap <= self.itl_target_s):
            return False
        if len(worst) >= KEEP_WORST:
            least = min(worst.values(), key=lambda w: (_max_gap(w) or 0.0, w.id))
            if (_max_gap(least) or 0.0) >= gap:
                return False
            self._forget_worst(least)
        worst[r.id] = r
        return True

    def _forget_worst(self, w: ReqState) -> None:
        if self._worst.get(w.id) is w:
            del self._worst[w.id]
        if w.timeline is not None and w.timeline.retired:
            w.timeline = None

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

    def views(self, now: float) -> tuple[RequestView, ...]:
        """The requests on the screens at ``now``, and the retired ones kept for their stall."""
        out = []
        store = self._requests
        kept = [w for w in self._worst.values()
                if store.get(w.id) in (None, w) and now - (w.end_t or 0.0) <= KEEP_WORST_S]
        listed = [r for r in store if r.timeline is not None and not r.timeline.retired]
        info = self._info
        for r in [*listed, *kept]:
            tl = r.timeline
            assert tl is not None
            is_kept = r.end_t is not None and now - r.end_t > self.finished_keep_s
            if is_kept and r.id not in self._worst:
                continue
            spikes, pre, cause = info(r.id) if info is not None else (r.spikes, r.preempt_spikes, r.last_cause)
            cur_gap = None
            if r.end_t is None and r.last_t is not None:
                cur_gap = max(0.0, now - r.last_t)
            out.append(
                RequestView(
                    id=r.id, state=_state(r, tl), cls=r.cls, source=tl.source, tokens=r.tokens,
                    # max(0): a reordered trace can end a request before its first record
                    age_s=round(max(0.0, (r.end_t if r.end_t is not None else now) - tl.seen_t), 3),
                    current_gap_s=cur_gap, max_gap_s=_max_gap(r), spikes=spikes, preempt_spikes=pre,
                    last_cause=cause, kept=is_kept,
                )
            )
        return tuple(out)

    def timeline(self, request_id: str, now: float,
                 engine_marks: Callable[[float, float], tuple[tuple[float, str, float], ...]]) -> RequestTimeline | None:
        """Token times of one request plus the engine marks in its span (up to ``now`` while it runs)."""
        r = self._requests.get(request_id)
        if r is None or r.timeline is None or (r.timeline.retired and self._worst.get(request_id) is not r):
            r = self._worst.get(request_id)
        if r is None or r.timeline is None:
            return None
        tl = r.timeline
        t0, t1 = tl.seen_t, (r.end_t if r.end_t is not None else now)
        return RequestTimeline(
            id=r.id, arrive_t=tl.seen_t, end_t=r.end_t, state=_state(r, tl),
            tokens=tl.chunks.items(), marks=tuple(tl.marks), engine_marks=engine_marks(t0, t1),
            steps=tuple(tl.steps),
        )
