"""A plain rule baseline written from the rules table in docs/rules.md.

It judges the spikes kvtop found (same spikes, so the two are scored on one set) with only the
table's headline signals and no KV rules:

* less than 2x the stream's own previous gaps -> slow_decode;
* a lone stall (another active stream kept receiving tokens through it, or no other stream) with a
  preemption-counter step near its end (each step claimed once; window: from 0.25 s before the end
  to 1.5 scrape intervals + 0.25 s after) -> preemption, on engines that preempt;
* a shared stall (every other active stream silent over at least half of it) with another
  request's first token at its end, or a prompt-token jump in the counters -> prefill_interference;
* anything else -> unknown.

It reads the trace itself (never kvtop's evidence) and never reads truth records.
"""

from __future__ import annotations

import json
from bisect import bisect_left, bisect_right
from typing import Any

NO_PREEMPT_ADAPTERS = ("tgi", "llamacpp")


class TraceIndex:
    def __init__(self, path: str):
        self.tokens: dict[str, list[float]] = {}
        self.first: dict[str, float] = {}
        self.end: dict[str, float] = {}
        self.prompt: dict[str, int] = {}
        self.first_tokens: list[tuple[float, str]] = []
        scrapes: dict[Any, list[tuple[float, float | None, float | None]]] = {}
        self.preempts = True
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    d = json.loads(line)
                except ValueError:
                    continue
                k = d.get("kind")
                if k == "header":
                    self.preempts = (d.get("engine") or {}).get("adapter") not in NO_PREEMPT_ADAPTERS
                elif k == "request":
                    rid, ev, t = d["id"], d["event"], d["t"]
                    if ev in ("first_token", "token"):
                        self.tokens.setdefault(rid, []).append(t)
                        if ev == "first_token" and rid not in self.first:
                            self.first[rid] = t
                            self.first_tokens.append((t, rid))
                    elif ev in ("finish", "cancel", "error"):
                        self.end.setdefault(rid, t)
                    elif ev == "arrive" and d.get("prompt_tokens") is not None:
                        self.prompt[rid] = d["prompt_tokens"]
                elif k == "engine" and d.get("up", True):
                    scrapes.setdefault((d.get("url"), d.get("engine")), []).append(
                        (d["t"], d.get("preemptions_total"), d.get("prompt_tokens_total")))
        self.first_tokens.sort()
        self.ft_t = [t for t, _ in self.first_tokens]
        # counter steps (scrape time, units left) and prompt-counter deltas per scrape interval
        self.steps: list[list[float]] = []
        self.prompt_pts: list[tuple[float, float]] = []
        diffs: list[float] = []
        for pts in scrapes.values():
            for (t0, p0, q0), (t1, p1, q1) in zip(pts, pts[1:], strict=False):
                diffs.append(t1 - t0)
                if p0 is not None and p1 is not None and p1 > p0:
                    self.steps.append([t1, p1 - p0])
                if q0 is not None and q1 is not None:
                    self.prompt_pts.append((t1, max(0.0, q1 - q0)))
        self.steps.sort()
        self.prompt_pts.sort()
        diffs.sort()
        self.interval = diffs[len(diffs) // 2] if diffs else 1.0
        deltas = sorted(q for _, q in self.prompt_pts)
        self.typical_prompt = deltas[len(deltas) // 2] if deltas else 0.0
        self.streams = sorted((self.first[r], self.end.get(r, float("inf")), r) for r in self.first)

    def own_baseline(self, rid: str, a: float) -> float | None:
        ts = self.tokens.get(rid, [])
        i = bisect_right(ts, a + 1e-9)  # tokens up to the stall's start
        prev = [ts[k] - ts[k - 1] for k in range(max(1, i - 8), i)]
        if not prev:
            return None
        prev.sort()
        return prev[len(prev) // 2]

    def silent_over_half(self, rid: str, a: float, b: float) -> bool:
        ts = self.tokens.get(rid, [])
        i, j = bisect_right(ts, a), bisect_left(ts, b)
        pts = [a, *ts[i:j], b]
        return max(y - x for x, y in zip(pts, pts[1:], strict=False)) >= 0.5 * (b - a)

    def claim(self, b: float) -> bool:
        tol = 1.5 * self.interval + 0.25
        best = None
        i = bisect_left(self.steps, [b - 0.25])
        while i < len(self.steps) and self.steps[i][0] <= b + tol:
            st = self.steps[i]
            if st[1] >= 1 and (best is None or abs(st[0] - b) < abs(best[0] - b)):
                best = st
            i += 1
        if best is None:
            return False
        best[1] -= 1
        return True

    def prompt_jump(self, a: float, b: float) -> bool:
        lo = bisect_left(self.prompt_pts, (a,))
        hi = bisect_right(self.prompt_pts, (b + 1.5 * self.interval + 0.25, float("inf")))
        pts = self.prompt_pts[lo:hi]
        tot = sum(q for _, q in pts)
        return tot >= 512 and tot > 1.5 * self.typical_prompt * max(1, len(pts))

    def first_token_at_end(self, rid: str, a: float, b: float, base: float) -> bool:
        d = max(0.05, 2.0 * base)
        i = bisect_left(self.ft_t, b - d)
        while i < len(self.ft_t) and self.ft_t[i] <= b + d:
            if self.first_tokens[i][1] != rid and self.ft_t[i] > a:
                return True
            i += 1
        return False


def classify(spikes: list[dict[str, Any]], idx: TraceIndex) -> list[str]:
    """The baseline's cause for each spike (same order); counter steps are claimed in end order."""
    out = [""] * len(spikes)
    for k in sorted(range(len(spikes)), key=lambda k: (spikes[k]["t_end"], spikes[k]["request_id"])):
        s = spikes[k]
        rid, a, b = s["request_id"], s["t_start"], s["t_end"]
        gap = b - a
        base = idx.own_baseline(rid, a)
        if base and gap < 2.0 * base:
            out[k] = "slow_decode"
            continue
        others = flowing = 0
        for f0, e0, other in idx.streams:
            if f0 >= a:
                break
            if other == rid or e0 <= b:
                continue
            others += 1
            if not idx.silent_over_half(other, a, b):
                flowing += 1
        if flowing or not others:
            out[k] = "preemption" if idx.preempts and idx.claim(b) else "unknown"
        elif idx.first_token_at_end(rid, a, b, base or 0.02) or idx.prompt_jump(a, b):
            out[k] = "prefill_interference"
        else:
            out[k] = "unknown"
    return out
