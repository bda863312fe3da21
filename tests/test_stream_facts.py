"""The facts of one request's records have one fold (kvtop/analysis/streams.py) and one store: the
Core's request view reads the live analysis's record of the stream, and a Core without analysis
folds its own with the same functions. Each case is a record sequence where the two used to count
differently; now the console (with and without analysis) and the analysis say the same."""

from __future__ import annotations

import pytest

from kvtop.analysis.live import LiveAnalyzer
from kvtop.analysis.streams import Streams
from kvtop.core import Core
from kvtop.model.records import RequestRecord as R
from kvtop.snapshot import RequestView


def _both(recs: list[R]) -> tuple[RequestView, tuple[float | None, float | None, int, float, float | None, str | None]]:
    """The request view with the analysis, (the same without analysis), and the analysis's facts."""
    live = LiveAnalyzer(itl_target_s=0.1)
    core = Core(itl_target_s=0.1, analysis=live, finished_keep_s=1e9)
    alone = Core(itl_target_s=0.1, finished_keep_s=1e9)
    for r in recs:
        core.ingest(R(**{k: getattr(r, k) for k in ("t", "id", "event", "n", "cls")}))
        alone.ingest(r)
    (view,) = core.snapshot(now=10.0).requests
    (own,) = alone.snapshot(now=10.0).requests
    assert own == view  # the same facts with or without the analysis
    s = live.an.gaps.streams.get("a")
    assert s is not None and s.timeline is not None  # one record: the view's timeline sits in the analysis's store
    return view, (s.arrive_t, s.end_t, s.tokens, round(s.longest_silence(), 6), s.last_t, s.cls)


def test_the_silence_before_a_cancel_is_the_requests_longest_wait_not_an_inter_token_gap() -> None:
    view, (_, end, tokens, longest, _, _) = _both([R(0.0, "a", "arrive"), R(1.0, "a", "first_token"),
                                                   R(1.1, "a", "token"), R(3.0, "a", "cancel")])
    assert view.max_gap_s == pytest.approx(0.1) and longest == 1.9  # token to token; up to the cancel
    assert (view.tokens, tokens, view.state, end) == (2, 2, "cancelled", 3.0)


def test_an_event_of_no_tokens_counts_as_one() -> None:
    view, (_, _, tokens, _, _, _) = _both([R(0.0, "a", "arrive"), R(1.0, "a", "first_token"),
                                          R(1.1, "a", "token", n=0)])
    assert view.tokens == tokens == 2


def test_a_reordered_token_is_counted_and_is_no_gap() -> None:
    view, (_, _, tokens, longest, last, _) = _both([R(0.0, "a", "arrive"), R(1.0, "a", "first_token"),
                                                   R(2.0, "a", "token"), R(1.5, "a", "token"),
                                                   R(2.1, "a", "token")])
    assert view.tokens == tokens == 4
    assert last == 2.1 and view.current_gap_s == pytest.approx(7.9)
    assert view.max_gap_s == longest == 1.0


def test_the_first_end_is_the_end() -> None:
    view, (_, end, _, longest, _, _) = _both([R(0.0, "a", "arrive"), R(1.0, "a", "first_token"),
                                              R(2.0, "a", "finish"), R(3.0, "a", "error")])
    assert (view.state, view.age_s, end) == ("finished", 2.0, 2.0)
    assert view.max_gap_s is None and longest == 0.0  # no gap yet: the view says unknown, the row zero


def test_the_console_dates_a_request_from_its_first_record_and_the_class_is_the_arrivals() -> None:
    view, (arrive, _, _, _, _, cls) = _both([R(0.5, "a", "first_token", cls="x"), R(0.0, "a", "arrive", cls="y")])
    assert view.age_s == 9.5 and arrive == 0.0  # seen first at 0.5; the arrive event says 0.0
    assert view.cls == cls == "y"


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
