"""Deterministic synthetic load for the console's tests and bench (the screenshots come from a
simulated run with the real analysis: scripts/make_screenshots.py).

A seeded generator that drives a real ``Core`` with hand-made records: GPUs with PCIe traffic (one
link down-trained), host memory, vLLM-shaped engine records (KV usage, counters, ITL/TTFT
histograms) and per-request token streams with injected stalls. Stalls are known when they are
made, so ``SampleAnalysis`` reports them with their true cause in the report the analysis package
builds (spikes, causes); it gives no verdict unless a test hands one in. No Textual import: the
bench uses this headless.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvtop.core import Core
from kvtop.model.analysis import AnalysisCounters, AnalysisReport, CauseRow, SpikeView, Verdict
from kvtop.model.records import EngineRecord, GpuRecord, Histogram, HostRecord, Record, RequestRecord

GIB = 1 << 30
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, float("inf"))
_TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, float("inf"))


class SampleAnalysis:
    """The LiveAnalysis protocol over stalls whose causes the generator knows. ``verdict`` is in the
    JSON shape ``kvtop analyze`` prints (a test's fixed verdict), read with ``Verdict.from_dict``."""

    def __init__(self, verdict: dict[str, Any] | None):
        self.spikes: list[SpikeView] = []
        self._by_req: dict[str, list[SpikeView]] = {}
        self.verdict = verdict

    streams = None  # keeps no per-stream store: the core keeps its own and asks ``request_info``

    def fresh(self) -> SampleAnalysis:
        return SampleAnalysis(self.verdict)

    def feed(self, rec: Record) -> None:  # the spikes are registered by the generator
        return None

    def add(self, spike: SpikeView) -> None:
        self.spikes.append(spike)
        self._by_req.setdefault(spike.request_id, []).append(spike)

    def request_info(self, request_id: str) -> tuple[int, int, str | None]:
        mine = self._by_req.get(request_id, ())
        pre = sum(1 for s in mine if s.cause == "preemption")
        return len(mine), pre, (mine[-1].cause if mine else None)

    def counters(self) -> AnalysisCounters:
        counts: dict[str, int] = {}
        secs: dict[str, float] = {}
        for s in self.spikes:
            counts[s.cause] = counts.get(s.cause, 0) + 1
            secs[s.cause] = secs.get(s.cause, 0.0) + s.gap_s
        return AnalysisCounters(counts, secs, len({s.request_id for s in self.spikes if s.cause == "preemption"}))

    def lag(self, now: float) -> float:  # the generator registers each spike already judged
        return 0.0

    def report(self, now: float) -> AnalysisReport:
        counts: dict[str, int] = {}
        for s in self.spikes:
            counts[s.cause] = counts.get(s.cause, 0) + 1
        total = len(self.spikes) or 1
        causes = {c: CauseRow(n, round(n / total, 3)) for c, n in counts.items()}
        verdict = Verdict.from_dict(self.verdict) if self.verdict is not None else None
        return AnalysisReport(spikes=tuple(self.spikes), spikes_total=len(self.spikes), causes=causes,
                              verdict=verdict)


@dataclass
class _Req:
    id: str
    arrive: float
    itl: float
    cls: str
    out_len: int
    next_t: float = 0.0
    tokens: int = 0
    done: bool = False
    stall_until: float = -1.0
    first: bool = True


@dataclass
class Sample:
    """Drives ``core`` one tick at a time. ``fine`` emits every token (detail timelines); otherwise
    one chunk record per request per tick (1,000-request loads)."""

    gpus: int = 2
    engines: int = 1
    requests: int = 12
    seed: int = 7
    fine: bool = True
    itl_target_s: float = 0.1
    # no verdict unless a test hands one in: a verdict is the analysis' to give, never made up
    verdict: dict[str, Any] | None = None
    sink: Callable[[Record], None] | None = None  # sees every record (e.g. a TraceWriter.write)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.analysis = SampleAnalysis(self.verdict)
        self.core = Core(window_s=60.0, itl_target_s=self.itl_target_s, analysis=self.analysis,
                         max_requests=max(5000, self.requests * 2), finished_keep_s=30.0,
                         source_label="sample")
        self.t = 0.0
        self._n = 0
        self._reqs: list[_Req] = []
        self._eng: list[dict[str, Any]] = [
            {"pre": 0.0, "prompt": 0.0, "gen": 0.0, "itl": [0.0] * len(_ITL_BUCKETS),
             "ttft": [0.0] * len(_TTFT_BUCKETS), "itl_sum": 0.0, "ttft_sum": 0.0, "kv": 0.6}
            for _ in range(self.engines)
        ]
        for _ in range(self.requests):
            self._new_request(0.0)

    def _ingest(self, rec: Record) -> None:
        self.core.ingest(rec)
        if self.sink is not None:
            self.sink(rec)

    # -- generation ---------------------------------------------------------------------------
    def _new_request(self, t: float) -> None:
        self._n += 1
        r = _Req(id=f"req-{self._n:04d}", arrive=t + self.rng.uniform(0, 0.9), itl=self.rng.uniform(0.025, 0.05),
                 cls="interactive" if self._n % 3 else "batch", out_len=self.rng.randint(200, 2500))
        r.next_t = r.arrive + self.rng.uniform(0.15, 0.6)  # TTFT
        self._reqs.append(r)
        self._ingest(RequestRecord(t=r.arrive, id=r.id, event="arrive", prompt_tokens=self.rng.randint(100, 8000),
                                       cls=r.cls, source="proxy"))

    def advance(self, dt: float = 1.0) -> None:
        t0, t1 = self.t, self.t + dt
        rng = self.rng
        # every 7th tick one running request is preempted for ~1.6 s; every 11th tick a prefill
        # burst stalls all running streams for ~0.3 s
        tick = round(t1 / dt)
        running = [r for r in self._reqs if not r.done and r.arrive < t0]
        preempted: _Req | None = None
        burst_at = None
        if tick % 7 == 3 and running:
            preempted = running[rng.randrange(len(running))]
            preempted.stall_until = t0 + 0.2 + 1.6
        if tick % 11 == 5:
            burst_at = t0 + 0.5
        out: list[Record] = []
        for r in self._reqs:
            if r.done:
                continue
            ts: list[float] = []
            while r.next_t <= t1 and r.tokens < r.out_len:
                ts.append(r.next_t)
                r.tokens += 1
                nxt = r.next_t + r.itl * rng.uniform(0.8, 1.25)
                if r is preempted and r.next_t < t0 + 0.2 <= nxt:
                    nxt = r.stall_until
                    self._spike(r.id, r.next_t, nxt, "preemption", 0.86)
                    self._eng[_eidx(r.id, self.engines)]["pre_pending"] = nxt
                elif burst_at is not None and r.next_t < burst_at <= nxt:
                    nxt = burst_at + 0.3
                    self._spike(r.id, r.next_t, nxt, "prefill_interference", 0.64)
                r.next_t = nxt
            if ts:
                if self.fine:
                    for k, tt in enumerate(ts):
                        ev = "first_token" if r.first and k == 0 else "token"
                        out.append(RequestRecord(t=tt, id=r.id, event=ev, source="proxy"))
                else:
                    out.append(RequestRecord(t=ts[-1], id=r.id, event="first_token" if r.first else "token",
                                             n=len(ts), source="proxy"))
                if r.first:
                    e = self._eng[_eidx(r.id, self.engines)]
                    self._observe(e, "ttft", _TTFT_BUCKETS, ts[0] - r.arrive)
                r.first = False
                e = self._eng[_eidx(r.id, self.engines)]
                e["gen"] += len(ts)
                for a, b in zip(ts, ts[1:], strict=False):
                    self._observe(e, "itl", _ITL_BUCKETS, b - a)
            if r.tokens >= r.out_len:
                r.done = True
                out.append(RequestRecord(t=r.next_t if r.next_t <= t1 else t1, id=r.id, event="finish",
                                         completion_tokens=r.tokens, source="proxy"))
        out.sort(key=lambda x: x.t)
        for rec in out:
            self._ingest(rec)
        # replace finished requests so the live count stays level
        for _ in range(sum(1 for r in self._reqs if r.done)):
            self._new_request(t1)
        self._reqs = [r for r in self._reqs if not r.done]
        self.t = t1
        self._tick_sources(t1, burst_at is not None)

    def _spike(self, rid: str, a: float, b: float, cause: str, conf: float) -> None:
        self.analysis.add(SpikeView(rid, round(a, 4), round(b, 4), round(b - a, 4), cause, confidence=conf))

    @staticmethod
    def _observe(e: dict[str, Any], key: str, buckets: tuple[float, ...], v: float) -> None:
        for i, le in enumerate(buckets):
            if v <= le:
                e[key][i] += 1
        e[key + "_sum"] += v

    def _tick_sources(self, t: float, burst: bool) -> None:
        rng = self.rng
        for i in range(self.gpus):
            load = 0.5 + 0.5 * rng.random()
            down = i == 1  # one link trained down to Gen3 under load
            self._ingest(GpuRecord(
                t=t, index=i, uuid=f"GPU-{i:08x}-sample", name="NVIDIA H100 80GB HBM3",
                mem_used_bytes=int((62 + 10 * load) * GIB), mem_total_bytes=80 * GIB,
                mem_reserved_bytes=int(0.5 * GIB),
                pcie_tx_bytes_per_s=load * (6e9 if down else 18e9), pcie_rx_bytes_per_s=load * 3e9,
                pcie_source="field_counters", pcie_link_gen=3 if down else 5, pcie_link_width=16,
                pcie_link_gen_max=5, pcie_link_width_max=16, util_pct=60 + 35 * load, mig_mode=False,
            ))
        self._ingest(HostRecord(
            t=t, mem_total_bytes=512 * GIB, mem_available_bytes=310 * GIB, swap_total_bytes=8 * GIB,
            swap_used_bytes=0, pinned_bytes=24 * GIB, pinned_signal="pinned (all GUP)",
            pinned_signals={"pinned (all GUP)": 24 * GIB, "shmem (incl. CUDA pinned)": 26 * GIB},
            shmem_bytes=26 * GIB,
        ))
        running = [r for r in self._reqs if not r.first]
        waiting = [r for r in self._reqs if r.first]
        for k, e in enumerate(self._eng):
            pend = e.pop("pre_pending", None)
            if pend is not None:
                # vLLM V1 counts a preemption when the request resumes; close enough at 1 s scrapes
                e["pre"] += 1
            e["kv"] = min(0.985, max(0.5, e["kv"] + rng.uniform(-0.02, 0.035)))
            e["prompt"] += rng.randint(2000, 4000) + (60000 if burst else 0)
            self._ingest(EngineRecord(
                t=t, adapter="vllm", url=f"http://127.0.0.1:{8000 + k}", engine="0",
                model="meta-llama/Llama-3.1-8B-Instruct", kv_usage=round(e["kv"], 4),
                running=float(len(running) // self.engines), waiting=float(len(waiting) // self.engines),
                preemptions_total=e["pre"], prompt_tokens_total=e["prompt"], generation_tokens_total=e["gen"],
                kv_capacity_tokens=452_000, block_size=16,
                itl=Histogram(list(zip(_ITL_BUCKETS, e["itl"], strict=False)), e["itl"][-1], e["itl_sum"]),
                ttft=Histogram(list(zip(_TTFT_BUCKETS, e["ttft"], strict=False)), e["ttft"][-1], e["ttft_sum"]),
            ))

    def run(self, seconds: int, dt: float = 1.0) -> Sample:
        for _ in range(seconds):
            self.advance(dt)
        return self


def sample(gpus: int = 2, engines: int = 1, requests: int = 12, seconds: int = 40, seed: int = 7,
           fine: bool = True, verdict: dict[str, Any] | None = None) -> Sample:
    return Sample(gpus=gpus, engines=engines, requests=requests, seed=seed, fine=fine, verdict=verdict).run(seconds)


FIXED_TAKEN_AT = "2026-01-01T00:00:00Z"


def _eidx(rid: str, engines: int) -> int:
    # str hash() is salted per process; the id's number keeps runs reproducible
    return int(rid.rsplit("-", 1)[1]) % engines
