"""The engine's decode step against its running batch, from its own scrapes (docs/kv-science.md §8.2).

Between two scrapes of one engine, the ITL histogram's sum and count give the mean inter-token gap
(one decode step) and ``generation_tokens_total`` the tokens generated per second, at the running
batch the two scrapes' gauges say (their mean). Folded into log-spaced bins of the running batch, a
bounded table per engine: what batch size buys which step and which throughput on this hardware and
this traffic, measured. The advisor reads it to tell a batch limit that meets the ITL target and
serves the offered load from one that meets the target by queueing the load (Little's law).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

# Bins a quarter of an octave wide (about 19 %): a step changes little within one, and a run whose
# batch spans 1..1,024 sequences keeps at most ~40 of them.
BIN_RATIO = 2 ** 0.25
# A bin read from fewer scrape intervals than this is left out of the table (one interval is one
# scrape's noise: a prefill burst or a scrape landing mid-step).
MIN_INTERVALS = 3


@dataclass
class _Bin:
    intervals: int = 0
    seconds: float = 0.0
    running_s: float = 0.0  # running batch x seconds (the bin's time-weighted batch)
    itl_sum: float = 0.0  # seconds of inter-token gaps
    itl_count: float = 0.0  # inter-token gaps
    tokens: float = 0.0  # generated tokens
    tokens_known: bool = True  # every interval had the generation counter


@dataclass
class StepCurve:
    bins: dict[int, _Bin] = field(default_factory=dict)

    def add(self, prev: dict[str, Any], cur: dict[str, Any]) -> None:
        """One interval between two scrapes of the same engine (skipped where a counter reset or a
        gauge or the histogram is missing)."""
        dt = _num(cur.get("t")) - _num(prev.get("t"))
        r0, r1 = _num(prev.get("running")), _num(cur.get("running"))
        h0, h1 = prev.get("itl"), cur.get("itl")
        if not (dt > 0 and r0 >= 0 and r1 >= 0 and isinstance(h0, dict) and isinstance(h1, dict)):
            return
        dc = _num(h1.get("count")) - _num(h0.get("count"))
        ds = _num(h1.get("sum")) - _num(h0.get("sum"))
        run = (r0 + r1) / 2
        if not (dc > 0 and ds > 0 and run >= 1):
            return  # no decode in this interval, or the histogram reset
        b = self.bins.setdefault(round(math.log(run, BIN_RATIO)), _Bin())
        b.intervals += 1
        b.seconds += dt
        b.running_s += run * dt
        b.itl_sum += ds
        b.itl_count += dc
        dg = _num(cur.get("generation_tokens_total")) - _num(prev.get("generation_tokens_total"))
        if dg >= 0:
            b.tokens += dg
        else:
            b.tokens_known = False

    def points(self) -> list[dict[str, float]]:
        """The table, smallest batch first: ``running`` (sequences), ``itl_ms`` (the mean step),
        ``tokens_per_s`` (generated; running / step where the engine has no generation counter) and
        ``seconds`` of the run it rests on. Rounded here, so a saved scenario carries the same figures."""
        out = []
        for _, b in sorted(self.bins.items()):
            if b.intervals < MIN_INTERVALS:
                continue
            running = b.running_s / b.seconds
            itl = b.itl_sum / b.itl_count
            tps = b.tokens / b.seconds if b.tokens_known and b.tokens > 0 else running / itl
            out.append({"running": round(running, 1), "itl_ms": round(itl * 1e3, 2),
                        "tokens_per_s": round(tps, 1), "seconds": round(b.seconds, 1)})
        return out


def _num(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else math.nan
