"""Score attribution against a simulated trace's ``truth`` records (evaluation only).

kvtop never imports this module (an import contract): ``kvtop analyze`` never reads truth records.
A spike's true cause is the truth event for the same request whose stall overlaps the spike most:
a preemption (``resume`` with t_start/t_end, or ``preempt`` followed by a ``cancel``), a prefill
stall that lists the request among the ``affected`` streams, or a ``stall`` record (one stalled gap
of one stream with its ``cause``: engine causes or delivery causes such as a slow reader or a host
pause, as written by the independent generator in eval/tracegen). With ``engine_wide``, a
``slow_step`` run (no stream list: every decoding stream waited) labels every stream's overlapping
gaps ``slow_decode`` (and wins a tie with a prefill stall: the decode part alone missed the target).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from kvtop.model.analysis import AnalysisReport
from kvtop.model.trace import TraceReader

TRUTH_CAUSES = ("preemption", "prefill_interference")
# stalls that happen between the engine and the client: never the engine's doing
NON_ENGINE_CAUSES = ("slow_reader", "api_merge", "api_stall", "host_pause")
ANY_STREAM = "*"  # key of intervals that apply to every stream


def truth_intervals(path: str, engine_wide: bool = False) -> dict[str, list[tuple[float, float, str]]]:
    out: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    open_pre: dict[str, float] = {}
    for d in TraceReader(path).dicts():
        if d.get("kind") != "truth":
            continue
        ev, rid, data = d.get("event"), d.get("request_id"), d.get("data") or {}
        if ev == "preempt" and rid:
            open_pre[rid] = d["t"]
        elif ev == "resume" and rid:
            out[rid].append((data.get("t_start", open_pre.get(rid, d["t"])), data.get("t_end", d["t"]), "preemption"))
            open_pre.pop(rid, None)
        elif ev == "cancel" and rid and rid in open_pre:
            out[rid].append((open_pre.pop(rid), d["t"], "preemption"))
        elif ev == "prefill_stall":
            for a in data.get("affected", []):
                out[a].append((data["t_start"], data["t_end"], "prefill_interference"))
        elif ev == "stall" and rid:
            out[rid].append((data["t_start"], data["t_end"], data["cause"]))
        elif ev == "slow_step" and engine_wide:
            out[ANY_STREAM].append((data["t_start"], data["t_end"], "slow_decode"))
    return out


def label(spike: Mapping[str, Any], truth: dict[str, list[tuple[float, float, str]]]) -> str | None:
    """The true cause of a spike given as ``{"request_id", "t_start", "t_end"}``."""
    return label_span(spike["request_id"], spike["t_start"], spike["t_end"], truth)


def label_span(request_id: str, t_start: float, t_end: float,
               truth: dict[str, list[tuple[float, float, str]]]) -> str | None:
    """The truth stall that overlaps [t_start, t_end] most: of the request itself, else engine-wide."""
    best, best_ov = None, 0.0
    for a, b, cause in truth.get(request_id, ()):
        ov = min(b, t_end) - max(a, t_start)
        if ov > best_ov:
            best, best_ov = cause, ov
    for a, b, cause in truth.get(ANY_STREAM, ()):
        ov = min(b, t_end) - max(a, t_start)
        # a prefill step inside a run of steps whose decode part alone misses the target: the
        # stall would have happened without the prefill
        if ov > best_ov or (ov > 0 and ov >= best_ov and best == "prefill_interference"):
            best, best_ov = cause, ov
    return best


def labelled(report: AnalysisReport,
             truth: dict[str, list[tuple[float, float, str]]]) -> list[tuple[str, str | None, float]]:
    """(predicted cause, true cause or None, stated confidence) per reported spike."""
    return [(s.cause, label_span(s.request_id, s.t_start, s.t_end, truth), float(s.confidence or 0.0))
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
