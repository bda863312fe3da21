"""Pure chart layout for the console's history charts: columns of values -> rows of (text, role)
runs. No Textual here (cheap to test, and the bench can time it alone); kvtop/views/tui/charts.py turns
roles into theme colours.

A chart is one primary series drawn as bars with eighth-row resolution (the level is readable at a
glance, and an hour squeezed into 60 columns keeps each column's maximum so spikes stay visible),
an optional secondary series drawn as a line marker in its row, and an optional reference level
(the ITL target, the link capacity, the memory total) drawn as a dotted rule where the bars leave
room.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Mapping, Sequence

_EIGHTHS = " ▁▂▃▄▅▆▇█"
BAR, LINE, REF, EMPTY, OVER = "bar", "line", "ref", "empty", "over"


def scale_top(values: Sequence[float | None], ref: float | None = None, fixed: float | None = None) -> float:
    """The y axis' top: ``fixed`` when given, else a little above the largest value or reference."""
    if fixed is not None:
        return fixed
    top = max([v for v in values if v is not None and not math.isnan(v)] + ([ref] if ref else []) + [0.0])
    if top <= 0:
        return 1.0
    # round up to 1, 2 or 5 times a power of ten so the axis label is a round number
    exp = 10 ** math.floor(math.log10(top * 1.05))
    for m in (1, 2, 2.5, 5, 10):
        if m * exp >= top * 1.05:
            return float(m * exp)
    return float(10 * exp)


def plot_rows(primary: Sequence[float | None], secondary: Sequence[float | None] | None, top: float,
              height: int, ref: float | None = None, over: float | None = None) -> list[list[tuple[str, str]]]:
    """``height`` rows (top first) of ``len(primary)`` cells, as runs of (text, role).

    Roles: ``bar`` (primary), ``over`` (primary bars above ``over``, e.g. the ITL target),
    ``line`` (secondary marker), ``ref`` (reference rule), ``empty``.
    """
    n = len(primary)
    levels = height * 8
    ref_row = None
    if ref is not None and top > 0 and 0 <= ref <= top:
        ref_row = height - 1 - min(height - 1, int(ref / top * height))
    sec_row: list[int | None] = [None] * n
    if secondary is not None:
        for c, v in enumerate(secondary):
            if v is not None and not math.isnan(v) and top > 0:
                sec_row[c] = height - 1 - min(height - 1, max(0, int(min(v, top) / top * height - 1e-9)))
    rows: list[list[tuple[str, str]]] = []
    for r in range(height):
        base = (height - 1 - r) * 8  # eighths below this row
        cells: list[tuple[str, str]] = []
        for c in range(n):
            v = primary[c]
            if sec_row[c] == r:
                cells.append(("━", LINE))
                continue
            if v is None or math.isnan(v) or top <= 0:
                cells.append(("┈", REF) if r == ref_row else (" ", EMPTY))
                continue
            k = max(0, min(levels, round(v / top * levels))) - base
            if v > 0 and k <= 0 and r == height - 1:
                k = 1  # a non-zero value always shows at least a sliver
            if k <= 0:
                cells.append(("┈", REF) if r == ref_row else (" ", EMPTY))
            else:
                role = OVER if over is not None and v > over else BAR
                cells.append((_EIGHTHS[min(8, k)], role))
        rows.append(_runs(cells))
    return rows


def _runs(cells: list[tuple[str, str]]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for ch, role in cells:
        if out and out[-1][1] == role:
            out[-1] = (out[-1][0] + ch, role)
        else:
            out.append((ch, role))
    return out


Marks = Mapping[str, Sequence[float]]  # cause -> sorted times of the spikes with that cause
RANK = ("preemption", "prefill_interference", "slow_decode")


def marks_between(marks: Marks, t0: float, t1: float) -> dict[str, int]:
    """How many marks of each cause fall in [t0, t1]."""
    out = {}
    for cause, ts in marks.items():
        k = bisect_right(ts, t1) - bisect_left(ts, t0)
        if k:
            out[cause] = k
    return out


def mark_row(n: int, t0: float, t1: float, marks: Marks) -> list[str | None]:
    """Per column, the cause of the highest-ranked mark in it (preemption first), or None: a few
    binary searches a column, however many spikes the window holds."""
    out: list[str | None] = [None] * n
    if n <= 0 or t1 <= t0 or not marks:
        return out
    order = [c for c in RANK if c in marks] + sorted(c for c in marks if c not in RANK)
    dt = (t1 - t0) / n
    for cause in reversed(order):  # higher ranks overwrite lower ones
        ts = marks[cause]
        i = bisect_left(ts, t0)
        if i >= len(ts) or ts[i] > t1:
            continue
        for c in range(n):
            a = t0 + c * dt
            b = t1 if c == n - 1 else a + dt
            i = bisect_left(ts, a, i)
            if i >= len(ts):
                break
            if ts[i] <= b:
                out[c] = cause
    return out


def window_label(seconds: float) -> str:
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{seconds / 3600:.0f}h"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{seconds / 60:.0f}m"
    return f"{seconds:.0f}s"
