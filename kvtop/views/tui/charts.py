"""History charts for the Overview: one ``Chart`` widget per series group, drawn line by line.

Why our own widget rather than plotext / textual-plotext: a refresh redraws 20-30 charts (8 GPUs,
several engines) inside the console's 50 ms budget at 1,000 requests; plotext builds each plot as
an ANSI string that Rich then re-parses (milliseconds a chart), and its charts carry axes and
legends that do not fit the 5-8 rows a chart gets at 80x24. Here a chart is a few lists of runs
(kvtop/views/tui/plot.py), drawn only for the lines on screen, coloured by the current theme, and a hover
tooltip reads the nearest sample back from the snapshot's copy of the series (``Snapshot.history``).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.geometry import Region
from textual.message import Message
from textual.strip import Strip
from textual.widget import Widget

from kvtop import units
from kvtop.snapshot import EngineView, HistoryWindow, Samples, Snapshot
from kvtop.views.tui import plot

GUTTER = 7  # y-axis labels
# Padding gets a style, never None: Textual's NO_COLOR filter reads every segment's style.
_PLAIN = Style.null()
CAUSE_COLOUR = {"preemption": "error", "prefill_interference": "warning", "slow_decode": "secondary"}
# A letter per cause under the charts: told apart without colour (NO_COLOR, colour-blind users).
CAUSE_GLYPH = {"preemption": "P", "prefill_interference": "F", "slow_decode": "S", "unknown": "?"}
CAUSE_NAMES = (("preemption", "preemption"), ("prefill_interference", "prefill"), ("slow_decode", "slow decode"),
               ("unknown", "unknown"))


@dataclass
class ChartSpec:
    key: str
    title: str
    ring: Samples | None
    label: str
    fmt: Callable[[float | None], str]
    ring2: Samples | None = None
    label2: str = ""
    ref: float | None = None
    ref_label: str = ""
    fixed_top: float | None = None
    over: float | None = None  # bars above this value take the warning colour
    marks: plot.Marks = field(default_factory=dict)
    empty: str = "no data yet"
    axis: Callable[[float], str] | None = None  # y-axis labels when ``fmt`` is too wide for the gutter
    # the title's figure when it is not the latest sample (a rate the panels quote over a window)
    headline: str | None = None
    headline2: str | None = None  # the same for the second series (the compare screen's run B)
    span: str = ""  # the span the headline covers ("1m"): named after it where the chart has room


def _pct(v: float | None) -> str:
    return units.pct(v, digits=0)


def _per_s(v: float | None) -> str:
    return units.num(v, "{:.2f}/s")


@dataclass
class _MarksCache:
    key: tuple[int, int | None, int | None] | None = None  # the spike list it was made from
    marks: plot.Marks = field(default_factory=dict)


_MARKS = _MarksCache()


def spike_marks(s: Snapshot) -> plot.Marks:
    """The analysis' spikes as cause -> sorted end times; rebuilt only when the list changes (the
    live analysis rebuilds its report at most once a second, and it can list hundreds of spikes)."""
    spikes = s.analysis.spikes if s.analysis is not None else ()
    key = (len(spikes), id(spikes[0]) if spikes else None, id(spikes[-1]) if spikes else None)
    if _MARKS.key != key:
        by: dict[str, list[float]] = {}
        for sp in spikes:
            t = sp.t_end or sp.t_start
            if isinstance(t, (int, float)):
                by.setdefault(str(sp.cause or "unknown"), []).append(float(t))
        for ts in by.values():
            ts.sort()
        _MARKS.marks, _MARKS.key = by, key
    return _MARKS.marks


def over(e: EngineView, window_s: float) -> str:
    """The span the engine card's rates and quantiles cover, as its figures name it: the window, or
    the shorter time the engine was read for (a replay of a 30 s trace in a 1 m window)."""
    span = e.rates_over_s
    return plot.window_label(span if span is not None and span < window_s - 0.5 else window_s)


def preempt_rate(e: EngineView, window_s: float) -> str:
    """The engine's preemption rate as the card and the chart title both quote it: the core's
    figure over its rate window, the span named."""
    return f"{_per_s(e.preemptions_per_s)} over {over(e, window_s)}"


def chart_specs(s: Snapshot) -> list[ChartSpec]:
    """The Overview's charts, most telling first: per engine KV, ITL, preemptions, queue, TTFT,
    tokens/s; per GPU memory and PCIe; host pinned memory."""
    history = s.history if s.history is not None else HistoryWindow()
    out: list[ChartSpec] = []
    marks = spike_marks(s)
    multi = len(s.engines) > 1
    for i, e in enumerate(s.engines):
        ser = history.engine_series(e.url, e.engine)
        if ser is None:
            continue
        pre = f"E{i} " if multi else ""
        k = f"e{i}"
        tgt = s.itl_target_s
        out.append(ChartSpec(k + "kv", f"{pre}KV cache usage", ser["kv_usage"], "KV", _pct, ref=1.0,
                             ref_label="100%", fixed_top=1.0, over=0.9))
        # the titles quote the engine card's figures, over the same span (the bars are per scrape)
        span = over(e, s.window_s)
        out.append(ChartSpec(k + "itl", f"{pre}ITL", ser["itl_p99_s"], "p99", units.duration_short, ser["itl_p50_s"], "p50",
                             ref=tgt, ref_label=f"target {units.duration_short(tgt)}" if tgt else "", over=tgt, marks=marks,
                             headline=f"p99 {units.duration_short(e.itl_p99_s)}", span=span,
                             headline2=f"p50 {units.duration_short(e.itl_p50_s)}"))
        if e.preempts:
            # the bars are per scrape; the title quotes the engine card's figure, over the same window
            out.append(ChartSpec(k + "pre", f"{pre}preemptions/s", ser["preemptions_per_s"], "", _per_s,
                                 axis=lambda v: f"{v:g}", headline=preempt_rate(e, s.window_s)))
        out.append(ChartSpec(k + "q", f"{pre}requests", ser["running"], "running", units.count_short, ser["waiting"],
                             "waiting"))
        out.append(ChartSpec(k + "ttft", f"{pre}TTFT", ser["ttft_p99_s"], "p99", units.duration_short,
                             headline=f"p99 {units.duration_short(e.ttft_p99_s)}", span=span))
        out.append(ChartSpec(k + "tok", f"{pre}tokens/s", ser["generation_tokens_per_s"], "gen", units.tok_rate,
                             ser["prompt_tokens_per_s"], "prompt",
                             headline=f"gen {units.tok_rate(e.generation_tokens_per_s)}", span=span,
                             headline2=f"prompt {units.tok_rate(e.prompt_tokens_per_s)}"))
    for view in s.gpus:
        g = view.record
        gs = history.gpus.get(g.index)
        if gs is None:
            continue
        out.append(ChartSpec(f"g{g.index}m", f"GPU{g.index} memory", gs["mem_used_bytes"], "used", units.bytes_short,
                             ref=g.mem_total_bytes, ref_label=f"total {units.bytes_short(g.mem_total_bytes)}",
                             fixed_top=float(g.mem_total_bytes) if g.mem_total_bytes else None))
        cap = view.pcie_capacity_bytes_per_s
        out.append(ChartSpec(f"g{g.index}p", f"GPU{g.index} PCIe", gs["pcie_tx_bytes_per_s"], "TX", units.byte_rate_short,
                             gs["pcie_rx_bytes_per_s"], "RX", ref=cap,
                             ref_label=f"link {units.byte_rate_short(cap)}" if cap else "", fixed_top=cap))
    host_empty = "no host data yet" if s.host_status == "ok" else s.host_status
    out.append(ChartSpec("host", "host pinned memory", history.host.get("pinned_bytes"), "pinned", units.bytes_short,
                         empty=host_empty))
    return out


def _origin(ring: Samples | None) -> int | None:
    """Which series the samples are a copy of: each snapshot brings new copies of the same series."""
    return None if ring is None else ring.origin


class Chart(Widget):
    """One history chart; ``show(spec, t0, t1)`` each tick, drawn lazily per visible line."""

    DEFAULT_CSS = """
    Chart {
        height: 1fr;
        padding: 0 1 0 0;
    }
    """

    def __init__(self, **kw: Any):
        super().__init__(**kw)
        self.spec: ChartSpec | None = None
        self.t0 = 0.0
        self.t1 = 1.0
        self.now_label = "now"
        self.start_label: str | None = None  # the axis' left end; None: "-WINDOW" (back from now)
        self._kv_strips: list[Strip] | None = None
        self._kv_size: tuple[int, int] = (0, 0)
        self._kv_top = 1.0
        self._kv_cols = 0
        self._seen: tuple[float | None, ...] = (None, None)
        self._raw = (0.0, 1.0)

    def show(self, spec: ChartSpec, t0: float, t1: float, now_label: str = "now") -> None:
        """New data for the chart. The window is aligned to whole columns, so between two column
        boundaries only the newest column, the title and the axis can change: only those regions
        are repainted (a full repaint of every chart each tick would cost most of the budget)."""
        w, h = self.size.width, self.size.height
        n = max(4, w - GUTTER - 1)
        self._raw = (t0, t1)
        t0, t1 = self._aligned(n)
        old = self.spec
        full = (old is None or old.key != spec.key or (t0, t1) != (self.t0, self.t1) or n != self._kv_cols
                or (old.ref, old.fixed_top, old.over) != (spec.ref, spec.fixed_top, spec.over)
                or _origin(old.ring) != _origin(spec.ring) or _origin(old.ring2) != _origin(spec.ring2)
                or self._grew_past_top(spec))
        axis = old is not None and (old.marks is not spec.marks and (old.marks or spec.marks)
                                    or now_label != self.now_label)
        self.spec, self.t0, self.t1, self.now_label = spec, t0, t1, now_label
        self._seen = tuple(r.t[-1] if r is not None and len(r) else None for r in (spec.ring, spec.ring2))
        self._kv_strips = None
        if full or h < 3 or w <= GUTTER + 2:
            self.refresh()
            return
        regions = [Region(0, 0, w, 1), Region(GUTTER + n - 2, 1, 3, h - 2)]
        if axis:
            regions.append(Region(0, h - 1, w, 1))
        self.refresh(*regions)

    def _aligned(self, n: int) -> tuple[float, float]:
        """The window [t0, t1] moved forward to the next whole column (stable bins between ticks)."""
        t0, t1 = self._raw
        span = t1 - t0
        if span > 0 and self.size.width > 0:
            dt = span / n
            t1 = math.ceil(t1 / dt - 1e-9) * dt
            t0 = t1 - span
        return t0, t1

    def _grew_past_top(self, spec: ChartSpec) -> bool:
        """A sample since the last draw above the y axis' top: the scale changes, redraw it all."""
        for ring, seen in zip((spec.ring, spec.ring2), self._seen, strict=True):
            if ring is None or not len(ring):
                continue
            k = len(ring) if seen is None else bisect_right(ring.t, seen)
            for v in ring.v[k:]:
                if v > self._kv_top:  # NaN compares False
                    return True
        return False

    def on_resize(self) -> None:
        self._kv_strips = None
        self.t0, self.t1 = self._aligned(max(4, self.size.width - GUTTER - 1))

    # -- drawing --------------------------------------------------------------------------------
    def _styles(self) -> dict[str, Style]:
        tv = self.app.theme_variables

        def st(var: str, bold: bool | None = None) -> Style:
            c = tv.get(var, "default").removeprefix("ansi_")
            try:
                return Style(color=c, bold=bold)
            except Exception:
                return Style(bold=bold)

        return {
            plot.BAR: st("primary"), plot.OVER: st("warning"), plot.LINE: st("accent", bold=True),
            plot.REF: st("text-muted"), plot.EMPTY: Style(), "muted": Style(dim=True), "title": Style(bold=True),
            "error": st("error", bold=True), "warning": st("warning", bold=True),
            "secondary": st("secondary", bold=True),
        }

    def _build(self) -> list[Strip]:
        w, h = self.size.width, self.size.height
        spec = self.spec
        styles = self._styles()
        if spec is None or w <= 0 or h <= 0:
            return [Strip.blank(w)] * max(0, h)
        n = max(4, w - GUTTER - 1)
        self._kv_cols = n
        t0, t1 = self.t0, self.t1
        p = spec.ring.columns(t0, t1, n) if spec.ring is not None else [None] * n
        q = spec.ring2.columns(t0, t1, n) if spec.ring2 is not None else None
        top = plot.scale_top(p + (q or []), spec.ref, spec.fixed_top)
        self._kv_top = top
        lines: list[Strip] = []
        # title: name, the latest values, the reference on the right
        last = spec.ring.last() if spec.ring is not None else None
        def title(headline: str | None) -> list[Segment]:
            segs = [Segment(" " + spec.title, styles["title"])]
            if headline is not None:
                segs.append(Segment(f"  {headline}", styles[plot.BAR]))
            elif last is not None or spec.ring2 is not None:
                segs.append(Segment(f"  {spec.label + ' ' if spec.label else ''}{spec.fmt(last)}", styles[plot.BAR]))
            if spec.ring2 is not None:
                second = spec.headline2 if spec.headline2 is not None else f"{spec.label2} {spec.fmt(spec.ring2.last())}"
                segs.append(Segment(f"  ━ {second}", styles[plot.LINE]))
            return segs

        # a narrow chart (80 columns: two to a row) shortens its reference, then its headline (the
        # span it names, which the engine card names too), then drops the reference, before the
        # title's figures are cut
        refs = (spec.ref_label, spec.ref_label.split(" ")[-1])
        heads = ((f"{spec.headline} over {spec.span}", spec.headline) if spec.span and spec.headline is not None
                 else (spec.headline,))
        tries = [(h, r) for h in heads for r in refs] + [(heads[-1], "")]
        for head, ref in tries:
            segs = title(head)
            tail = [Segment(f"  ┈ {ref}", styles["muted"])] if ref else []
            if sum(len(g.text) for g in segs + tail) <= w:
                break
        lines.append(Strip(segs + tail).crop_extend(0, w, _PLAIN))
        plot_h = max(1, h - 2) if h >= 3 else max(0, h - 1)
        if plot_h == 0:
            return lines
        has_data = any(v is not None for v in p) or (q is not None and any(v is not None for v in q))
        rows = plot.plot_rows(p, q, top, plot_h, spec.ref, spec.over)
        axis = spec.axis or spec.fmt
        for r, runs in enumerate(rows):
            if not has_data:
                lab = ""
            elif r == 0:
                lab = axis(top)
            elif r == plot_h - 1 and plot_h > 1:
                lab = "0"
            else:
                lab = ""
            segs = [Segment(lab[: GUTTER - 1].rjust(GUTTER - 1) + "│", styles["muted"])]
            segs.extend(Segment(text, styles[role]) for text, role in runs)
            lines.append(Strip(segs).crop_extend(0, w, _PLAIN))
        if not has_data:
            msg = f" {spec.empty} "
            mid = 1 + plot_h // 2
            if mid < len(lines):
                pad = max(0, (n - len(msg)) // 2)
                lines[mid] = Strip([Segment(" " * (GUTTER - 1) + "│", styles["muted"]),
                                    Segment(" " * pad, _PLAIN), Segment(msg, styles["muted"])]).crop_extend(0, w, _PLAIN)
        if h >= 3:
            lines.append(self._axis(n, w, styles))
        return lines

    def _axis(self, n: int, w: int, styles: dict[str, Style]) -> Strip:
        spec = self.spec
        assert spec is not None
        marks = plot.mark_row(n, self.t0, self.t1, spec.marks)
        left = self.start_label if self.start_label is not None else f"-{plot.window_label(self.t1 - self.t0)}"
        right = self.now_label
        # a time label is drawn whole or not at all: spike marks under it win
        if any(marks[:len(left)]):
            left = ""
        if any(marks[n - len(right):]):
            right = ""
        segs = [Segment(" " * (GUTTER - 1) + "└", styles["muted"])]
        cells: list[tuple[str, str]] = []
        for c in range(n):
            cause = marks[c]
            if cause is not None:
                cells.append((CAUSE_GLYPH.get(cause, "?"), CAUSE_COLOUR.get(cause, "muted")))
            elif c < len(left):
                cells.append((left[c], "muted"))
            elif right and c >= n - len(right):
                cells.append((right[c - (n - len(right))], "muted"))
            else:
                cells.append(("─", "muted"))
        for text, role in plot._runs(cells):
            segs.append(Segment(text, styles.get(role, styles["muted"])))
        return Strip(segs).crop_extend(0, w, _PLAIN)

    def render_line(self, y: int) -> Strip:
        size = (self.size.width, self.size.height)
        if self._kv_strips is None or size != self._kv_size:
            self._kv_size = size
            self._kv_strips = self._build()
        if 0 <= y < len(self._kv_strips):
            return self._kv_strips[y]
        return Strip.blank(self.size.width)

    # -- hover and click -------------------------------------------------------------------------
    class SpikesPicked(Message):
        """A click on a chart column that holds spike marks: the span [t0, t1] of that column."""

        def __init__(self, t0: float, t1: float):
            super().__init__()
            self.t0, self.t1 = t0, t1

    def on_mouse_move(self, ev: events.MouseMove) -> None:
        self.tooltip = self.readout(ev.x)

    def column_span(self, x: int) -> tuple[float, float] | None:
        """The time span column ``x`` covers, None off the plot."""
        n = self._kv_cols or max(4, self.size.width - GUTTER - 1)
        c = x - GUTTER
        if c < 0 or c >= n or self.t1 <= self.t0:
            return None
        dt = (self.t1 - self.t0) / n
        return self.t0 + c * dt, self.t0 + (c + 1) * dt

    def on_click(self, ev: events.Click) -> None:
        span = self.column_span(ev.x)
        if span is not None and self.spec is not None and plot.marks_between(self.spec.marks, *span):
            self.post_message(self.SpikesPicked(*span))

    def readout(self, x: int) -> str | None:
        """What the mouse over column ``x`` shows: the time and the nearest sample of each series."""
        spec = self.spec
        c = x - GUTTER
        n = self._kv_cols or max(4, self.size.width - GUTTER - 1)
        if spec is None or c < 0 or c >= n or self.t1 <= self.t0:
            return None
        t = self.t0 + (c + 0.5) * (self.t1 - self.t0) / n
        parts = [f"{spec.title} at t={units.duration_short(t)} ({units.duration_short(self.t1 - t)} before {self.now_label})"]
        for ring, label in ((spec.ring, spec.label), (spec.ring2, spec.label2)):
            hit = ring.at(t) if ring is not None else None
            if hit is not None and abs(hit[0] - t) <= (self.t1 - self.t0) / n + 1.5:
                v = None if hit[1] != hit[1] else hit[1]
                parts.append(f"{label or 'value'} {spec.fmt(v)}")
        lo, hi = t - (self.t1 - self.t0) / n / 2, t + (self.t1 - self.t0) / n / 2
        causes = plot.marks_between(spec.marks, lo, hi)
        if causes:
            parts.append("spikes: " + ", ".join(f"{k} {cz}" for cz, k in sorted(causes.items()))
                         + " (click: the worst one's request)")
        return "\n".join(parts)
