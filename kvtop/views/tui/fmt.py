"""Pure layout for the console: severities, text sparklines, bars and the request timeline. No
Textual here so it is cheap to test and to benchmark; numbers are formatted by kvtop.units."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvtop.model.analysis import SpikeView
from kvtop.snapshot import KV_CRIT, KV_WARN, PREEMPT_CRIT_PER_S, PREEMPT_WARN_PER_S

_BLOCKS = " ▁▂▃▄▅▆▇█"

# Severity names map to theme variables in kvtop.tcss / markup ($success, $warning, $error).
SEV_VAR = {"ok": "$success", "warn": "$warning", "crit": "$error", "na": "$text-muted"}


def sev_kv(u: float | None) -> str:
    if u is None:
        return "na"
    return "crit" if u >= KV_CRIT else "warn" if u >= KV_WARN else "ok"


def sev_preempt(r: float | None) -> str:
    if r is None:
        return "na"
    return "crit" if r >= PREEMPT_CRIT_PER_S else "warn" if r > PREEMPT_WARN_PER_S else "ok"


def sev_latency(v: float | None, target: float | None) -> str:
    """Over the target is critical; within 20% of it is a warning."""
    if v is None or target is None:
        return "na"
    return "crit" if v > target else "warn" if v > 0.8 * target else "ok"


def fold_max(vals: Sequence[float], width: int) -> list[float]:
    """``vals`` in at most ``width`` columns, each the largest of its run (a short burst stays seen)."""
    n = len(vals)
    if n <= width:
        return list(vals)
    return [max(vals[i * n // width:(i + 1) * n // width] or [0.0]) for i in range(width)]


def spark(values: Sequence[float], width: int, top: float | None = None) -> str:
    """Last ``width`` values as block characters scaled to ``top`` (a link's capacity), not to the
    data's own max, so a flat line at 5% of a link reads as nearly empty. Peaks within a column
    are kept (max) so short bursts stay visible."""
    if width <= 0:
        return ""
    vals = list(values)[-width * 4:]
    if not vals:
        return " " * width
    cols = fold_max(vals, width)
    scale = top if top and top > 0 else max(max(cols), 1e-12)
    out = []
    for v in cols:
        f = 0.0 if v is None or v <= 0 else min(1.0, v / scale)
        # anything non-zero gets at least the lowest block
        idx = 0 if f == 0 else max(1, round(f * 8))
        out.append(_BLOCKS[idx])
    return "".join(out).rjust(width)


def mem_bar(used: int | None, reserved: int | None, total: int | None, width: int) -> tuple[int, int, int]:
    """Columns for (used, reserved-but-not-used, free). Reserved is memory the driver/engine holds
    that NVML does not count as used; it is drawn after used."""
    if not total or width <= 0:
        return 0, 0, max(0, width)
    u = min(width, round((used or 0) / total * width))
    r = min(width - u, round((reserved or 0) / total * width))
    return u, r, width - u - r


@dataclass(frozen=True, slots=True)
class TimelineCols:
    """The request timeline at one character per ``dt`` seconds."""

    t0: float
    dt: float
    tokens: list[int]  # tokens arrived in each column
    spike: list[str | None]  # cause of a spike covering the column, if any
    spike_starts: list[tuple[int, SpikeView]]  # (column, spike) for labels
    engine: list[str]  # "" or "P" (preemption rise) / "B" (prompt burst) / "p"/"r" request marks


def timeline_cols(
    tokens: Sequence[tuple[float, int]],
    t0: float,
    t1: float,
    width: int,
    spikes: Sequence[SpikeView] = (),
    engine_marks: Sequence[tuple[float, str, float]] = (),
    marks: Sequence[tuple[float, str]] = (),
) -> TimelineCols:
    width = max(1, width)
    span = max(t1 - t0, 1e-6)
    dt = span / width

    def col(t: float) -> int:
        return min(width - 1, max(0, int((t - t0) / dt)))

    tok = [0] * width
    for t, n in tokens:
        if t0 <= t <= t1:
            tok[col(t)] += n
    sp: list[str | None] = [None] * width
    starts: list[tuple[int, SpikeView]] = []
    for s in spikes:
        a, b = s.t_start, s.t_end
        if b < t0 or a > t1:
            continue
        ca, cb = col(a), col(b)
        for c in range(ca, cb + 1):
            sp[c] = s.cause or "unknown"
        starts.append((ca, s))
    eng = [""] * width
    for t, kind, _amount in engine_marks:
        if t0 <= t <= t1:
            c = col(t)
            eng[c] = "P" if kind == "preemption" or eng[c] == "P" else "B"
    for t, kind in marks:
        if t0 <= t <= t1:
            c = col(t)
            if not eng[c]:
                eng[c] = "p" if kind == "preempt" else "r"
    return TimelineCols(t0, dt, tok, sp, sorted(starts, key=lambda x: x[0]), eng)


def nice_ticks(t0: float, t1: float, width: int, min_gap: int = 10) -> list[tuple[int, str]]:
    """Axis labels (column, text) at round second steps, at least ``min_gap`` columns apart."""
    span = max(t1 - t0, 1e-6)
    max_ticks = max(1, width // min_gap)
    raw = span / max_ticks
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    out = []
    k = 0
    while True:
        v = k * step
        if v > span + 1e-9:
            break
        c = min(width - 1, int(v / span * width))  # the same column mapping as timeline_cols
        label = f"{v:g}s"
        out.append((c, label))
        k += 1
    return out
