"""The Events screen (key 5): the core's event log, newest first (preemption bursts, engines down
and up, restarts, source errors, verdict changes); the console's filter box narrows it."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.markup import escape
from textual.widgets import DataTable, Static

from kvtop.snapshot import EventView, Snapshot
from kvtop.views.tui import render
from kvtop.views.tui.widgets import Cells


class EventsView(Vertical):
    def __init__(self, cells: Cells):
        super().__init__(id="events")
        self._cells = cells
        self.filter_text = ""
        self._shown: tuple[int, EventView | None, str] | None = None  # what the table holds: rebuilt only on change

    def compose(self) -> ComposeResult:
        ev: DataTable[Text] = DataTable(id="ev-table", cursor_type="row", zebra_stripes=True)
        ev.add_column("t", key="t")
        ev.add_column("severity", key="severity")
        ev.add_column("kind", key="kind")
        ev.add_column("message", key="message")
        yield Static(id="ev-status")  # the filter is the console's: say here too that it narrows the list
        yield ev

    def reset(self) -> None:
        """Rebuild the table on the next update (new cells: a theme change, another core)."""
        self._shown = None

    def update(self, s: Snapshot) -> None:
        table = self.query_one("#ev-table", DataTable)
        evs: list[EventView] = [e for e in s.events
                                if render.words_match(f"{e.kind} {e.severity} {e.message}", self.filter_text)]
        key = (len(s.events), s.events[-1] if s.events else None, self.filter_text)
        if key == self._shown:
            return
        self._shown = key
        flt = f"  filter: [b]{escape(self.filter_text)}[/b] (esc clears)" if self.filter_text else ""
        self.query_one("#ev-status", Static).update(f"{len(evs)} of {len(s.events)} events{flt}")
        # events change rarely and are bounded (500); newest first so 80x24 shows what just happened
        table.clear()
        for e in reversed(evs):
            sev = {"warning": "warn", "error": "crit"}.get(e.severity, "ok")
            table.add_row(*[self._cells(c) for c in (f"{e.t:8.1f}s", render.sev(e.severity, sev),
                                                     escape(e.kind), escape(e.message))])
