"""vLLM's per-request preemption histogram joined with the finishes kvtop observed.

``vllm:request_num_preemptions`` is observed once per request, when it finishes, with the number of
times that request was preempted. Between two scrapes the histogram's count rises by the requests
that finished and its sum by their preemptions. Where exactly one request finished in an interval
and kvtop observed exactly one finish there, the engine has told that request's preemption count:
kvtop's preemption spikes on it can be checked one by one. Over a run the sums must agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MAX_PINNED = 5000


@dataclass
class _Prev:
    t: float
    count: float
    total: float


@dataclass
class RequestPreemptions:
    """Engine-side preemption counts of finished requests (bounded)."""

    finished: float = 0.0  # finished requests the histogram counted
    preemptions: float = 0.0  # their preemptions
    pinned: dict[str, int] = field(default_factory=dict)  # request id -> the engine's count
    _prev: dict[Any, _Prev] = field(default_factory=dict)
    _finishes: list[tuple[float, str]] = field(default_factory=list)  # observed finishes since the oldest scrape

    def finish(self, t: float, rid: str) -> None:
        self._finishes.append((t, rid))

    def scrape(self, key: Any, t: float, count: float | None, total: float | None) -> None:
        if count is None or total is None:
            return
        prev = self._prev.get(key)
        self._prev[key] = _Prev(t, count, total)
        if prev is None or count < prev.count or total < prev.total:
            return  # first reading, or the engine restarted
        dc, ds = count - prev.count, total - prev.total
        self.finished += dc
        self.preemptions += ds
        # the finish event reaches kvtop a moment after the engine observed it: an interval's
        # finishes are those seen between the two scrapes
        inside = [rid for ft, rid in self._finishes if prev.t < ft <= t]
        if dc == 1 and len(self._prev) == 1 and len(inside) == 1 and len(self.pinned) < MAX_PINNED:
            self.pinned[inside[0]] = int(round(ds))
        oldest = min(p.t for p in self._prev.values())
        self._finishes = [(ft, rid) for ft, rid in self._finishes if ft > oldest]

    def report(self, spikes_of: dict[str, int]) -> dict[str, Any] | None:
        """The check as the report shows it; ``spikes_of`` = kvtop's preemption spikes per request id."""
        if not self._prev:
            return None
        agree = sum(1 for rid, n in self.pinned.items() if spikes_of.get(rid, 0) == n)
        more = sum(1 for rid, n in self.pinned.items() if spikes_of.get(rid, 0) > n)
        return {"finished_requests": self.finished, "engine_preemptions": self.preemptions,
                "pinned_requests": len(self.pinned), "pinned_agree": agree, "pinned_kvtop_more": more,
                "pinned_kvtop_fewer": len(self.pinned) - agree - more}
