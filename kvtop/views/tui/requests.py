"""The Requests screen (key 2): every request on screen as a table, worst gap first; sortable,
filterable; ``enter`` (or a row clicked twice) opens one on the detail screen."""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.markup import escape
from textual.widgets import Static

from kvtop.snapshot import RequestView, Snapshot
from kvtop.views.tui import render
from kvtop.views.tui.table import RowTable
from kvtop.views.tui.widgets import Cells


class RequestsView(Vertical):
    """``update(snapshot)`` each tick. Holds the sort, the filter (the console's filter box sets
    it) and the rows' cells, so a row keeps its cells while its markup is unchanged."""

    KEYS: ClassVar[tuple[Binding, ...]] = (
        Binding("s", "cycle_sort", "Sort"),
        Binding("r", "reverse_sort", "Reverse", show=False),
    )

    def __init__(self, cells: Cells):
        super().__init__(id="requests")
        self._cells = cells
        self.sort_col = "max_gap"
        self.sort_reverse = True
        self.filter_text = ""
        self._snap: Snapshot | None = None
        # request id -> (the RequestView, its cell markup, its cells): a row keeps its cells object
        # while its markup is unchanged, so the table reuses the painted line
        self._cache: dict[str, tuple[RequestView, tuple[str, ...], tuple[Text, ...]]] = {}
        self._rows: dict[str, RequestView] = {}
        self._target: float | None = None

    def compose(self) -> ComposeResult:
        yield Static("", id="req-status")
        yield RowTable(render.COLUMNS, self.request_cells, id="req-table")

    def reset(self) -> None:
        """New cell objects: the table repaints every row from them on the next update (and keeps
        its cursor on the same request)."""
        self._cache = {}

    def update(self, s: Snapshot) -> None:
        """Hand the table the rows in sort order; it asks for the cells of the rows it paints."""
        self._snap = s
        table = self.query_one("#req-table", RowTable)
        self._target = s.itl_target_s
        rows = [r for r in s.requests if render.matches(r, self.filter_text)]
        want = {r.id: r for r in rows}
        self._rows = want
        cache = self._cache
        for k in [k for k in cache if k not in want]:
            del cache[k]
        for r in rows:
            if r.id not in cache:
                table.fit(self.request_cells(r.id))  # columns fit every row, as it arrives
        # the id breaks ties so equal rows do not swap between ticks (two stable sorts: no key tuples)
        rows.sort(key=render.SORT_KEYS["id"], reverse=self.sort_reverse)
        rows.sort(key=render.SORT_KEYS[self.sort_col], reverse=self.sort_reverse)
        table.set_rows([r.id for r in rows])
        for k in table.visible_keys():
            table.fit(self.request_cells(k))
        self.update_headers()
        self._hide_columns()
        shown, total = len(rows), len(s.requests)
        kept = sum(1 for r in s.requests if r.kept)
        flt = f"  filter: [b]{escape(self.filter_text)}[/b]" if self.filter_text else ""
        label = dict(render.COLUMNS)[self.sort_col]
        width = (self.size.width or self.app.size.width) - 2
        self.query_one("#req-status", Static).update(
            render.fit_line([(f"{shown} of {total} requests{flt}", 0),
                             (render.muted(f"* {kept} ended, kept as the hour's worst stalls") if kept else "", 1),
                             (render.muted("sort: " + label + (" ▼" if self.sort_reverse else " ▲")), 2),
                             (render.muted("enter: detail · s: sort · r: reverse · /: filter"), 3)], width),
            layout=False,
        )

    def _hide_columns(self) -> None:
        """Hide the columns a narrow terminal can spare (render.DROP_FIRST, in order) until the
        rest fit; the sort column always shows."""
        table = self.query_one("#req-table", RowTable)
        room = table.scrollable_content_region.width or self.app.size.width
        widths = table.column_widths()
        optional = [k for k in render.DROP_FIRST if k != self.sort_col]
        need = sum(w + 2 for k, w in widths.items() if k not in optional)
        hidden: list[str] = []
        for key in reversed(optional):  # the most telling spare column first, while it fits
            if need + widths[key] + 2 <= room:
                need += widths[key] + 2
            else:
                hidden.append(key)
        table.set_hidden(hidden)

    def on_resize(self) -> None:
        if self._snap is not None:
            self.update(self._snap)

    def request_cells(self, rid: str) -> tuple[Text, ...]:
        """The cells of one request row, built when the table paints the row."""
        r = self._rows.get(rid)
        hit = self._cache.get(rid)
        if hit is not None and (r is None or hit[0] is r):
            return hit[2]
        if r is None:
            return ()
        markup = render.request_cells(r, self._target)
        if hit is not None and hit[1] == markup:
            self._cache[rid] = (r, markup, hit[2])
            return hit[2]
        cells = tuple(self._cells(c) for c in markup)
        self._cache[rid] = (r, markup, cells)
        return cells

    def update_headers(self) -> None:
        table = self.query_one("#req-table", RowTable)
        table.set_labels([label + ((" ▼" if self.sort_reverse else " ▲") if key == self.sort_col else "")
                          for key, label in render.COLUMNS])

    def on_mount(self) -> None:
        self.update_headers()

    @on(RowTable.HeaderSelected, "#req-table")
    def _header_sort(self, ev: RowTable.HeaderSelected) -> None:
        col = ev.key
        if col == self.sort_col:
            self.sort_reverse = not self.sort_reverse
        else:
            self.sort_col, self.sort_reverse = col, col in render.NUMERIC
        if self._snap is not None:
            with self.app.batch_update():
                self.update(self._snap)

    def cycle_sort(self) -> None:
        """The next sort column (numbers sort highest first); the next update shows it."""
        keys = [k for k, _ in render.COLUMNS]
        self.sort_col = keys[(keys.index(self.sort_col) + 1) % len(keys)]
        self.sort_reverse = self.sort_col in render.NUMERIC

    def reverse_sort(self) -> None:
        self.sort_reverse = not self.sort_reverse
