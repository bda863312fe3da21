"""What an analysis arrived at, as one typed value: the report (``report.py``, ``inputs.py``) reads
this and never the ``Analyzer``'s working attributes.

``Analyzer.state()`` produces it (after ``finish()`` for a trace; after ``tick(now)`` live). The
containers are the analyzer's own at that moment, handed over read-only: the per-stream records
and the running totals are not copied (the live console asks for a report every second).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtop.analysis.attribution.aggregate import Scrape
from kvtop.analysis.attribution.causes import Cause
from kvtop.analysis.attribution.spike import Spike
from kvtop.analysis.streams import ReqState
from kvtop.analysis.tally import Tally
from kvtop.model.analysis import EngineRequestTimes, PreemptionCheck, PrefillCompute, ResumeCosts


@dataclass(frozen=True)
class AnalysisState:
    header: dict[str, Any]  # the trace's header (engine adapter and model, KV geometry)
    preempts: bool  # the engine can preempt at all (its adapter says)
    records: int
    token_records: int  # 0: no per-request token timings (the aggregate fallback reads ``scrapes``)
    t0: float | None  # the first and the latest record time
    now: float
    # the gap distribution
    gaps: int
    median_gap: float | None
    itl_target_s: float | None
    target_source: str | None  # "given", "trace header" or how it was derived
    k: float  # target = k x the median of the first gaps, when derived
    # the judged spikes: every one counted per cause, the latest ones listed
    n_spikes: int
    cause_counts: dict[Cause, int]
    cause_conf: dict[Cause, float]  # summed confidences
    cause_over: dict[Cause, float]  # seconds above the target
    spikes: tuple[Spike, ...]
    streams: tuple[ReqState, ...]  # every stream still held, in arrival order
    tally: Tally  # the measured inputs' running totals
    scrapes: tuple[Scrape, ...]  # engine scrapes with an ITL histogram (kept only without token timings)
    request_preemptions: PreemptionCheck | None  # the engine's per-request preemptions vs kvtop's spikes
    engine_request_times: EngineRequestTimes | None  # the engine's own per-request times vs observation
    scrape_interval: float | None = None  # the engine scrapes' usual interval (None: no scrapes)
    witnessed_spikes: int = 0  # spikes whose cause was read from the engine's own step log
    held_spikes: int = 0  # of them, tokens the engine made on pace that reached the client in one chunk
    resume_costs: ResumeCosts | None = None  # restored vs recomputed positions, where a witness said
    prefill_compute: PrefillCompute | None = None  # prompt/recompute steps' cost, where a witness logged them
