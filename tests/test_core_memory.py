"""Finished requests leave the core with a compact summary, so memory stays flat on long runs."""

from __future__ import annotations

from kvtop.core import TIMELINE_MAX_CHUNKS, Core
from kvtop.model.records import RequestRecord


def _stream(core: Core, rid: str, t0: float, gaps: list[float], end: str = "finish") -> float:
    core.ingest(RequestRecord(t0, rid, "arrive", cls="chat"))
    t = t0 + 0.2
    core.ingest(RequestRecord(t, rid, "first_token"))
    for g in gaps:
        t += g
        core.ingest(RequestRecord(t, rid, "token"))
    core.ingest(RequestRecord(t, rid, end))
    return t


def test_a_finished_request_keeps_its_timeline_while_on_screen_then_only_a_summary():
    core = Core(itl_target_s=0.1, finished_keep_s=30.0)
    gaps = [0.02] * 50 + [0.08, 0.05] + [0.02] * 47  # never over the 0.1 s target
    end = _stream(core, "r1", 0.0, gaps)
    # on screen: the detail view can still draw it
    assert [r.id for r in core.snapshot().requests] == ["r1"]
    tl = core.request_timeline("r1")
    assert tl is not None and len(tl.tokens) == 100
    # 31 s after it ended another request's record arrives: r1 leaves the screens and the core
    _stream(core, "r2", end + 31.0, [0.02] * 3)
    assert [r.id for r in core.snapshot().requests] == ["r2"]
    assert core.request_timeline("r1") is None
    (s,) = core.finished_requests()
    assert (s.id, s.cls, s.state, s.tokens) == ("r1", "chat", "finished", 100)
    assert s.gaps_over_target == 0 and abs(s.max_gap_s - 0.08) < 1e-9
    assert abs(s.gap_p50_s - 0.02) < 1e-9 and abs(s.gap_p99_s - 0.08) < 1e-9
    assert core.finished_total == 1 and core.gaps_over_target_total == 0


def test_a_finished_request_that_stalled_stays_listed_with_its_timeline():
    core = Core(itl_target_s=0.1, finished_keep_s=30.0)
    end = _stream(core, "r1", 0.0, [0.02] * 50 + [0.5, 0.3] + [0.02] * 47)
    _stream(core, "r2", end + 31.0, [0.02] * 3)
    # one of the worst stalls of the last hour: still listed (kept), the detail view can draw it
    assert [(r.id, r.kept) for r in core.snapshot().requests] == [("r2", False), ("r1", True)]
    tl = core.request_timeline("r1")
    assert tl is not None and len(tl.tokens) == 100
    (s,) = core.finished_requests()  # and summarised like any ended request
    assert s.id == "r1" and s.gaps_over_target == 2 and s.max_gap_s == 0.5
    assert core.finished_total == 1 and core.gaps_over_target_total == 2


def test_summaries_are_bounded_and_live_timelines_keep_the_last_chunks():
    core = Core(itl_target_s=0.1, max_requests=50, finished_keep_s=1.0)
    t = 0.0
    for i in range(200):
        t = _stream(core, f"r{i}", t + 2.0, [0.01] * 5, end="cancel" if i % 2 else "finish")
    core.snapshot()
    assert len(core.finished_requests()) == 50
    assert core.finished_total == 199  # the last one is still on screen
    assert len(core.requests) == 1
    assert {s.state for s in core.finished_requests()} == {"finished", "cancelled"}
    # a very long live stream: its timeline holds the newest TIMELINE_MAX_CHUNKS chunks
    core.ingest(RequestRecord(t + 5, "long", "arrive"))
    for k in range(3 * TIMELINE_MAX_CHUNKS):
        core.ingest(RequestRecord(t + 5 + k * 0.01, "long", "token"))
    tl = core.request_timeline("long")
    assert tl is not None and len(tl.tokens) == TIMELINE_MAX_CHUNKS
    assert tl.tokens[-1][0] == t + 5 + (3 * TIMELINE_MAX_CHUNKS - 1) * 0.01
