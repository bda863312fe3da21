"""What the simulated engine reports: its counters and histograms, and the ``Sink`` for events.

Counters follow vLLM V1's semantics so that ``kvtop.sim.metrics`` can render them as a real
engine's /metrics page; the bucket bounds are vLLM V1's (docs/engines.md §2.1; the capture
tests/fixtures/engines/vllm-0.32.0-cpu-live-idle.prom).
"""

from __future__ import annotations

from bisect import bisect_left
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtop.model.records import TruthRecord
    from kvtop.sim.seq import Seq

ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITER_BUCKETS = (1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)


class Hist:
    """Prometheus-style histogram kept as plain per-bucket counts (cumulated when rendered)."""

    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float, n: int = 1) -> None:
        self.counts[bisect_left(self.bounds, v)] += n
        self.sum += v * n
        self.count += n

    def cumulative(self) -> list[tuple[float, int]]:
        out, c = [], 0
        for le, k in zip((*self.bounds, float("inf")), self.counts, strict=True):
            c += k
            out.append((le, c))
        return out


class Stats:
    """Engine-side counters in vLLM V1 semantics (rendered by ``kvtop.sim.metrics``)."""

    def __init__(self) -> None:
        self.preemptions = 0  # counted when the victim produces its next output (vLLM V1)
        self.preempt_events = 0  # counted at preemption time (truth; not exported)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.finished: dict[str, int] = {"stop": 0, "length": 0, "abort": 0, "error": 0, "repetition": 0}
        self.itl = Hist(ITL_BUCKETS)
        self.ttft = Hist(TTFT_BUCKETS)
        self.iteration_tokens = Hist(ITER_BUCKETS)
        self.e2e = Hist(E2E_BUCKETS)
        self.offload_bytes = {"GPU_to_CPU": 0.0, "CPU_to_GPU": 0.0}
        self.offload_time = {"GPU_to_CPU": 0.0, "CPU_to_GPU": 0.0}
        self.steps = 0


class Sink:
    """Receives what the engine does. Override what you need."""

    def on_tokens(self, t: float, seqs: list[Seq]) -> None:
        """Each seq produced one token at ``t`` (``seq.generated == 1``: the first token)."""

    def on_finish(self, t: float, seq: Seq, reason: str) -> None:
        pass

    def on_cancel(self, t: float, seq: Seq) -> None:
        pass

    def on_truth(self, rec: TruthRecord) -> None:
        pass
