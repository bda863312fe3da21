"""Lays a ``Picture`` out as one HTML page: the verdict and its numbers, the causes, the history
charts and the per-request timelines, all on one time axis so a stall lines up with the KV
usage and the preemptions beside it.

Causes are told apart by colour (Okabe-Ito, readable with the common colour-vision deficiencies)
and by shape (triangle, square, diamond, circle), so a grey-scale print or a colour-blind reader
loses nothing.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from html import escape

from kvtop import __version__, units
from kvtop.model.analysis import AnalysisReport, Number, RequestRow, SpikeView, Verdict
from kvtop.model.sanitize import printable
from kvtop.picture import Picture, StreamSpan
from kvtop.snapshot import Samples


@dataclass(frozen=True)
class CauseStyle:
    label: str
    colour: str
    shape: str  # the glyph that tells the cause without colour


CAUSE_STYLE: dict[str, CauseStyle] = {
    "preemption": CauseStyle("preemption", "#D55E00", "triangle"),
    "prefill_interference": CauseStyle("prefill interference", "#0072B2", "square"),
    "slow_decode": CauseStyle("slow decode", "#CC79A7", "diamond"),
    "unknown": CauseStyle("unknown", "#6B6B6B", "circle"),
}
_OTHER = CauseStyle("other", "#333333", "cross")

MAX_TIMELINES = 40  # request rows drawn: the ones with the longest gaps, in arrival order
MAX_SPIKE_MARKS = 4000  # spike glyphs on the gap chart (the report lists at most its newest 10,000)

WIDTH = 1180  # every chart and the timelines share this width and the plot's left edge
LEFT = 150
RIGHT = 24
PLOT_W = WIDTH - LEFT - RIGHT
ENGINE_COLOURS = ("#1F4E79", "#009E73", "#E69F00", "#56B4E9", "#8C564B", "#000000")

CSS = """
:root { --fg:#1d2330; --muted:#5b6475; --line:#d9dde5; --bg:#f5f6f8; --card:#fff; }
* { box-sizing: border-box; }
body { margin:0; background:var(--bg); color:var(--fg);
  font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif; }
main { max-width: 1240px; margin: 0 auto; padding: 20px 24px 40px; }
header.top { display:flex; align-items:baseline; gap:16px; flex-wrap:wrap; margin-bottom: 14px; }
header.top h1 { font-size: 22px; margin: 0; letter-spacing: .2px; }
header.top .meta { color: var(--muted); }
section { background: var(--card); border: 1px solid var(--line); border-radius: 8px; padding: 14px 18px;
  margin: 0 0 14px; }
h2 { font-size: 15px; margin: 0 0 10px; text-transform: uppercase; letter-spacing: .6px; color: #3a4356; }
.verdict-head { display:flex; align-items:center; gap:12px; flex-wrap: wrap; }
.action { font-size: 26px; font-weight: 700; letter-spacing: .5px; }
.badge { display:inline-block; padding: 2px 8px; border-radius: 10px; font-size: 12px; font-weight: 600;
  background:#e8ecf3; color:#2d3a52; }
.badge.warn { background:#fde8d7; color:#8a3b00; }
.grid { display:grid; grid-template-columns: 1fr 1fr; gap: 14px; }
table { border-collapse: collapse; width: 100%; }
th, td { text-align:left; padding: 4px 8px; border-bottom: 1px solid #eef0f4; vertical-align: top; }
th { color: var(--muted); font-weight: 600; font-size: 12px; text-transform: uppercase; letter-spacing: .4px; }
td.num { text-align:right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td.src { color: var(--muted); font-size: 12px; }
td.flag { white-space: nowrap; }
table.settings td:last-child { color: #3a4356; }
ul { margin: 6px 0 0; padding-left: 20px; }
li { margin: 2px 0; }
.decided li { list-style: none; margin-left: -20px; }
.decided b { display:inline-block; min-width: 110px; }
.kpis { display:flex; gap: 28px; flex-wrap: wrap; margin: 4px 0 10px; }
.kpi .v { font-size: 20px; font-weight: 700; font-variant-numeric: tabular-nums; }
.kpi .k { color: var(--muted); font-size: 12px; }
.legend { display:flex; gap: 18px; flex-wrap: wrap; margin: 2px 0 8px; color: #2d3a52; }
.legend span { display:inline-flex; align-items:center; gap: 6px; }
.note { color: var(--muted); font-size: 12.5px; margin: 6px 0 0; }
.warn-box { background:#fff7e6; border-color:#f1d39a; }
svg text { font: 11px system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif; fill: #3a4356; }
svg .title { font-size: 12.5px; font-weight: 600; fill: #1d2330; }
footer { color: var(--muted); font-size: 12px; text-align: center; margin-top: 18px; }
"""


def _e(s: object, limit: int | None = None) -> str:
    return escape(printable(s, limit))


def _style(cause: str | None) -> CauseStyle:
    return CAUSE_STYLE.get(cause or "", _OTHER)


def glyph(cause: str | None, x: float, y: float, r: float = 5.0, title: str | None = None,
          hollow: bool = False) -> str:
    """The cause's marker centred on (x, y): its colour and its shape (``hollow``: white inside a
    cause-coloured outline, to stand out on a block of the same colour)."""
    st = _style(cause)
    c = st.colour
    tip = f"<title>{_e(title)}</title>" if title else ""
    paint = f'fill="#fff" stroke="{c}" stroke-width="1.4"' if hollow else f'fill="{c}" stroke="#fff" stroke-width="0.8"'
    attrs = f'{paint} data-cause="{_e(cause or "other")}"'
    if st.shape == "triangle":
        pts = f"{x:.1f},{y - r:.1f} {x + r:.1f},{y + r * 0.8:.1f} {x - r:.1f},{y + r * 0.8:.1f}"
        return f'<polygon points="{pts}" {attrs}>{tip}</polygon>'
    if st.shape == "square":
        s = r * 0.85
        return f'<rect x="{x - s:.1f}" y="{y - s:.1f}" width="{2 * s:.1f}" height="{2 * s:.1f}" {attrs}>{tip}</rect>'
    if st.shape == "diamond":
        pts = f"{x:.1f},{y - r:.1f} {x + r:.1f},{y:.1f} {x:.1f},{y + r:.1f} {x - r:.1f},{y:.1f}"
        return f'<polygon points="{pts}" {attrs}>{tip}</polygon>'
    if st.shape == "circle":
        return f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{r * 0.85:.1f}" {attrs}>{tip}</circle>'
    d = f"M{x - r:.1f},{y - r:.1f}L{x + r:.1f},{y + r:.1f}M{x - r:.1f},{y + r:.1f}L{x + r:.1f},{y - r:.1f}"
    return f'<path d="{d}" stroke="{c}" stroke-width="2" data-cause="{_e(cause or "other")}">{tip}</path>'


def _legend_icon(cause: str) -> str:
    return f'<svg width="14" height="14" viewBox="0 0 14 14" aria-hidden="true">{glyph(cause, 7, 7.5, 6)}</svg>'


# ---- axes -------------------------------------------------------------------------------------

_STEPS = (0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400)


def _t_label(s: float) -> str:
    if s < 120:
        return f"{s:g} s"
    if s < 7200:
        m, sec = divmod(int(round(s)), 60)
        return f"{m} min" if not sec else f"{m}m{sec:02d}s"
    h, rem = divmod(int(round(s)), 3600)
    return f"{h} h" if not rem else f"{h}h{rem // 60:02d}"


def _nice_max(v: float) -> float:
    if not v > 0 or math.isinf(v):
        return 1.0
    e = float(10 ** math.floor(math.log10(v)))
    for m in (1, 1.2, 1.6, 2, 2.4, 3.2, 4, 6, 8, 10):  # a quarter of each is a round tick
        if v <= m * e * 1.0000001:
            return m * e
    return 10 * e


class Axis:
    """Trace seconds to x pixels: the one time axis of every chart and timeline."""

    def __init__(self, t0: float, t1: float):
        self.t0 = t0
        self.t1 = t1 if t1 > t0 else t0 + 1.0

    def x(self, t: float) -> float:
        return LEFT + (t - self.t0) / (self.t1 - self.t0) * PLOT_W

    def ticks(self) -> list[tuple[float, str]]:
        span = self.t1 - self.t0
        step = next((s for s in _STEPS if span / s <= 10), _STEPS[-1])
        out = []
        k = 0
        while k * step <= span + 1e-9:
            out.append((self.x(self.t0 + k * step), _t_label(k * step)))
            k += 1
        return out

    def grid(self, top: float, bottom: float, labels: bool = True) -> str:
        parts = []
        for x, lab in self.ticks():
            parts.append(f'<line x1="{x:.1f}" y1="{top:.1f}" x2="{x:.1f}" y2="{bottom:.1f}" stroke="#eef0f4"/>')
            if labels:
                parts.append(f'<text x="{x:.1f}" y="{bottom + 14:.1f}" text-anchor="middle">{_e(lab)}</text>')
        return "".join(parts)


# ---- history charts ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Line:
    label: str
    samples: Samples
    colour: str
    dash: str | None = None


def _polylines(ax: Axis, s: Samples, y: Callable[[float], float], colour: str, dash: str | None) -> str:
    i, j = s.span(ax.t0, ax.t1)
    n = PLOT_W // 2
    pts: list[tuple[float, float | None]]
    if j - i <= n:  # sparse: every sample where it lies
        pts = [(ax.x(s.t[k]), None if s.v[k] != s.v[k] else s.v[k]) for k in range(i, j)]
    else:  # dense: each column's highest sample, so short peaks stay visible
        step = PLOT_W / n
        pts = [(LEFT + (c + 0.5) * step, v) for c, v in enumerate(s.columns(ax.t0, ax.t1, n, "max"))]
    out: list[list[str]] = []
    run: list[str] = []
    for x, v in [*pts, (0.0, None)]:
        if v is None:
            if len(run) == 1:  # a lone sample still shows: a short flat stroke
                px, py = run[0].split(",")
                run.append(f"{float(px) + 2:.1f},{py}")
            if run:
                out.append(run)
            run = []
            continue
        run.append(f"{x:.1f},{y(v):.1f}")
    d = f' stroke-dasharray="{dash}"' if dash else ""
    return "".join(f'<polyline fill="none" stroke="{colour}" stroke-width="1.6"{d} points="{" ".join(r)}"/>'
                   for r in out)


def _chart(ax: Axis, title: str, lines: Sequence[Line], fmt: Callable[[float], str], y_max: float | None = None,
           height: int = 150, extra: Callable[[Callable[[float], float]], str] | None = None,
           chart_id: str = "", peak: float | None = None, empty: str = "no samples in this trace") -> str:
    top, bottom = 26, height - 22
    vals = [v for ln in lines for v in ln.samples.v if v == v]
    hi = max(vals) if vals else 0.0
    if peak is not None:
        hi = max(hi, peak)
    ym = y_max if y_max is not None else _nice_max(hi * 1.05)

    def y(v: float) -> float:
        return bottom - min(max(v, 0.0), ym) / ym * (bottom - top)

    parts = [f'<svg id="{_e(chart_id)}" class="chart" width="{WIDTH}" height="{height}" '
             f'viewBox="0 0 {WIDTH} {height}" role="img" aria-label="{_e(title)}">',
             f'<text class="title" x="{LEFT}" y="16">{_e(title)}</text>', ax.grid(top, bottom)]
    for k in range(5):
        v = ym * k / 4
        yy = y(v)
        parts.append(f'<line x1="{LEFT}" y1="{yy:.1f}" x2="{LEFT + PLOT_W}" y2="{yy:.1f}" stroke="#eef0f4"/>')
        parts.append(f'<text x="{LEFT - 8}" y="{yy + 4:.1f}" text-anchor="end">{_e(fmt(v))}</text>')
    parts.append(f'<rect x="{LEFT}" y="{top}" width="{PLOT_W}" height="{bottom - top}" fill="none" stroke="#c9ced8"/>')
    if not vals and extra is None:
        parts.append(f'<text x="{LEFT + PLOT_W / 2:.0f}" y="{(top + bottom) / 2:.0f}" text-anchor="middle">'
                     f'{_e(empty)}</text>')
    for ln in lines:
        parts.append(_polylines(ax, ln.samples, y, ln.colour, ln.dash))
    if extra is not None:
        parts.append(extra(y))
    # the series' names, right-aligned in the title row
    lx = LEFT + PLOT_W
    for ln in reversed(lines):
        w = 7 * len(ln.label) + 26
        lx -= w
        dash = f' stroke-dasharray="{ln.dash}"' if ln.dash else ""
        parts.append(f'<line x1="{lx:.0f}" y1="12" x2="{lx + 16:.0f}" y2="12" stroke="{ln.colour}" stroke-width="2"{dash}/>'
                     f'<text x="{lx + 20:.0f}" y="16">{_e(ln.label)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _engine_label(url: str, engine: str | None, n: int) -> str:
    if n == 1:
        return "engine" if engine in (None, "0", "") else f"engine {engine}"
    return f"{printable(url, 40)}" + (f" #{engine}" if engine not in (None, "") else "")


def _history_charts(pic: Picture, ax: Axis) -> str:
    engines = list(pic.history.engines.items())
    n = len(engines)

    def lines(key: str, dash: str | None = None, suffix: str = "") -> list[Line]:
        return [Line(_engine_label(url, eng, n) + suffix, series[key], ENGINE_COLOURS[i % len(ENGINE_COLOURS)], dash)
                for i, ((url, eng), series) in enumerate(engines) if key in series]

    rep = pic.report
    out = [_chart(ax, "KV cache usage", lines("kv_usage"), lambda v: units.pct(v, 0), y_max=1.0, chart_id="chart-kv",
                  empty="no engine scrapes in this trace (no KV usage to draw)")]
    rw = lines("running", suffix=" running") + lines("waiting", dash="4 3", suffix=" waiting")
    out.append(_chart(ax, "Running / waiting requests", rw, units.count_short, chart_id="chart-queue",
                      empty="no engine scrapes in this trace"))
    out.append(_chart(ax, "Preemptions per second", lines("preemptions_per_s"), lambda v: f"{v:.3g}/s",
                      chart_id="chart-preempt", empty="no engine scrapes in this trace (preemptions unknown)"))
    out.append(_gap_chart(ax, rep, lines("itl_p99_s", suffix=" ITL p99")))
    return "".join(out)


def _gap_chart(ax: Axis, rep: AnalysisReport, p99: list[Line]) -> str:
    """Token gaps over the target (each spike: a bar over its span at its height, its cause's
    glyph at its end) under the engines' ITL p99, with the target line."""
    spikes = rep.spikes[-MAX_SPIKE_MARKS:]
    tgt = rep.itl_target_s
    peak = max([s.gap_s for s in spikes] + [tgt * 1.5 if tgt else 0.0])

    def marks(y: Callable[[float], float]) -> str:
        parts = []
        if tgt:
            yy = y(tgt)
            parts.append(f'<line x1="{LEFT}" y1="{yy:.1f}" x2="{LEFT + PLOT_W}" y2="{yy:.1f}" stroke="#b3261e" '
                         f'stroke-dasharray="6 4" stroke-width="1.2"/>'
                         f'<text x="{LEFT + 6}" y="{yy - 4:.1f}" fill="#b3261e">ITL target {_e(units.duration(tgt))}</text>')
        for s in spikes:
            st = _style(s.cause)
            x0, x1, yy = ax.x(s.t_start), ax.x(s.t_end), y(s.gap_s)
            parts.append(f'<line x1="{x0:.1f}" y1="{yy:.1f}" x2="{max(x1, x0 + 1):.1f}" y2="{yy:.1f}" '
                         f'stroke="{st.colour}" stroke-width="2" opacity="0.7"/>')
            parts.append(glyph(s.cause, x1, yy, 4.5, _spike_title(s)))
        return "".join(parts)

    title = "Token gaps over the ITL target, by cause" + ("; engine ITL p99" if p99 else "")
    return _chart(ax, title, p99, units.duration_short, height=210, extra=marks, chart_id="chart-gaps", peak=peak)


def _spike_title(s: SpikeView) -> str:
    conf = f", confidence {s.confidence:.2f}" if s.confidence is not None else ""
    rule = f" ({s.rule})" if s.rule else ""
    return f"{s.request_id}: {units.duration(s.gap_s)} gap, {s.cause}{rule}{conf}"


# ---- per-request timelines --------------------------------------------------------------------

def _pick(pic: Picture) -> tuple[list[StreamSpan], int]:
    """The requests to draw: the longest gaps first (spiked ones before clean ones), at most
    MAX_TIMELINES, then in arrival order; and how many had a first token in all."""
    rows: dict[str, RequestRow] = {r.request_id: r for r in pic.report.requests}
    seen = [s for s in pic.streams if s.first_t is not None]

    def rank(s: StreamSpan) -> tuple[int, float]:
        r = rows.get(s.id)
        return (0 if r is not None and r.spikes else 1, -(r.max_gap_s if r else 0.0))

    chosen = sorted(seen, key=rank)[:MAX_TIMELINES]
    chosen.sort(key=lambda s: (s.arrive_t if s.arrive_t is not None else s.first_t or 0.0, s.id))
    return chosen, len(seen)


def _timelines(pic: Picture, ax: Axis) -> str:
    chosen, total = _pick(pic)
    if not chosen:
        return '<p class="note">No per-request token timings in this trace: no timelines to draw.</p>'
    by_req: dict[str, list[SpikeView]] = {}
    for sv in pic.report.spikes:
        by_req.setdefault(sv.request_id, []).append(sv)
    rows = {r.request_id: r for r in pic.report.requests}
    row_h = 20
    top = 8
    height = top + row_h * len(chosen) + 26
    parts = [f'<svg id="timelines" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" role="img" '
             f'aria-label="per-request timelines">', ax.grid(top - 4, height - 22)]
    for i, s in enumerate(chosen):
        yc = top + i * row_h + row_h / 2
        r = rows.get(s.id)
        label = printable(s.id, 20)
        info = f"{s.id}: {s.tokens} tokens" + (f", {r.spikes} spike(s), max gap {units.duration(r.max_gap_s)}"
                                               if r else "") + (f", ended by {s.ended_by}" if s.ended_by else "")
        parts.append(f'<g class="timeline" data-request="{_e(s.id)}"><title>{_e(info)}</title>')
        parts.append(f'<text x="{LEFT - 8}" y="{yc + 4:.1f}" text-anchor="end">{escape(label)}</text>')
        start = s.arrive_t if s.arrive_t is not None else s.first_t
        end = s.end_t if s.end_t is not None else s.last_t
        if start is not None and s.first_t is not None and s.first_t > start:
            # waiting for the first token (queue and prefill): lighter
            parts.append(f'<rect x="{ax.x(start):.1f}" y="{yc - 3:.1f}" width="{max(1.0, ax.x(s.first_t) - ax.x(start)):.1f}" '
                         f'height="6" fill="#d5dae3" rx="2"/>')
        if s.first_t is not None and end is not None:
            parts.append(f'<rect x="{ax.x(s.first_t):.1f}" y="{yc - 4:.1f}" '
                         f'width="{max(1.5, ax.x(end) - ax.x(s.first_t)):.1f}" height="8" fill="#8d97a8" rx="2"/>')
        if s.ended_by in ("cancel", "error") and end is not None:
            xe = ax.x(end)
            parts.append(f'<text x="{xe + 4:.1f}" y="{yc + 4:.1f}" fill="#b3261e">{_e(s.ended_by)}</text>')
        for sp in by_req.get(s.id, ()):
            st = _style(sp.cause)
            x0, x1 = ax.x(sp.t_start), ax.x(sp.t_end)
            parts.append(f'<rect x="{x0:.1f}" y="{yc - 6:.1f}" width="{max(2.5, x1 - x0):.1f}" height="12" '
                         f'fill="{st.colour}" rx="1.5"/>')
            parts.append(glyph(sp.cause, (x0 + max(x1, x0 + 2.5)) / 2, yc, 4.0, _spike_title(sp), hollow=True))
        parts.append("</g>")
    parts.append("</svg>")
    note = (f"{len(chosen)} of {total} requests shown: the longest gaps first, in arrival order. "
            if total > len(chosen) else f"All {total} requests, in arrival order. ")
    note += ("Light bar: waiting for the first token; dark bar: streaming; a coloured block marks each gap "
             "over the target, with its cause's shape.")
    if pic.report.spikes_total > len(pic.report.spikes):
        note += (f" The report lists the newest {len(pic.report.spikes):,} of {pic.report.spikes_total:,} spikes; "
                 "older ones are not drawn.")
    return "".join(parts) + f'<p class="note">{_e(note)}</p>'


# ---- the verdict and the causes ---------------------------------------------------------------

def _value(v: object, unit: str) -> str:
    if isinstance(v, (list, dict)):
        return _e(json.dumps(v, separators=(", ", ": ")), 160)
    return _e(units.quantity(v, unit))


def _verdict(v: Verdict | None) -> str:
    if v is None:
        return "<section><h2>Verdict</h2><p>No verdict: the trace holds too little to decide.</p></section>"
    head = v.action.replace("_", " ").upper()
    badges = [f'<span class="badge">confidence {v.confidence:.2f}</span>']
    if v.mechanism and v.mechanism != v.action:
        badges.append(f'<span class="badge">eviction mechanism: {_e(v.mechanism)}</span>')
    if v.also:
        badges.append(f'<span class="badge">also: {_e(", ".join(a.replace("_", " ") for a in v.also))}</span>')
    if v.tentative:
        badges.append('<span class="badge warn">TENTATIVE</span>')
    if v.marginal:
        badges.append('<span class="badge warn">MARGINAL</span>')
    out = [f'<section id="verdict"><h2>Verdict</h2><div class="verdict-head"><span class="action">{_e(head)}</span>'
           + "".join(badges) + "</div>"]
    if v.decided_by:
        out.append('<ul class="decided">' + "".join(f"<li><b>{_e(d.gate)}</b> {_e(d.detail)}</li>" for d in v.decided_by)
                   + "</ul>")
    if v.reasons:
        out.append("<ul>" + "".join(f"<li>{_e(r)}</li>" for r in v.reasons) + "</ul>")
    if v.settings:
        # a yes/no flag is its switch alone (``--enable-x``), as typed
        rows = "".join(f'<tr><td class="flag"><code>{_e((f.words() or [f.label])[0])}</code></td>'
                       f'<td class="num">{_e(" ".join(f.words()[1:]))}</td><td>{_e(f.why)}</td></tr>' for f in v.settings)
        out.append(f'<h2 style="margin-top:12px">Settings</h2><table class="settings"><tr><th>flag</th><th>value</th>'
                   f"<th>why</th></tr>{rows}</table>")
    out.append("</section>")
    return "".join(out)


def _numbers(v: Verdict | None) -> str:
    """Every number the verdict used, with its unit and where it came from, in two columns."""
    nums = [(k, n) for k, n in (v.numbers.items() if v else ()) if k != "decided_by" and n.value is not None]
    if not nums:
        return ""
    half = (len(nums) + 1) // 2

    def table(part: list[tuple[str, Number]]) -> str:
        rows = "".join(f'<tr><td>{_e(k)}</td><td class="num">{_value(n.value, n.unit)}</td>'
                       f'<td class="src">{_e(n.source)}{(" — " + _e(n.note)) if n.note else ""}</td></tr>'
                       for k, n in part)
        return f"<table><tr><th>number</th><th>value</th><th>source</th></tr>{rows}</table>"

    return (f'<section id="numbers"><h2>The verdict\'s numbers</h2><div class="grid">{table(nums[:half])}'
            f"{table(nums[half:])}</div></section>")


def _causes(rep: AnalysisReport) -> str:
    tgt = rep.itl_target_s
    kpis = [("ITL target", units.duration(tgt) if tgt else "unknown"),
            ("median gap", units.duration(rep.median_gap_s)),
            ("inter-token gaps", units.count(rep.gaps)),
            ("spikes over target", units.count(rep.spikes_total)),
            ("requests", units.count(len(rep.requests)))]
    out = ['<section id="causes"><h2>Spikes and their causes</h2><div class="kpis">'
           + "".join(f'<div class="kpi"><div class="v">{_e(v)}</div><div class="k">{_e(k)}</div></div>' for k, v in kpis)
           + "</div>"]
    if rep.itl_target_source:
        out.append(f'<p class="note">ITL target: {_e(rep.itl_target_source)}</p>')
    if rep.basis == "aggregate":
        out.append('<p class="note">Basis: engine aggregates only (no per-request timings): causes come from the '
                   'engine\'s ITL histogram, at lower confidence.</p>')
    over = rep.over_target_s or {}
    rows = []
    for c, row in rep.causes.items():
        mc = row.mean_confidence
        rows.append(f'<tr data-cause="{_e(c)}"><td>{_legend_icon(c)} {_e(_style(c).label)}</td>'
                    f'<td class="num">{units.count(row.count)}</td><td class="num">{units.pct(row.share)}</td>'
                    f'<td class="num">{_e(units.duration(over[c]) if c in over else units.NA)}</td>'
                    f'<td class="num">{_e(f"{mc:.2f}" if mc is not None else units.NA)}</td></tr>')
    out.append("<table><tr><th>cause</th><th>spikes</th><th>share</th><th>time over target</th>"
               "<th>mean confidence</th></tr>" + "".join(rows) + "</table></section>")
    return "".join(out)


def _legend(causes: Iterable[str]) -> str:
    return ('<div class="legend" id="legend">' + "".join(
        f'<span data-cause="{_e(c)}">{_legend_icon(c)} {_e(_style(c).label)} '
        f'<small style="color:{_style(c).colour}">({_e(_style(c).shape)})</small></span>' for c in causes) + "</div>")


def _missing(pic: Picture) -> str:
    """The report's warnings (a trace header's "missing" list among them), and what the charts lack."""
    items = list(pic.report.warnings)
    if not pic.history.engines and not any("engine scrapes" in w for w in items):
        items.append("no engine scrapes: the KV usage, queue and preemption charts are empty and no cause "
                     "could lean on engine evidence")
    if pic.history_capped:
        items.append("the trace is longer than the charts keep: they show its end")
    if not items:
        return ""
    return ('<section class="warn-box" id="warnings"><h2>What this analysis could not see</h2><ul>'
            + "".join(f"<li>{_e(x)}</li>" for x in dict.fromkeys(items)) + "</ul></section>")


def render_html(pic: Picture) -> str:
    """The whole page, as one string."""
    rep = pic.report
    t0 = pic.t0 if pic.t0 is not None else 0.0
    ax = Axis(t0, pic.t1)
    h_eng = pic.header.get("engine")
    eng: dict[str, object] = h_eng if isinstance(h_eng, dict) else {}
    meta = [f"{units.count(rep.records)} records", f"{_t_label(round(ax.t1 - ax.t0, 1))} of trace"]
    if eng.get("adapter"):
        meta.insert(0, str(eng["adapter"]) + (f" · {eng['model']}" if eng.get("model") else ""))
    if pic.header.get("started_at"):
        meta.append(f"started {pic.header['started_at']}")
    verdict_line = rep.verdict.action.replace("_", " ") if rep.verdict else "no verdict"
    causes = list(CAUSE_STYLE)
    body = [
        '<header class="top">',
        f"<h1>kvtop analysis — {_e(pic.source, 80)}</h1>",
        f'<span class="meta">{_e(" · ".join(meta))}</span></header>',
        _verdict(rep.verdict),
        _causes(rep),
        _missing(pic),
        '<section id="history"><h2>History</h2>', _legend(causes),
        _history_charts(pic, ax),
        '<p class="note">Every chart shares the time axis (seconds since the trace\'s first record). '
        "Each column shows the highest sample in it, so short peaks stay visible.</p></section>",
        '<section id="requests"><h2>Requests</h2>', _legend(causes), _timelines(pic, ax), "</section>",
        _numbers(rep.verdict),
        f"<footer>kvtop {_e(__version__)} · a self-contained page: no script, no network</footer>",
    ]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>kvtop analysis: {_e(verdict_line)} — {_e(pic.source, 80)}</title>"
            f"<style>{CSS}</style></head><body><main>\n" + "\n".join(body) + "\n</main></body></html>\n")
