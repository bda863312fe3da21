"""vLLM's per-request preemption histogram joined with the finishes kvtop observed.

``vllm:request_num_preemptions`` is observed once per request, when it finishes, with the number of
times that request was preempted. Between two scrapes the histogram's count rises by the requests
that finished and its sum by their preemptions. Where exactly one request finished in an interval
and kvtop observed exactly one finish there, the engine has told that request's preemption count:
kvtop's preemption spikes on it can be checked one by one. Over a run the sums must agree.
Where streams name their engine, an engine's interval is matched with that engine's finishes only
(several engines in one run then pin requests too).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvtop.model.analysis import PreemptionCheck
from kvtop.model.records import EngineKey

MAX_PINNED = 5000
# Finishes older than this behind the newest are no interval's: scrapes come seconds apart, and an
# engine without the histogram (SGLang, TGI, llama.cpp, the simulator) has no scrape to prune them,
# so a console or agent kept every finish of its life (10-13 MB an hour at 10 requests/s).
KEEP_S = 600.0


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
    _prev: dict[EngineKey, _Prev] = field(default_factory=dict)
    # observed finishes since the oldest scrape (and not over KEEP_S behind the newest)
    _finishes: deque[tuple[float, str, str | None]] = field(default_factory=deque)
    _addr: dict[EngineKey, str | None] = field(default_factory=dict)  # histogram key -> its engine's address
    _named: bool = False  # some finished stream named its engine

    def finish(self, t: float, rid: str, engine: str | None = None) -> None:
        fs = self._finishes
        fs.append((t, rid, engine))
        while fs[0][0] < t - KEEP_S:
            fs.popleft()
        if engine is not None:
            self._named = True

    def scrape(self, key: EngineKey, t: float, count: float | None, total: float | None,
               address: str | None = None) -> None:
        if count is None or total is None:
            return
        prev = self._prev.get(key)
        self._prev[key] = _Prev(t, count, total)
        self._addr[key] = address
        if prev is None or count < prev.count or total < prev.total:
            return  # first reading, or the engine restarted
        dc, ds = count - prev.count, total - prev.total
        self.finished += dc
        self.preemptions += ds
        # the finish event reaches kvtop a moment after the engine observed it: an interval's
        # finishes are those seen between the two scrapes
        if self._named and address is not None:
            inside = [rid for ft, rid, e in self._finishes if prev.t < ft <= t and e == address]
            alone = sum(1 for a in self._addr.values() if a == address) == 1  # one histogram (rank) there
        else:
            inside = [rid for ft, rid, _ in self._finishes if prev.t < ft <= t]
            alone = len(self._prev) == 1
        if dc == 1 and alone and len(inside) == 1 and len(self.pinned) < MAX_PINNED:
            self.pinned[inside[0]] = int(round(ds))
        oldest = min(p.t for p in self._prev.values())
        self._finishes = deque(f for f in self._finishes if f[0] > oldest)

    def report(self, spikes_of: dict[str, int]) -> PreemptionCheck | None:
        """The check as the report shows it; ``spikes_of`` = kvtop's preemption spikes per request id."""
        if not self._prev:
            return None
        agree = sum(1 for rid, n in self.pinned.items() if spikes_of.get(rid, 0) == n)
        more = sum(1 for rid, n in self.pinned.items() if spikes_of.get(rid, 0) > n)
        return PreemptionCheck(finished_requests=self.finished, engine_preemptions=self.preemptions,
                               pinned_requests=len(self.pinned), pinned_agree=agree, pinned_kvtop_more=more,
                               pinned_kvtop_fewer=len(self.pinned) - agree - more,
                               pinned_engine_preemptions=sum(self.pinned.values()),
                               pinned_kvtop_found=sum(min(n, spikes_of.get(rid, 0)) for rid, n in self.pinned.items()),
                               pinned_kvtop_extra=sum(max(0, spikes_of.get(rid, 0) - n) for rid, n in self.pinned.items()))
