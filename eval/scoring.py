"""Score attribution against a trace's truth records (evaluation only): precision and recall per
cause, and how well stated confidence matches the share of calls that were right.

kvtop never imports this module (an import contract): ``kvtop analyze`` never reads truth records.
A spike's true cause is the truth stall of the same request that overlaps it most (``eval.truth``).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from eval.truth import TRUTH_CAUSES, Truth, label_span, truth_intervals
from kvtop.model.analysis import AnalysisReport


def labelled(report: AnalysisReport,
             truth: Truth) -> list[tuple[str, str | None, float]]:
    """(predicted cause, true cause or None, stated confidence) per reported spike."""
    return [(s.cause, label_span(s.request_id, s.t_start, s.t_end, truth, report.itl_target_s),
             float(s.confidence or 0.0))
            for s in report.spikes]


def precision_recall(pairs: list[tuple[str, str | None]], causes: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Per cause: predicted, actual, true positives, precision and recall (None when undefined)."""
    res: dict[str, dict[str, Any]] = {}
    for c in causes:
        pred = sum(1 for p, _ in pairs if p == c)
        actual = sum(1 for _, t in pairs if t == c)
        tp = sum(1 for p, t in pairs if p == c and t == c)
        res[c] = {"predicted": pred, "actual": actual, "tp": tp,
                  "precision": tp / pred if pred else None, "recall": tp / actual if actual else None}
    return res


def score(report: AnalysisReport, path: str) -> dict[str, Any]:
    """Precision and recall per cause over the spikes found (true label from truth records)."""
    pairs = [(p, t) for p, t, _ in labelled(report, truth_intervals(path))]
    res: dict[str, Any] = dict(precision_recall(pairs, TRUTH_CAUSES))
    res["spikes"] = len(pairs)
    res["unlabelled"] = sum(1 for _, t in pairs if t is None)
    return res


def reliability_table(calls: list[tuple[float, bool]], min_bin: int = 50) -> tuple[list[str], float]:
    """Stated confidence vs the share right, per 0.1 bin of ``(confidence, right)`` calls: the table's
    lines, and the worst error among bins holding at least ``min_bin`` calls."""
    bins: dict[int, list[tuple[float, bool]]] = defaultdict(list)
    for c, ok in calls:
        bins[min(9, int(c * 10))].append((c, ok))
    lines = [f"{'confidence':<12}{'spikes':>8}{'stated':>8}{'observed':>10}{'error':>7}"]
    worst = 0.0
    for b in range(10):
        xs = bins.get(b)
        if not xs:
            continue
        stated = sum(c for c, _ in xs) / len(xs)
        observed = sum(ok for _, ok in xs) / len(xs)
        if len(xs) >= min_bin:
            worst = max(worst, abs(observed - stated))
        flag = "" if len(xs) >= min_bin else f"  (< {min_bin} spikes)"
        lines.append(f"{b / 10:.1f}-{(b + 1) / 10:.1f}{'':<5}{len(xs):>8}{stated:>8.2f}{observed:>10.2f}"
                     f"{abs(observed - stated):>7.2f}{flag}")
    return lines, worst
