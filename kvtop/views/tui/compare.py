"""The compare console (``kvtop tui --replay A --compare B``): two recorded runs of the same traffic
side by side. On top, ``kvtop compare``'s figures as A → B and its one-line result; below, the history
charts of both runs overlaid on one time axis (seconds from each trace's start), A as bars and B as a
line, so the two stay apart without colour (NO_COLOR, a colour-blind reader, a screenshot in a ticket).

The command layer replays both traces to their end and hands this module two Snapshots (their
history over the whole run) and the comparison's JSON: the view reads nothing else.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Grid, VerticalScroll
from textual.markup import escape
from textual.widgets import Footer, Static

from kvtop import units
from kvtop.snapshot import Samples, Snapshot
from kvtop.views.tui import render
from kvtop.views.tui.app import KVTOP_LOW_THEME, KVTOP_THEME
from kvtop.views.tui.charts import Chart, ChartSpec

# the glyphs the charts draw each run with: the legend names them
GLYPH_A, GLYPH_B = "█", "━"
# outcome -> the theme variable its word is drawn in (the word itself carries the meaning)
OUTCOME_VAR = {"improved": "success", "trade_off": "warning", "mixed": "warning", "worse": "error",
               "no_change": "text-muted", "not_comparable": "error"}


@dataclass(frozen=True)
class CompareInput:
    """What the screen shows: each run's snapshot at its end (history over the whole run), its
    label, and ``kvtop compare``'s JSON for the pair (kvtop/schemas/compare.schema.json)."""

    a: Snapshot
    b: Snapshot
    label_a: str
    label_b: str
    figures: dict[str, Any]

    @property
    def span_s(self) -> float:
        return max(self.a.t, self.b.t, 1.0)


def _series(s: Snapshot) -> dict[str, Samples]:
    """The first engine's chart series (the loop replays against one engine)."""
    if s.history is None or not s.engines:
        return {}
    e = s.engines[0]
    return s.history.engine_series(e.url, e.engine) or {}


def held(ring: Samples | None, points: int = 600) -> Samples | None:
    """The series with each sample held until the next one, as ``points`` steps over its span.

    A whole run on one axis: 18 s of 1 s scrapes over 60 columns would leave two empty columns in
    three, so the bars would read as a comb. A scrape's gauge or rate stands for the interval after
    it; across a silence longer than three intervals (the engine was down) nothing is filled."""
    if ring is None or len(ring) < 2 or len(ring) >= points:
        return ring
    ts, vs = ring.t, ring.v
    gaps = sorted(b - a for a, b in zip(ts, ts[1:], strict=False))
    usual = gaps[len(gaps) // 2]
    step = (ts[-1] - ts[0]) / points
    if step <= 0:
        return ring
    t_out, v_out = array("d"), array("d")
    for i in range(len(ts)):
        t_out.append(ts[i])
        v_out.append(vs[i])
        if i + 1 < len(ts) and ts[i + 1] - ts[i] <= 3 * usual:
            t = ts[i] + step
            while t < ts[i + 1]:
                t_out.append(t)
                v_out.append(vs[i])
                t += step
    return Samples(t_out, v_out, ring.origin)


def _peak(ring: Samples | None) -> float | None:
    vals = [v for v in ring.v if v == v] if ring is not None else []
    return max(vals) if vals else None


def _pct(v: float | None) -> str:
    return units.pct(v, digits=0)


def _rate(v: float | None) -> str:
    return units.num(v, "{:.2f}/s")


# series key, title, format, which figure of each run the title quotes
CHARTS: tuple[tuple[str, str, Any], ...] = (
    ("itl_p99_s", "ITL p99", units.duration_short),
    ("ttft_p99_s", "TTFT p99", units.duration_short),
    ("kv_usage", "KV cache usage", _pct),
    ("preemptions_per_s", "preemptions/s", _rate),
    ("running", "running", units.count_short),
    ("waiting", "waiting", units.count_short),
    ("generation_tokens_per_s", "tokens/s generated", units.tok_rate),
)


def overlay_specs(c: CompareInput) -> list[ChartSpec]:
    """One chart per series either run has, A's samples as the bars, B's as the line; the title
    quotes each run's peak (a run's last sample is its idle tail, not its story)."""
    sa, sb = _series(c.a), _series(c.b)
    out = []
    for key, title, fmt in CHARTS:
        ra, rb = held(sa.get(key)), held(sb.get(key))
        if _peak(ra) is None and _peak(rb) is None:
            continue
        ref = c.a.itl_target_s if key == "itl_p99_s" else 1.0 if key == "kv_usage" else None
        ref_label = f"target {units.duration_short(ref)}" if key == "itl_p99_s" and ref else \
            "100%" if key == "kv_usage" else ""
        out.append(ChartSpec(f"cmp-{key}", title, ra, f"{GLYPH_A} A", fmt, rb, "B", ref=ref, ref_label=ref_label,
                             fixed_top=1.0 if key == "kv_usage" else None,
                             headline=f"{GLYPH_A} A max {fmt(_peak(ra))}", headline2=f"B max {fmt(_peak(rb))}"))
    return out


def _num(v: Any, fmt: str = "{:g}") -> str:
    return "n/a" if v is None else fmt.format(v)


def _dur(v: Any) -> str:
    return "n/a" if v is None else units.duration_short(float(v))


def figure_cells(doc: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(figure, A, B) for the figures an operator reads first, as ``kvtop compare`` measured them."""
    a, b = doc["a"], doc["b"]

    def verdict(r: dict[str, Any]) -> str:
        v = r.get("verdict") or {}
        return str(v.get("action", "n/a")).replace("_", " ")

    return [
        ("goodput", f"{a['goodput']}/{a['offered']}", f"{b['goodput']}/{b['offered']}"),
        ("completed", f"{a['completed']}/{a['offered']}", f"{b['completed']}/{b['offered']}"),
        ("p99 ITL", _dur(a["itl_p99_s"]), _dur(b["itl_p99_s"])),
        ("p99 TTFT", _dur(a["ttft_p99_s"]), _dur(b["ttft_p99_s"])),
        ("p99 end-to-end", _dur(a["e2e_p99_s"]), _dur(b["e2e_p99_s"])),
        ("output tok/s", _num(a["output_tokens_per_s"], "{:.0f}"), _num(b["output_tokens_per_s"], "{:.0f}")),
        ("preempt/request", _num(a["preemptions_per_completed"], "{:.3g}"),
         _num(b["preemptions_per_completed"], "{:.3g}")),
        ("verdict", verdict(a), verdict(b)),
    ]


def figures_text(doc: dict[str, Any], width: int) -> str:
    """The figures as ``name  A → B``, two to a line from 76 columns (80x24 keeps its charts)."""
    cells = figure_cells(doc)
    wn = max(len(n) for n, _, _ in cells)
    wa = max(len(x) for _, x, _ in cells)
    wb = max(len(y) for _, _, y in cells)
    items = [f"{n:<{wn}} {x:>{wa}} → {y:<{wb}}" for n, x, y in cells]
    per = 2 if 2 * len(items[0]) + 3 <= width else 1
    lines = []
    for i in range(0, len(items), per):
        lines.append(" │ ".join(escape(t) for t in items[i:i + per]))
    return "\n".join(lines)


def result_text(doc: dict[str, Any]) -> str:
    outcome = str(doc.get("outcome", ""))
    word = outcome.replace("_", "-").upper()
    var = OUTCOME_VAR.get(outcome, "text")
    summary = str(doc.get("summary", ""))
    detail = summary.split(": ", 1)[1] if ": " in summary else summary
    targets = [f"ITL {units.duration_short(doc['itl_target_s'])}" if doc.get("itl_target_s") else "ITL: none",
               f"TTFT {units.duration_short(doc['ttft_target_s'])}" if doc.get("ttft_target_s")
               else "TTFT: none"]
    notes = "".join(" " + render.muted(escape("note: " + str(n))) for n in doc.get("notes") or ())
    return f"[b ${var}]{word}[/] {escape(detail)} {render.muted('(contract: ' + ', '.join(targets) + ')')}{notes}"


class CompareApp(App[int]):
    """Two runs side by side; ``q`` quits. Static: both traces are read to their end before it opens."""

    TITLE = "kvtop compare"
    CSS = """
    #cmp-top { height: 1; background: $panel; color: $text; }
    #cmp-figures { height: auto; padding: 0 1; }
    #cmp-result { height: auto; max-height: 4; padding: 0 1; }
    #cmp-charts { height: 1fr; }
    #cmp-grid { grid-gutter: 0 1; height: auto; }
    """
    BINDINGS = [
        Binding("q,f10", "quit", "Quit", key_display="q"),
        Binding("ctrl+c", "quit", "Quit", show=False, priority=True),
    ]

    def __init__(self, data: CompareInput, theme: str | None = None, **kw: Any):
        super().__init__(**kw)
        self.data = data
        self.register_theme(KVTOP_THEME)
        self.register_theme(KVTOP_LOW_THEME)
        self._theme_name = theme or "kvtop"
        self._charts: list[Chart] = []
        self._fit: tuple[int, int] | None = None

    def compose(self) -> ComposeResult:
        yield Static("", id="cmp-top")
        yield Static("", id="cmp-figures")
        yield Static(result_text(self.data.figures), id="cmp-result")
        with VerticalScroll(id="cmp-charts"):
            yield Grid(id="cmp-grid")
        yield Footer()

    def _top(self, width: int) -> str:
        d = self.data
        line = f" [b]kvtop compare[/b]  A {GLYPH_A} {escape(d.label_a)}  B {GLYPH_B} {escape(d.label_b)}"
        plain = len(f" kvtop compare  A {GLYPH_A} {d.label_a}  B {GLYPH_B} {d.label_b}")
        hint = "  charts: t from each run's start"
        return line + (render.muted(hint) if plain + len(hint) <= width else "")

    def on_mount(self) -> None:
        self.theme = self._theme_name
        grid = self.query_one("#cmp-grid", Grid)
        self._charts = [Chart() for _ in overlay_specs(self.data)]
        grid.mount_all(self._charts)
        self.call_after_refresh(self._draw)

    def on_resize(self) -> None:
        self.call_after_refresh(self._draw)

    def _draw(self) -> None:
        width = self.size.width
        self.query_one("#cmp-top", Static).update(self._top(width))
        self.query_one("#cmp-figures", Static).update(figures_text(self.data.figures, width - 2))
        box = self.query_one("#cmp-charts", VerticalScroll)
        cols = 1 if width < 60 else 2 if width < 140 else 3
        rows = max(1, -(-len(self._charts) // cols))
        # the rows that fit at 6 lines each share the space left, whole; the rest scroll
        box_h = box.size.height or 12
        h = max(6, box_h // max(1, min(rows, box_h // 6)))
        if self._fit != (cols, h):
            self._fit = (cols, h)
            grid = self.query_one("#cmp-grid", Grid)
            grid.styles.grid_size_columns = cols
            grid.styles.grid_rows = f"{h}"
        span = self.data.span_s
        for chart, spec in zip(self._charts, overlay_specs(self.data), strict=False):
            chart.start_label = "0s"
            chart.show(spec, 0.0, span, units.duration_short(span))


def run_compare(data: CompareInput, theme: str | None = None) -> int:
    """Run the compare console until the user quits."""
    rc = CompareApp(data, theme=theme).run()
    return int(rc or 0)
