"""Between the engine and the client: what a proxy in front of the API server would record.

An engine emission (engine time, tokens) reaches the proxy a fraction of a millisecond later,
unless something holds it:

* API-server merging: the server's output loop falls behind for some streams for 0.1-0.5 s and
  then sends everything it buffered as one chunk (``n`` > 1), or as many events within a
  millisecond (separate proxy reads);
* a slow reader: the client stops reading, backpressure stops the proxy's reads, and when the
  client resumes everything buffered arrives at once;
* an API-server stall: every stream's output is held (the engine keeps stepping) and /metrics,
  served by the same process, does not answer either;
* a host pause: the whole host stops; the engine model already moved its steps past the pause,
  so streams simply go silent (nothing is buffered), and kvtop's own scrapes pause too.

Every stall a hold causes gets an exact truth span in client time: from the chunk before it to
the chunk that ends it.
"""

from __future__ import annotations

import math
import random
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field
from typing import Any

from .situations import DeliverySpec
from .stepper import Req, Run

NON_ENGINE = ("slow_reader", "api_merge", "api_stall", "host_pause")


@dataclass
class Stream:
    """One observed request as the proxy records it."""

    req: Req
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (t, n); same-ms runs are split reads
    deliv: list[float] = field(default_factory=list)  # delivered time of each engine emission
    end: tuple[float, str] | None = None  # (t, finish | cancel)
    spans: list[tuple[float, float, str, dict[str, Any]]] = field(default_factory=list)  # truth (t_start, t_end, cause)


def windows(rng: random.Random, rate: float, lens: tuple[float, float], t0: float, t1: float) -> list[tuple[float, float]]:
    """Poisson-timed, non-overlapping windows (start, length) in [t0, t1], lengths log-uniform."""
    out: list[tuple[float, float]] = []
    if rate <= 0:
        return out
    t = t0
    lo, hi = math.log(lens[0]), math.log(lens[1])
    while True:
        t += rng.expovariate(rate)
        if t >= t1:
            return out
        d = math.exp(rng.uniform(lo, hi))
        if out and t < out[-1][0] + out[-1][1] + 0.5:
            continue
        out.append((round(t, 6), round(d, 6)))


def deliver(run: Run, spec: DeliverySpec, seed: int, name: str, duration_s: float,
            host_pauses: list[tuple[float, float]], api_stalls: list[tuple[float, float]]) -> list[Stream]:
    rng = random.Random(f"{seed}:delivery:{name}")
    merges = windows(rng, spec.merge_rate_per_s, spec.merge_len_s, 1.0, duration_s)
    out: list[Stream] = []
    for r in run.reqs:
        if not r.observed:
            continue
        holds: list[tuple[float, float, str]] = [(a, a + d, "api_stall") for a, d in api_stalls]
        first, last = (r.emits[0][0], r.emits[-1][0]) if r.emits else (r.arrive, r.arrive)
        for a, d in merges:
            if first < a < last and rng.random() < spec.merge_share:
                holds.append((a, a + d, "api_merge"))
        if spec.slow_reader_frac and rng.random() < spec.slow_reader_frac:
            for a, d in windows(rng, spec.slow_reader_rate_per_s, spec.slow_reader_len_s, first, last):
                holds.append((a, a + d, "slow_reader"))
        # the proxy is on the paused host too: nothing buffered elsewhere arrives during a pause
        holds.extend((a, a + d, "host_pause") for a, d in host_pauses)
        holds.sort()
        out.append(_one(r, holds, spec, rng, host_pauses))
    return out


def _one(r: Req, holds: list[tuple[float, float, str]], spec: DeliverySpec, rng: random.Random,
         host_pauses: list[tuple[float, float]]) -> Stream:
    st = Stream(r)
    held_by: list[int] = []  # per emission: index of the hold that delivered it (-1: none)
    flush = [e + rng.uniform(0.0002, 0.003) for _, e, _ in holds]
    prev = -1.0
    lat = rng.uniform(0.0002, 0.0008)
    for te, _ in r.emits:
        d, h = te + lat, -1
        moved = True
        while moved:
            moved = False
            for i, (a, e, _) in enumerate(holds):
                if a <= d < e:
                    d, h, moved = flush[i], i, True
        d = max(d, prev + 2e-6)
        st.deliv.append(round(d, 6))
        held_by.append(h)
        prev = d
    # chunks: emissions delivered at one instant are one read, or (split_frac) separate reads
    i = 0
    n_em = len(r.emits)
    while i < n_em:
        j = i
        while j + 1 < n_em and held_by[j + 1] == held_by[i] and held_by[i] >= 0 and st.deliv[j + 1] <= st.deliv[i] + 1e-5:
            j += 1
        if j > i and rng.random() < spec.split_frac:
            t0 = st.deliv[i]
            for k in range(i, j + 1):
                tk = round(t0 + 0.0002 * (k - i), 6)
                st.deliv[k] = tk
                st.chunks.append((tk, r.emits[k][1]))
        else:
            t0 = st.deliv[i]
            for k in range(i, j + 1):
                st.deliv[k] = t0
            st.chunks.append((t0, sum(r.emits[k][1] for k in range(i, j + 1))))
        i = j + 1
    last_t = st.chunks[-1][0] if st.chunks else r.arrive
    if r.end_kind == "finish":
        st.end = (round(last_t + 5e-5, 6), "finish")
    elif r.end_kind == "cancel" and r.end_t is not None:
        st.end = (round(max(r.end_t, last_t + 0.001), 6), "cancel")
    # truth for holds: from the chunk before the hold to the chunk that ended it
    times = [c[0] for c in st.chunks]
    for i, (a, _e, cause) in enumerate(holds):
        ks = [k for k, h in enumerate(held_by) if h == i]
        if not ks or cause == "host_pause":  # pauses silence every stream: spans below
            continue
        t_end = st.deliv[ks[0]]
        p = bisect_left(times, t_end) - 1
        if p < 0:
            continue  # held before the first token: time to first token, not a gap
        st.spans.append((times[p], t_end, cause, {"hold_s": round(_e - a, 6)}))
    for a, d in host_pauses:
        p = bisect_right(times, a) - 1
        if p < 0 or p + 1 >= len(times) or times[p + 1] < a + d:
            continue
        st.spans.append((times[p], times[p + 1], "host_pause", {"pause_s": d}))
    return st
