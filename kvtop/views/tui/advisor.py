"""The Advisor screen (key 4): the verdict, the numbers behind it, the settings to change and what
would change it."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import VerticalScroll

from kvtop.snapshot import Snapshot
from kvtop.views.tui import render
from kvtop.views.tui.widgets import Panel


class AdvisorView(VerticalScroll):
    def __init__(self) -> None:
        super().__init__(id="advisor")

    def compose(self) -> ComposeResult:
        yield Panel(id="advisor-body")

    def update(self, s: Snapshot) -> None:
        self.query_one("#advisor-body", Panel).show(lambda w: render.advisor(s, w))
