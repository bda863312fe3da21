"""Each console view is a widget that renders a Snapshot and nothing else: mounted alone in a bare
app and handed one snapshot (``update``), it shows what the console would, with its own state."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

pytest.importorskip("textual")

from textual.app import App, ComposeResult  # noqa: E402
from textual.widget import Widget  # noqa: E402
from tui_support import RENDER_VERDICT, screen_text  # noqa: E402

from kvtop.feeds.sample import FIXED_TAKEN_AT, sample  # noqa: E402
from kvtop.snapshot import Snapshot  # noqa: E402
from kvtop.views.tui.advisor import AdvisorView  # noqa: E402
from kvtop.views.tui.charts import Chart  # noqa: E402
from kvtop.views.tui.detail import DetailView  # noqa: E402
from kvtop.views.tui.events import EventsView  # noqa: E402
from kvtop.views.tui.overview import OverviewView  # noqa: E402
from kvtop.views.tui.requests import RequestsView  # noqa: E402
from kvtop.views.tui.widgets import Cells  # noqa: E402


class One(App[None]):
    """A bare app holding one view: nothing but the snapshot handed to ``update`` feeds it."""

    def __init__(self, make: Callable[[One], Widget]) -> None:
        super().__init__()
        self.cells = Cells(lambda: self.theme_variables)
        self._make = make

    def compose(self) -> ComposeResult:
        yield self._make(self)


def _snap(**kw: object) -> Snapshot:
    s = sample(verdict=RENDER_VERDICT)
    return dataclasses.replace(s.core.snapshot(history_s=3600.0, **kw), taken_at=FIXED_TAKEN_AT)


async def test_requests_view_sorts_and_filters_the_snapshots_requests():
    snap = _snap()
    app = One(lambda a: RequestsView(a.cells))
    async with app.run_test(size=(120, 40)) as pilot:
        view = app.query_one(RequestsView)
        view.update(snap)
        await pilot.pause()
        table = view.query_one("#req-table")
        assert table.row_count == len(snap.requests) > 10
        worst = max(snap.requests, key=lambda r: (r.max_gap_s or 0.0, r.id))
        assert table.get_row_at(0)[0].plain == worst.id  # worst gap first
        view.cycle_sort()  # max_gap -> the next column
        view.update(snap)
        assert view.sort_col != "max_gap"
        view.filter_text = "batch"
        view.update(snap)
        assert table.row_count == sum(1 for r in snap.requests if r.cls == "batch") > 0
        assert "filter: batch" in screen_text(app)


async def test_detail_view_shows_the_timeline_the_snapshot_carries():
    snap = _snap(timeline=True)
    assert snap.detail is not None
    app = One(lambda a: DetailView())
    async with app.run_test(size=(120, 40)) as pilot:
        view = app.query_one(DetailView)
        view.update(snap)
        await pilot.pause()
        text = screen_text(app)
        assert snap.detail.id in text  # no request chosen: the snapshot's worst-gap request
        view.request_id = "no-such-request"
        view.update(_snap(timeline=True, request_id="no-such-request"))
        await pilot.pause()
        assert snap.detail.id not in screen_text(app)


async def test_overview_advisor_and_events_views_render_one_snapshot():
    snap = _snap()
    app = One(lambda a: OverviewView(interval=1.0, replay=False))
    async with app.run_test(size=(160, 45)) as pilot:
        view = app.query_one(OverviewView)
        view.update(snap)
        await pilot.pause()
        # one engine: KV, ITL, preemptions, queue, TTFT, tokens; two GPUs: memory, PCIe; the host
        assert len(app.query(Chart)) == 6 + 2 * 2 + 1
        assert "GPU0" in screen_text(app)
        assert view.cycle_window() == 900.0
    app = One(lambda a: AdvisorView())
    async with app.run_test(size=(120, 40)) as pilot:
        app.query_one(AdvisorView).update(snap)
        await pilot.pause()
        assert "swap" in screen_text(app)
    app = One(lambda a: EventsView(a.cells))
    async with app.run_test(size=(120, 40)) as pilot:
        view = app.query_one(EventsView)
        view.update(snap)
        await pilot.pause()
        assert view.query_one("#ev-table").row_count == len(snap.events) > 0
        view.filter_text = "link"
        view.update(snap)
        assert view.query_one("#ev-table").row_count == 1  # the sample's one down-trained link


def test_a_tentative_verdict_says_so_on_the_overview_and_the_advisor() -> None:
    from kvtop.views.tui.render import advisor, summary_line

    snap = _snap()
    assert snap.analysis is not None and snap.analysis.verdict is not None
    firm = snap.analysis.verdict
    assert "TENTATIVE" not in advisor(snap, 120) and "tentative" not in summary_line(snap)
    low = dataclasses.replace(firm, confidence=0.42, tentative=True,
                              reasons=("tentative: confidence 0.42 < 0.5; a longer recording would confirm it",
                                       *firm.reasons))
    snap = dataclasses.replace(snap, analysis=dataclasses.replace(snap.analysis, verdict=low))
    head = advisor(snap, 120).splitlines()[0]
    assert "confidence 42%" in head and "TENTATIVE" in head
    assert "tentative" in summary_line(snap) and "42%" in summary_line(snap)
    assert "a longer recording would confirm it" in advisor(snap, 120)
