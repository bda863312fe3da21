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
* how the prefill time grows with the prompt (``fit_prefill``), where prompts of several lengths
  were seen: the price of a token at a prompt's start and how much dearer each position makes the
  tokens after it. The advisor prices chunked-prefill steps with it: a chunk's attention over the
  positions before it is what makes a long prompt's last chunks the slow ones, and on small models
  (or on CPUs) it is many times what the parameter count suggests;
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
from kvtop.model.analysis import EngineRequestTimes, PrefillFit

MAX_SAMPLES = 5000
QUEUED_S = 0.1  # a request that waited this long before it was first scheduled queued (not just a step)
# The fit needs prompts whose computed lengths span this factor, in this many length bins (each
# FIT_BIN wide); a bin stands for its lower-quartile time (the least contended of its prompts)
FIT_SPREAD, FIT_BINS, FIT_BIN = 2.0, 3, 1.25
FIT_MAX_RESIDUAL = 0.25  # median relative miss of the bins beyond which the fit is not believed


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


def _g6(v: float) -> float:
    return float(f"{v:.6g}")


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting (the fit's 1-3 unknowns)."""
    n = len(v)
    a = [row[:] + [v[i]] for i, row in enumerate(m)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(a[r][c]))
        if abs(a[p][c]) < 1e-12:
            return None
        a[c], a[p] = a[p], a[c]
        for r in range(c + 1, n):
            f = a[r][c] / a[c][c]
            for k in range(c, n + 1):
                a[r][k] -= f * a[c][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (a[r][n] - sum(a[r][k] * x[k] for k in range(r + 1, n))) / a[r][r]
    return x


def _wls(rows: list[tuple[list[float], float]]) -> list[float] | None:
    """Least squares of relative misses: each row's columns and time, weighted 1 / time²."""
    n = len(rows[0][0])
    m = [[sum(x[i] * x[j] / (y * y) for x, y in rows) for j in range(n)] for i in range(n)]
    return _solve(m, [sum(x[i] / y for x, y in rows) for i in range(n)])


def fit_prefill(samples: list[tuple[int, int, float]]) -> PrefillFit | None:
    """``fixed + a·computed + a·k·(n² - cached²)`` fitted to (computed, cached, engine TTFT) samples
    (``n`` = computed + cached: a cached prefix's positions still make the computed ones dearer).

    None where the prompts' lengths do not span ``FIT_SPREAD`` in ``FIT_BINS`` bins, or no positive
    per-token price fits, or the fit misses its bins by more than ``FIT_MAX_RESIDUAL``; a curve is
    tried only on more bins than it has terms. Where the attention term was dropped (negative, or
    too few bins for it) ``k_att`` is None: not measured, rather than measured as nothing. A negative
    fixed part or attention term is dropped (set to 0) and the rest refitted: noise, not a saving.
    """
    bins: dict[int, list[tuple[float, float, float]]] = {}
    for computed, cached, ttft in samples:
        if computed > 0 and ttft > 0:
            n = computed + cached
            bins.setdefault(int(math.log(computed) / math.log(FIT_BIN)), []).append(
                (float(computed), float(n * n - cached * cached), ttft))
    if len(bins) < FIT_BINS:
        return None
    reps = []
    for group in bins.values():
        group.sort(key=lambda s: s[2])
        reps.append(group[(len(group) - 1) // 4])
    lo, hi = min(r[0] for r in reps), max(r[0] for r in reps)
    if hi < FIT_SPREAD * lo:
        return None
    s1, s2 = hi, max(r[1] for r in reps) or 1.0  # columns scaled to 1 for the solve
    for use_fixed, use_att in ((True, True), (False, True), (True, False), (False, False)):
        if len(reps) <= 1 + use_fixed + use_att:
            continue  # as many terms as points: any such curve passes through them, and proves nothing
        cols = [(1.0,) * use_fixed + (x1 / s1,) + (x2 / s2,) * use_att for x1, x2, _ in reps]
        coef = _wls([(list(c), y) for c, (_, _, y) in zip(cols, reps, strict=True)])
        if coef is None or min(coef) < 0:
            continue
        fixed = coef[0] if use_fixed else 0.0
        a = coef[int(use_fixed)] / s1
        b = coef[int(use_fixed) + 1] / s2 if use_att else 0.0
        if a <= 0:
            continue
        misses = sorted(abs(fixed + a * x1 + b * x2 - y) / y for x1, x2, y in reps)
        if misses[len(misses) // 2] > FIT_MAX_RESIDUAL:
            return None
        return PrefillFit(prompts=sum(len(g) for g in bins.values()), shortest_tokens=int(lo), longest_tokens=int(hi),
                          s_per_token=_g6(a), k_att=_g6(b / a) if use_att else None, fixed_s=_g6(fixed))
    return None


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
    prefill: list[tuple[int, int, float]] = field(default_factory=list)  # (computed, cached, engine TTFT)

    def finish(self, d: dict[str, Any], prompt_tokens: int | None, arrive_t: float | None, first_t: float | None,
               last_t: float | None, engine: str | None, cached: int = 0) -> None:
        """A finish record ``d`` whose engine computed ``prompt_tokens`` of its prompt (``cached`` more
        came from its prefix cache); the rest is what kvtop observed of the same request."""
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
                if len(self.prefill) < MAX_SAMPLES:
                    self.prefill.append((prompt_tokens, cached, float(ttft)))
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
            tail_delivery_s_max=_r6(max(self.tail_gap)) if self.tail_gap else None,
            prefill_fit=fit_prefill(self.prefill))
