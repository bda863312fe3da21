"""The core's derived facts that every front end shares: verdict changes logged by the core (not by
the console), and the Snapshot carrying the console's chart window and the selected request's
timeline, so a view needs nothing but the Snapshot."""

from __future__ import annotations

import pytest

from kvtop.core import Core
from kvtop.model.analysis import AnalysisCounters, AnalysisReport, Verdict
from kvtop.model.records import EngineRecord, Record, RequestRecord

URL = "http://engine:8000"


class _Advisor:
    """A live analysis whose verdict a test sets."""

    streams = None  # keeps no per-stream store

    def __init__(self) -> None:
        self.verdict: Verdict | None = None

    def feed(self, rec: Record) -> None:
        return None

    def request_info(self, request_id: str) -> tuple[int, int, str | None]:
        return 0, 0, None

    def report(self, now: float) -> AnalysisReport:
        return AnalysisReport(verdict=self.verdict)

    def counters(self) -> AnalysisCounters:
        return AnalysisCounters({}, {}, 0)

    def lag(self, now: float) -> float:
        return 0.0

    def fresh(self) -> _Advisor:
        return _Advisor()


def test_a_changed_verdict_is_an_event_of_the_core_whoever_takes_the_snapshots():
    advisor = _Advisor()
    core = Core(analysis=advisor)
    core.ingest(EngineRecord(t=5.0, url=URL, adapter="vllm", kv_usage=0.5))
    assert core.snapshot().events == ()  # no verdict yet
    advisor.verdict = Verdict("swap", confidence=0.8)
    assert core.snapshot().events == ()  # the first verdict is not a change
    advisor.verdict = Verdict("recompute", confidence=0.61)
    core.ingest(EngineRecord(t=9.0, url=URL, adapter="vllm", kv_usage=0.5))
    (ev,) = core.snapshot().events  # the snapshot that sees the change already lists it
    assert (ev.t, ev.severity, ev.kind) == (9.0, "info", "verdict_change")
    assert ev.message == "advisor: swap -> recompute (confidence 61%)"
    assert len(core.snapshot().events) == 1  # unchanged since: nothing more
    advisor.verdict = Verdict("swap", confidence=0.8)
    assert [e.message for e in core.snapshot(now=12.0).events][-1] == "advisor: recompute -> swap (confidence 80%)"


def _engine_and_requests() -> Core:
    core = Core(itl_target_s=0.1)
    for t in range(101):
        # preemptions rise once, at t=80
        core.ingest(EngineRecord(t=float(t), url=URL, adapter="vllm", kv_usage=t / 100,
                                 preemptions_total=0.0 if t < 80 else 3.0, prompt_tokens_total=100.0 * t))
    for rid, t0, gap in (("a", 70.0, 0.05), ("b", 75.0, 2.0)):
        core.ingest(RequestRecord(t0, rid, "arrive"))
        core.ingest(RequestRecord(t0 + 0.5, rid, "first_token"))
        core.ingest(RequestRecord(t0 + 0.5 + gap, rid, "token"))
        core.ingest(RequestRecord(t0 + 20.0, rid, "finish"))
    return core


def test_the_snapshot_carries_the_chart_window_the_console_asks_for_as_its_own_copy():
    core = _engine_and_requests()
    plain = core.snapshot()
    assert plain.history is None and plain.detail is None  # headless snapshots carry neither
    s = core.snapshot(history_s=30.0)
    assert s.history is not None
    kv = s.history.engine_series(URL, None)["kv_usage"]
    # the window [70, 100] plus the three samples before it that "latest value" may look back to
    assert list(kv.t) == [float(t) for t in range(67, 101)]
    assert kv.last() == 1.0 and kv.columns(70.0, 100.0, 3) == pytest.approx([0.79, 0.89, 1.0])  # column peaks
    whole = core.history.engine_series(URL, None)["kv_usage"]
    assert kv.origin == whole.origin and kv is not whole  # the same series, copied
    core.ingest(EngineRecord(t=101.0, url=URL, adapter="vllm", kv_usage=0.25))
    assert kv.t[-1] == 100.0 and whole.t[-1] == 101.0  # the snapshot does not move on
    assert s.history.host["pinned_bytes"].last() is None and s.history.gpus == {}


def test_the_snapshot_carries_the_selected_request_timeline_else_the_worst_one():
    core = _engine_and_requests()
    worst = core.snapshot(timeline=True).detail
    assert worst is not None and worst.id == "b"  # its 2 s gap is the worst
    assert [t for t, _n in worst.tokens] == [75.5, 77.5]
    assert (worst.arrive_t, worst.end_t, worst.state) == (75.0, 95.0, "finished")
    # the preemption rise at t=80 falls inside its span [75, 95]
    assert (80.0, "preemption", 3.0) in worst.engine_marks
    chosen = core.snapshot(timeline=True, request_id="a").detail
    assert chosen is not None and chosen.id == "a" and chosen.tokens == ((70.5, 1), (70.55, 1))
    assert core.snapshot(timeline=True, request_id="gone").detail is None
    assert core.snapshot(request_id="a").detail is None  # only when asked
