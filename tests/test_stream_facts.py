"""The two folds over one request's records: the Core's request view and gap detection keep their
streams in the same kind of store (kvtop/analysis/streams.py) but count differently, and every
output depends on which count it reads. Each case here is a record sequence on which they differ;
merging the folds changes one side's numbers (a change of results, not of structure)."""

from __future__ import annotations

import pytest

from kvtop.analysis.live import LiveAnalyzer
from kvtop.analysis.streams import Streams
from kvtop.core import Core
from kvtop.model.records import RequestRecord as R
from kvtop.snapshot import RequestView


def _both(recs: list[R]) -> tuple[RequestView, tuple[float | None, float | None, int, float, float | None, str | None]]:
    live = LiveAnalyzer(itl_target_s=0.1)
    core = Core(itl_target_s=0.1, analysis=live, finished_keep_s=1e9)
    for r in recs:
        core.ingest(r)
    (view,) = core.snapshot(now=10.0).requests
    s = live.an.gaps.streams.get("a")
    assert s is not None
    return view, (s.arrive_t, s.end_t, s.tokens, round(s.max_gap, 6), s.last_t, s.cls)


def test_the_silence_before_a_cancel_is_a_gap_to_the_analysis_only() -> None:
    view, (_, end, tokens, max_gap, _, _) = _both([R(0.0, "a", "arrive"), R(1.0, "a", "first_token"),
                                                   R(1.1, "a", "token"), R(3.0, "a", "cancel")])
    assert view.max_gap_s == pytest.approx(0.1) and max_gap == 1.9  # token to token vs up to the cancel
    assert (view.tokens, tokens, view.state, end) == (2, 2, "cancelled", 3.0)


def test_an_event_of_no_tokens_counts_as_one_to_the_analysis() -> None:
    view, (_, _, tokens, _, _, _) = _both([R(0.0, "a", "arrive"), R(1.0, "a", "first_token"),
                                          R(1.1, "a", "token", n=0)])
    assert (view.tokens, tokens) == (1, 2)


def test_a_reordered_token_is_skipped_by_the_view_and_counted_by_the_analysis() -> None:
    view, (_, _, tokens, max_gap, last, _) = _both([R(0.0, "a", "arrive"), R(1.0, "a", "first_token"),
                                                   R(2.0, "a", "token"), R(1.5, "a", "token"), R(2.1, "a", "token")])
    assert (view.tokens, tokens) == (3, 4)
    assert view.current_gap_s == pytest.approx(7.9) and last == 2.1
    assert view.max_gap_s == 1.0 and max_gap == 1.0


def test_the_view_shows_the_latest_end_and_the_analysis_keeps_the_first() -> None:
    view, (_, end, _, max_gap, _, _) = _both([R(0.0, "a", "arrive"), R(1.0, "a", "first_token"),
                                                  R(2.0, "a", "finish"), R(3.0, "a", "error")])
    assert (view.state, view.age_s, end) == ("error", 3.0, 2.0)
    assert view.max_gap_s is None and max_gap == 0.0  # no gap yet: unknown vs zero


def test_arrival_is_the_first_record_to_the_view_and_the_arrive_event_to_the_analysis() -> None:
    view, (arrive, _, _, _, _, cls) = _both([R(0.5, "a", "first_token", cls="x"), R(0.0, "a", "arrive", cls="y")])
    assert (view.cls, view.age_s) == ("x", 9.5)
    assert (arrive, cls) == (0.0, "y")


class _Rec:
    def __init__(self, end_t: float | None = None) -> None:
        self.end_t = end_t


def test_a_full_store_drops_the_oldest_ended_stream_first_else_the_oldest() -> None:
    dropped: list[str] = []
    s: Streams[_Rec] = Streams(max_requests=3, on_drop=dropped.append)
    for rid, end in (("a", None), ("b", 5.0), ("c", None), ("d", None)):
        s.add(rid, _Rec(end))
    assert [k for k in s.by_id] == ["a", "c", "d"] and dropped == ["b"]
    s.add("e", _Rec())
    assert [k for k in s.by_id] == ["c", "d", "e"] and dropped == ["b", "a"]
    s.drop("d")  # its owner is done with it: not an eviction
    assert len(s) == 2 and dropped == ["b", "a"] and s.get("d") is None
