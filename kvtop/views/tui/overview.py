"""The Overview screen (key 1): GPU, host and engine panels over the history charts."""

from __future__ import annotations

from functools import partial
from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Vertical, VerticalScroll
from textual.markup import escape
from textual.widgets import Static

from kvtop import units
from kvtop.snapshot import Snapshot
from kvtop.views.tui import plot, render
from kvtop.views.tui.charts import CAUSE_GLYPH, CAUSE_NAMES, Chart, chart_specs
from kvtop.views.tui.widgets import Panel

WINDOWS = (60.0, 300.0, 900.0, 3600.0)


class OverviewView(Vertical):
    """``update(snapshot)`` each tick; ``w`` cycles the charts' time window."""

    KEYS: ClassVar[tuple[Binding, ...]] = (Binding("w", "window", "Window"),)

    def __init__(self, interval: float, replay: bool):
        super().__init__(id="overview")
        self.interval = interval  # the poll interval, which the engine panels quote
        self.replay = replay  # the time axis ends at the replay position, not "now"
        self.window_s = WINDOWS[1]
        self._gpu_panels: list[Panel] = []
        self._engine_panels: list[Panel] = []
        self._charts: list[Chart] = []
        self._chart_fit: tuple[int, int] | None = None

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="ov-top"):
            yield Static("[b]GPUs[/b]", id="gpus-head", classes="section")
            yield Vertical(id="gpus")
            yield Panel(id="host")
            yield Static("[b]Engines[/b]", classes="section")
            yield Vertical(id="engines")
            yield Panel(id="summary")
        yield Static("", id="charts-head", classes="section")
        with VerticalScroll(id="charts"):
            yield Grid(id="chart-grid")

    def cycle_window(self) -> float:
        """The next history window: 1m -> 5m -> 15m -> 1h."""
        i = WINDOWS.index(self.window_s) if self.window_s in WINDOWS else 0
        self.window_s = WINDOWS[(i + 1) % len(WINDOWS)]
        return self.window_s

    @staticmethod
    def _panels(box: Vertical, have: list[Panel], n: int, cls: str) -> list[Panel]:
        """Grow or shrink ``have`` to ``n`` panels (at least one, for the "no data" line)."""
        n = max(1, n)
        if len(have) < n:
            new = [Panel(classes=cls) for _ in range(n - len(have))]
            box.mount_all(new)
            have = have + new
        elif len(have) > n:
            for p in have[n:]:
                p.remove()
            have = have[:n]
        return have

    def update(self, s: Snapshot) -> None:
        gpus = self.query_one("#gpus", Vertical)
        self._gpu_panels = self._panels(gpus, self._gpu_panels, len(s.gpus), "gpu")
        # no GPU: the reason goes on the section's own line (one line of 24, not two)
        why = "" if s.gpus else "no GPU data yet" if s.gpu_status == "ok" else s.gpu_status
        head = "[b]GPUs[/b]" + (" " + render.muted(escape(why)) if why else "")
        self.query_one("#gpus-head", Static).update(head, layout=False)
        if gpus.display != bool(s.gpus):
            gpus.display = bool(s.gpus)
        for p, g in zip(self._gpu_panels, s.gpus, strict=False):
            p.show(partial(render.gpu_line, g))
        self.query_one("#host", Panel).show(lambda w: render.host_line(s.host, w, s.host_status))
        self._engine_panels = self._panels(self.query_one("#engines", Vertical), self._engine_panels,
                                           len(s.engines), "engine")
        if not s.engines:
            self._engine_panels[0].show(lambda w: render.muted("no engine data yet"))
        for p, e in zip(self._engine_panels, s.engines, strict=False):
            p.set_class(not e.up, "-down")
            p.show(partial(render.engine_lines, e, s.itl_target_s, interval=self.interval, window_s=s.window_s))
        done, over = s.finished_total, s.gaps_over_target_total
        kept = sum(1 for r in s.requests if r.kept)  # ended too, but still listed for their stall
        off = f"{done - kept} ended request(s) off screen" + (f" ({kept} worst stalls kept)" if kept else "")
        retired = render.muted(f"· {off}, {over} gap(s) over target") if done else ""
        # one line: the ended-request count goes first on a narrow terminal
        self.query_one("#summary", Panel).show(
            lambda w: render.fit_line([(render.summary_line(s, narrow=w < 100), 0), (retired, 1)], w - 2))
        self._render_charts(s)

    def _fit_charts(self) -> None:
        """Columns from the width, row height from the height left under the panels."""
        box = self.query_one("#charts", VerticalScroll)
        grid = self.query_one("#chart-grid", Grid)
        width = box.size.width or self.app.size.width
        cols = 1 if width < 60 else 2 if width < 140 else 3
        rows = max(1, -(-len(self._charts) // cols))
        h = max(6, (box.size.height or 12) // rows)
        if self._chart_fit != (cols, h):
            self._chart_fit = (cols, h)
            grid.styles.grid_size_columns = cols
            grid.styles.grid_rows = f"{h}"
            # the panels above may have changed height too: fit again once laid out
            self.app.call_after_refresh(self._fit_charts)

    def _render_charts(self, s: Snapshot) -> None:
        """History charts under the panels: as many columns as the width allows, their height
        shared out of what the terminal has left (a taller terminal, taller charts)."""
        specs = chart_specs(s)
        grid = self.query_one("#chart-grid", Grid)
        have = self._charts
        if len(have) < len(specs):
            new = [Chart() for _ in range(len(specs) - len(have))]
            grid.mount_all(new)
            have = have + new
        elif len(have) > len(specs):
            for c in have[len(specs):]:
                c.remove()
            have = have[: len(specs)]
        self._charts = have
        self._fit_charts()
        t1 = s.t
        t0 = t1 - self.window_s
        now_label = f"t={units.duration_short(t1)}" if self.replay else "now"
        for c, spec in zip(have, specs, strict=False):
            c.show(spec, t0, t1, now_label)
        width = self.size.width or self.app.size.width
        if width >= 120:
            head = f"last {plot.window_label(self.window_s)} · w: window · hover a chart for values · spikes:"
        else:  # the footer lists w
            head = f"{plot.window_label(self.window_s)} · spikes:"
        legend = " ".join(f"[{render.CAUSE_VAR[c]}]{CAUSE_GLYPH[c]} {name}[/]" for c, name in CAUSE_NAMES)
        self.query_one("#charts-head", Static).update(f"[b]History[/b] {render.muted(head)} {legend}", layout=False)
