"""Helpers shared by the built-in adapters (not part of the adapter contract).

``Page`` selects by exact label equality; the adapters here also need "rows that carry this rank
or do not carry the label at all", counters whose ``_total`` suffix depends on whether the page
declared a ``# TYPE`` (prometheus-client appends ``_total`` to declared counters, a line re-read on
its own after a parse error keeps its wire name), and truncation checks.

The adapters here deliberately expose only ``parse(text, t)``, not a ``parse_page(Page, t)``
shortcut: the truncation checks need the raw text (a missing final newline).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable

from kvtop.model.records import Histogram
from kvtop.sources.prom import Labels, Page, parse_page

Keep = Callable[[Labels], bool]


def _all(_: Labels) -> bool:
    return True


def read_page(text: str, core: tuple[str, ...] = ()) -> Page:
    """Parse ``text`` and warn about signs of a cut-off page.

    ``core`` are sample names every version of the engine exports; a page lacking all of them
    while carrying other names was most likely cut short (or is not this engine at all).
    """
    page = parse_page(text)
    if text and not text.endswith("\n"):
        page.warnings.append("metrics page does not end with a newline: truncated?")
    if core and page.samples and not any(c in page.samples for c in core):
        page.warnings.append("metrics page lacks every core family (" + ", ".join(core) + "): truncated or renamed?")
    return page


def counter_names(base: str) -> tuple[str, ...]:
    """Both spellings of a counter exported without ``_total`` (TGI, Triton, llama.cpp oddities)."""
    return (base,) if base.endswith("_total") else (base, base + "_total")


def rows(page: Page, name: str, keep: Keep = _all) -> list[tuple[Labels, float]]:
    return [(lb, v) for lb, v in page.samples.get(name, ()) if keep(lb)]


def total(page: Page, names: tuple[str, ...] | str, keep: Keep = _all) -> float | None:
    """Sum of the first present name's kept, non-NaN samples (None if absent)."""
    for n in (names,) if isinstance(names, str) else names:
        if n in page.samples:
            vals = [v for _, v in rows(page, n, keep) if not math.isnan(v)]
            return sum(vals) if vals else None
    return None


def histogram(page: Page, base: str, keep: Keep = _all, scale: float = 1.0) -> Histogram | None:
    """Cumulative histogram summed over kept series; ``scale`` converts units (ms -> s: 0.001)."""
    by_le: dict[float, float] = defaultdict(float)
    for lb, v in rows(page, base + "_bucket", keep):
        try:
            by_le[float(lb["le"]) * scale] += v
        except (KeyError, ValueError):
            continue
    if not by_le:
        return None
    buckets = sorted(by_le.items())
    count = total(page, base + "_count", keep)
    s = total(page, base + "_sum", keep)
    if count is None:
        count = buckets[-1][1]
    return Histogram(buckets, count, s * scale if s is not None else math.nan)


def incomplete_histograms(page: Page, bases: tuple[str, ...]) -> list[str]:
    """Warnings for histograms cut before their ``+Inf`` bucket (a page truncated mid-family)."""
    out = []
    for b in bases:
        bucket_rows = page.samples.get(b + "_bucket")
        if bucket_rows and not any(lb.get("le") in ("+Inf", "Inf", "inf") for lb, _ in bucket_rows):
            out.append(f"histogram {b} has no +Inf bucket: page truncated?")
    return out


def first_label(page: Page, names: tuple[str, ...], label: str, keep: Keep = _all) -> str | None:
    for n in names:
        for lb, _ in rows(page, n, keep):
            if lb.get(label):
                return lb[label]
    return None
