"""Score attribution against a simulated trace's ``truth`` records (tests and bench only).

Nothing in the analysis path imports this module: ``kvtop analyze`` never reads truth records.
A spike's true cause is the truth event for the same request whose stall overlaps the spike most:
a preemption (``resume`` with t_start/t_end, or ``preempt`` followed by a ``cancel``) or a prefill
stall that lists the request among the ``affected`` streams.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from kvtop.model.trace import TraceReader

TRUTH_CAUSES = ("preemption", "prefill_interference")


def truth_intervals(path: str) -> dict[str, list[tuple[float, float, str]]]:
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
    return out


def label(spike: dict[str, Any], truth: dict[str, list[tuple[float, float, str]]]) -> str | None:
    best, best_ov = None, 0.0
    for a, b, cause in truth.get(spike["request_id"], ()):
        ov = min(b, spike["t_end"]) - max(a, spike["t_start"])
        if ov > best_ov:
            best, best_ov = cause, ov
    return best


def score(report: dict[str, Any], path: str) -> dict[str, Any]:
    """Precision and recall per cause over the spikes found (true label from truth records)."""
    truth = truth_intervals(path)
    res: dict[str, Any] = {}
    labelled = [(s["cause"], label(s, truth)) for s in report["spikes"]]
    for c in TRUTH_CAUSES:
        pred = sum(1 for p, _ in labelled if p == c)
        actual = sum(1 for _, t in labelled if t == c)
        tp = sum(1 for p, t in labelled if p == c and t == c)
        res[c] = {"predicted": pred, "actual": actual, "tp": tp,
                  "precision": tp / pred if pred else None, "recall": tp / actual if actual else None}
    res["spikes"] = len(labelled)
    res["unlabelled"] = sum(1 for _, t in labelled if t is None)
    return res
