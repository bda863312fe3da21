"""The Request detail screen (key 3): one request's token timeline, its spikes with their causes and
the engine events around it. The request is the one opened from the Requests screen, else the one
with the worst gap; the Snapshot carries its timeline (the console asks for ``request_id``)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import VerticalScroll

from kvtop.snapshot import Snapshot
from kvtop.views.tui import render
from kvtop.views.tui.widgets import Panel


class DetailView(VerticalScroll):
    def __init__(self) -> None:
        super().__init__(id="detail")
        self.request_id: str | None = None  # chosen on the Requests screen; None: the worst gap

    def compose(self) -> ComposeResult:
        yield Panel(id="detail-body")

    def update(self, s: Snapshot) -> None:
        tl = s.detail  # the chosen request's, else the worst-gap one's (the core chose)
        rid = self.request_id if self.request_id is not None else (tl.id if tl is not None else None)
        rv = next((r for r in s.requests if r.id == rid), None) if rid else None
        spikes = s.analysis.spikes if s.analysis is not None else ()
        self.query_one("#detail-body", Panel).show(
            lambda w: render.detail(rv, tl, spikes, s.itl_target_s, s.t, w)
        )
