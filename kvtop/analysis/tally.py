"""Running totals an ``Analyzer`` keeps for the cost-model inputs (``inputs.build_situation``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvtop.analysis.gaps import LogHistogram
from kvtop.analysis.stepcurve import StepCurve
from kvtop.model.records import EngineKey


@dataclass
class Tally:
    finished: int = 0
    cancelled: int = 0
    errors: int = 0
    prompt_hist: LogHistogram = field(default_factory=lambda: LogHistogram(lo=1.0, bins=800))
    prompt_sum: float = 0.0
    prompt_n: int = 0
    output_hist: LogHistogram = field(default_factory=lambda: LogHistogram(lo=1.0, bins=800))
    output_sum: float = 0.0
    output_n: int = 0
    ttft_rate_hist: LogHistogram = field(default_factory=lambda: LogHistogram(lo=1.0, bins=1000))
    preempted_requests: int = 0  # requests with at least one stall attributed to preemption
    preempted_cancelled: int = 0  # preempted requests whose client gave up before they resumed
    seq_pre_sum: float = 0.0  # prompt + generated tokens of preemption victims (the S of the cost model)
    seq_pre_n: int = 0
    # prompt + output of each finished request whose prompt is known (a length bound must admit them all)
    request_hist: LogHistogram = field(default_factory=lambda: LogHistogram(lo=1.0, bins=800))
    request_max: int = 0
    # preemption stalls (start, end), to find the peak of sequences preempted at once (a host pool's size)
    preempt_stalls: list[tuple[float, float]] = field(default_factory=list)
    prefill_a: list[float] = field(default_factory=list)  # stall seconds per prompt token of prefill stalls
    engine_first: dict[EngineKey, dict[str, Any]] = field(default_factory=dict)
    engine_last: dict[EngineKey, dict[str, Any]] = field(default_factory=dict)
    # requests between arrival and end right now, and the most at once (what an admission limit queues)
    inflight: int = 0
    inflight_peak: int = 0
    arrived: int = 0  # requests that arrived, and the first and last arrival (the offered load)
    first_arrival: float | None = None
    last_arrival: float | None = None
    # per engine: its decode step and generated tokens/s against its running batch, from its scrapes
    step_curves: dict[EngineKey, StepCurve] = field(default_factory=dict)
    running_sum: float = 0.0
    running_n: int = 0
    running_peak: float = 0.0  # the most sequences any one engine ran at a scrape
    # the scheduler limits the engine's witness stated, latest first start (``StepRecord.limits``)
    engine_limits: dict[str, int | bool] = field(default_factory=dict)
    kv_max: float | None = None
    host: dict[str, Any] | None = None  # the latest host record
    gpu_pcie_max: float = 0.0
    # per GPU index: (least free memory seen, total memory) from NVML: room a larger KV cache could take
    gpu_mem: dict[int, tuple[int, int]] = field(default_factory=dict)
