"""The engine's own per-request times beside what kvtop observed of the same request.

vLLM started with ``--enable-per-request-metrics`` puts a ``metrics`` object on each response
(streams: on the final usage chunk), which the recorders write onto the finish record as
``engine_queue_s`` (queued until first scheduled), ``engine_ttft_s`` (first scheduled until the first
token) and ``engine_decode_s`` (first until last token), all on the engine core's clock; llama.cpp's
``timings`` give the last two. The prompt tokens here are those the engine computed: the finish
record's ``cached_tokens`` (its prefix cache's share, where it says it) are not.

What that tells kvtop:

* the prefill rate without queueing: prompt tokens / ``engine_ttft_s`` is still a low estimate (the
  steps that prefilled the prompt also decoded the batch, and a preemption before the first token
  counts in it), but a much tighter one than prompt / observed TTFT, which includes the queue;
  the analysis uses it as soon as it has a few;
* how long requests queued in the engine (admission pressure, request by request);
* time outside the engine: the observed TTFT less queue and engine TTFT (API server, proxy,
  network), and the observed first-to-last-token span less the engine's (what delayed the last
  token on its way out; a stall in the middle of a stream changes neither span).

vLLM 0.32's object carries no preemption count (``num_preemptions`` stays in the engine's
internal stats); per-request counts come from ``vllm:request_num_preemptions`` (see
``request_preemptions``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvtop.analysis.asof import RunningMedian
from kvtop.analysis.attribution.thresholds import RATE_MIN_PROMPTS
from kvtop.analysis.gaps import LogHistogram
from kvtop.model.analysis import EngineRequestTimes

MAX_SAMPLES = 5000
QUEUED_S = 0.1  # a request that waited this long before it was first scheduled queued (not just a step)


def rate_sample() -> RunningMedian[LogHistogram]:
    """A prefill rate's sample: tokens/s from 1 up, its median from 5 samples on."""
    return RunningMedian(LogHistogram(lo=1.0, bins=1000), min_n=RATE_MIN_PROMPTS, step=4)


def _median(xs: list[float]) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[len(s) // 2]


def _r6(v: float | None) -> float | None:
    return None if v is None else round(v, 6)


def _q(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


@dataclass
class RequestTimes:
    """Engine-reported request times (finish records) and their comparison with observation (bounded)."""

    requests: int = 0
    queued: int = 0  # of them, queued at least QUEUED_S
    queue: list[float] = field(default_factory=list)
    outside_ttft: list[float] = field(default_factory=list)  # observed TTFT - queue - engine TTFT
    tail_gap: list[float] = field(default_factory=list)  # observed first..last token span - the engine's
    # prompt tokens / engine TTFT: its median as of each refresh, of all requests and by engine
    rate: RunningMedian[LogHistogram] = field(default_factory=lambda: rate_sample())
    by_engine: dict[str, RunningMedian[LogHistogram]] = field(default_factory=dict)

    def finish(self, d: dict[str, Any], prompt_tokens: int | None, arrive_t: float | None, first_t: float | None,
               last_t: float | None, engine: str | None) -> None:
        """A finish record ``d``; the rest is what kvtop observed of the same request."""
        q, ttft, dec = d.get("engine_queue_s"), d.get("engine_ttft_s"), d.get("engine_decode_s")
        if not any(isinstance(v, (int, float)) for v in (q, ttft, dec)):
            return
        self.requests += 1
        keep = len(self.queue) < MAX_SAMPLES
        if isinstance(q, (int, float)):
            self.queued += q >= QUEUED_S
            if keep:
                self.queue.append(float(q))
        if isinstance(ttft, (int, float)) and ttft > 0:
            if prompt_tokens:
                t = float(d["t"])
                self.rate.add(prompt_tokens / ttft, t)
                if engine is not None:
                    h = self.by_engine.get(engine)
                    if h is None:
                        h = self.by_engine[engine] = rate_sample()
                    h.add(prompt_tokens / ttft, t)
            if keep and arrive_t is not None and first_t is not None and isinstance(q, (int, float)):
                self.outside_ttft.append((first_t - arrive_t) - q - ttft)
        if keep and isinstance(dec, (int, float)) and first_t is not None and last_t is not None:
            self.tail_gap.append((last_t - first_t) - dec)

    def prefill_rate(self, engine: str | None = None, t: float = math.inf) -> float | None:
        """Median prompt tokens / engine TTFT (of ``engine``'s requests when given) as known at trace
        time ``t``; None under 5 samples."""
        h = self.rate if engine is None else self.by_engine.get(engine)
        return None if h is None else h.at(t)

    def report(self) -> EngineRequestTimes | None:
        if not self.requests:
            return None
        rate = self.prefill_rate()
        return EngineRequestTimes(
            requests=self.requests, queued_requests=self.queued,
            queue_s_median=_r6(_median(self.queue)), queue_s_p90=_r6(_q(self.queue, 0.9)),
            queue_s_max=_r6(max(self.queue)) if self.queue else None,
            engine_prefill_tokens_per_s=None if rate is None else round(rate, 1),
            outside_engine_ttft_s_median=_r6(_median(self.outside_ttft)),
            tail_delivery_s_median=_r6(_median(self.tail_gap)),
            tail_delivery_s_max=_r6(max(self.tail_gap)) if self.tail_gap else None)
