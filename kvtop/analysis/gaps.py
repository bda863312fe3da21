"""Inter-token gaps: per-request state, the gap distribution, and spike candidates.

A gap is the time between two consecutive token events of one request (the first gap starts at
the first token: time to first token is not an inter-token gap). A gap that ends in a cancel (the
client gave up while the stream was silent) is a gap too: a victim cancelled while preempted never
produces another token, and the engine may never count its preemption.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

# Default ITL target = K_TARGET × the median of the first WARMUP gaps (documented in the README).
K_TARGET = 4.0
WARMUP_GAPS = 2000
# Gaps at least this fraction of the target are kept (for a while) to find streams that stalled together.
LONG_FRACTION = 0.5
RECENT = 8  # gaps per stream kept to judge whether a spike is an outlier for that stream


class LogHistogram:
    """Fixed-memory histogram of positive values on a log scale (1 µs .. ~3 h, 2 % bins)."""

    __slots__ = ("counts", "n", "_lo", "_scale")

    def __init__(self, lo: float = 1e-6, bins: int = 1200, ratio: float = 1.02):
        self.counts = [0] * bins
        self.n = 0
        self._lo = lo
        self._scale = 1.0 / math.log(ratio)

    def index(self, v: float) -> int:
        if v <= self._lo:
            return 0
        return min(len(self.counts) - 1, int(math.log(v / self._lo) * self._scale))

    def add(self, v: float, k: int = 1) -> None:
        self.counts[self.index(v)] += k
        self.n += k

    def value_at(self, i: int) -> float:
        return self._lo * math.exp((i + 0.5) / self._scale)

    def quantile(self, q: float) -> float | None:
        if self.n == 0:
            return None
        target = q * self.n
        acc = 0
        for i, c in enumerate(self.counts):
            acc += c
            if acc >= target and c:
                return self.value_at(i)
        return None


@dataclass(slots=True)
class ReqState:
    id: str
    arrive_t: float | None = None
    prompt_tokens: int | None = None
    cls: str | None = None
    first_t: float | None = None
    last_t: float | None = None
    tokens: int = 0
    end_t: float | None = None
    ended_by: str | None = None
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT))
    max_gap: float = 0.0
    spikes: int = 0
    preempt_spikes: int = 0
    last_cause: str | None = None
    engine_preempts: list = field(default_factory=list)  # t of request-level preempt events (engine/sim)
    cancelled_after_preempt: bool = False

    def baseline_gap(self) -> float | None:
        if not self.recent:
            return None
        s = sorted(self.recent)
        return s[len(s) // 2]


@dataclass(slots=True)
class Gap:
    """A long gap (candidate spike) waiting for attribution."""

    request_id: str
    t_start: float
    t_end: float
    gap: float
    stream_baseline: float | None  # median of the stream's previous gaps
    tokens_before: int
    ended_by: str = "token"
    cause: str | None = None
    confidence: float = 0.0
    evidence: list[str] = field(default_factory=list)
