"""Slow decode: the spike is no outlier for its stream — its gaps were already about as long."""

from __future__ import annotations

from kvtop.analysis.attribution.causes import Cause, Finding
from kvtop.analysis.attribution.evidence import Evidence
from kvtop.analysis.attribution.thresholds import REL_SLOW


def judge(ev: Evidence) -> Finding | None:
    rel = ev.rel
    if rel is None or rel >= REL_SLOW:
        return None
    return Finding(Cause.SLOW_DECODE, 0.7 if ev.baseline_is_stream else 0.5,
                   [f"gap {ev.gap.gap * 1e3:.0f} ms is only {rel:.1f}x this stream's recent gaps: all gaps lifted"])
