"""Faster-than-real-time runs of the simulated engine (no HTTP): ``kvtop simulate``.

Engine records come from rendering the engine's /metrics page at each scrape interval and parsing
it with the registered vLLM adapter, so they are exactly what kvtop reads from a real vLLM. Request
records are what a client (or kvtop's proxy) would see; truth records say what really happened.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvtop.adapters.base import EngineAdapter
from kvtop.model.records import (
    SIM_ENGINE_VERSION,
    EngineRecord,
    Record,
    RequestRecord,
    TruthRecord,
    trace_time,
)
from kvtop.model.trace import TraceWriter, make_header
from kvtop.plugin import load_adapter
from kvtop.sim.engine import Engine
from kvtop.sim.metrics import MetricsPage
from kvtop.sim.seq import Seq
from kvtop.sim.stats import Sink, Stats
from kvtop.sim.workload import RequestSpec, Workload

SIM_URL = "sim://"
SIM_VERSION = SIM_ENGINE_VERSION  # what the simulated engine answers for its version (vLLM: /version)


class RecordSink(Sink):
    """Turns engine callbacks into kvtop records handed to ``emit`` (in time order)."""

    def __init__(self, emit: Callable[[Record], None], tokens: bool = True,
                 emit_dict: Callable[[float, list[Seq]], None] | None = None):
        self.emit = emit
        self.tokens = tokens
        # token records (most of a trace) can bypass typed records: emit_dict(t, seqs) writes them
        self.emit_dict = emit_dict

    def on_tokens(self, t: float, seqs: list[Seq]) -> None:
        if not self.tokens:
            return
        if self.emit_dict is not None:
            self.emit_dict(t, seqs)
            return
        emit = self.emit
        for s in seqs:
            emit(RequestRecord(t, s.id, "first_token" if s.generated == 1 else "token", n=1, source="sim"))

    def on_finish(self, t: float, seq: Seq, reason: str) -> None:
        if reason == "error":
            self.emit(RequestRecord(t, seq.id, "error", source="sim", error="too_long", status=400))
            return
        self.emit(RequestRecord(t, seq.id, "finish", source="sim", finish_reason=reason,
                                completion_tokens=seq.generated))

    def on_cancel(self, t: float, seq: Seq) -> None:
        self.emit(RequestRecord(t, seq.id, "cancel", source="sim", completion_tokens=seq.generated))

    def on_truth(self, rec: TruthRecord) -> None:
        self.emit(rec)


@dataclass
class SimResult:
    duration_s: float
    requests: int = 0
    steps: int = 0
    records: int = 0
    stats: Stats = field(default_factory=Stats)
    engine: Engine | None = None
    truth_counts: dict[str, int] = field(default_factory=dict)


def make_engine(workload: Workload, sink: Sink | None = None) -> Engine:
    eng = Engine(workload.engine, sink)
    res = {c.priority: c.reserved_kv_frac for c in workload.classes if c.reserved_kv_frac > 0}
    if res:
        eng.set_reservations(res)
    return eng


TICK_STEPS = 256  # engine steps between two calls of run's tick (Ctrl-C answers within a fraction of a second)


class Simulation:
    """Drives an ``Engine`` through a workload in simulated time.

    ``emit`` receives every record in time order; ``scrape_interval_s`` (None: no engine records)
    sets how often the /metrics page is rendered and parsed through the vLLM adapter.
    """

    def __init__(self, workload: Workload, seed: int, duration_s: float, emit: Callable[[Record], None] | None = None,
                 scrape_interval_s: float | None = 1.0, tokens: bool = True,
                 requests: Iterator[RequestSpec] | None = None,
                 emit_tokens: Callable[[float, list[Seq]], int] | None = None):
        self.workload = workload
        self.seed = seed
        self.duration_s = duration_s
        self._emit = emit or (lambda r: None)
        self.truth_counts: dict[str, int] = {}
        self._emit_tokens = emit_tokens
        self.sink = RecordSink(self._record, tokens=tokens, emit_dict=self._count_tokens if emit_tokens else None)
        self.engine = make_engine(workload, self.sink)
        self.scrape_interval_s = scrape_interval_s
        self._arrivals = requests if requests is not None else workload.requests(seed, duration_s)
        self._next: RequestSpec | None = next(self._arrivals, None)
        self._next_scrape = 0.0 if scrape_interval_s else float("inf")
        self.n_requests = 0
        self.n_records = 0
        self._adapter: EngineAdapter | None = None
        self._page: MetricsPage | None = None
        if scrape_interval_s:
            self._adapter = load_adapter("vllm")()
            self._page = MetricsPage(self.engine, created=1.7e9)

    def _record(self, rec: Record) -> None:
        if isinstance(rec, TruthRecord):
            self.truth_counts[rec.event] = self.truth_counts.get(rec.event, 0) + 1
        self.n_records += 1
        self._emit(rec)

    def _count_tokens(self, t: float, seqs: list[Seq]) -> None:
        self.n_records += self._emit_tokens(t, seqs)  # type: ignore[misc]

    def scrape(self, t: float) -> list[EngineRecord]:
        assert self._page is not None and self._adapter is not None
        recs: list[EngineRecord] = self._adapter.parse(self._page.render(), t)
        for r in recs:
            r.url = SIM_URL
            r.version = SIM_VERSION
        return recs

    def _advance_to(self, until: float, inclusive: bool) -> None:
        """Deliver arrivals, client give-ups and scrapes before ``until`` in time order."""
        eng = self.engine
        inf = float("inf")
        while True:
            ta = self._next.t if self._next is not None else inf
            ts = self._next_scrape
            td = eng.next_deadline()
            t_other = min(ta, ts)
            if td is not None and td < t_other and (td < until or (inclusive and td == until)):
                bound = min(t_other, until)
                eng.expire(bound, inclusive=inclusive and bound == until)
                continue
            t = t_other
            if t > until or (t == until and not inclusive) or t == inf:
                return
            if t == ts:
                for r in self.scrape(ts):
                    self._record(r)
                self._next_scrape = ts + self.scrape_interval_s  # type: ignore[operator]
                continue
            spec = self._next
            assert spec is not None
            self._next = next(self._arrivals, None)
            self.n_requests += 1
            self._record(RequestRecord(spec.t, spec.id, "arrive", prompt_tokens=spec.prompt_tokens, cls=spec.cls,
                                       source="sim"))
            eng.add(spec, spec.t)

    def run(self, tick: Callable[[float], bool] | None = None) -> SimResult:
        """Simulate to ``duration_s``. ``tick(t)``, when given, is called every few hundred engine
        steps with the simulated time (progress); returning True ends the run there, cleanly:
        everything up to ``t`` is emitted, as if ``duration_s`` had been ``t``."""
        eng = self.engine
        end = self.duration_s
        hook = self._hook
        n = 0
        while True:
            if eng.t >= end:
                break
            if tick is not None:
                n += 1
                if n % TICK_STEPS == 0 and tick(eng.t):
                    end = eng.t
                    break
            self._advance_to(eng.t, inclusive=True)
            if eng.step(hook):
                continue
            # idle: jump to the next thing that can happen
            nxt = [x for x in (self._next.t if self._next else None, eng.next_deadline(),
                               eng.next_internal_event(), self._next_scrape) if x is not None]
            t = min(nxt + [end])
            if t <= eng.t:
                t = min([x for x in nxt if x > eng.t] + [end])
            self._advance_to(t, inclusive=False)
            eng.t = max(eng.t, t)
        self._advance_to(end, inclusive=True)
        eng.flush_truth()
        return SimResult(end, self.n_requests, eng.stats.steps, self.n_records, eng.stats, eng, dict(self.truth_counts))

    def _hook(self, t_end: float) -> None:
        self._advance_to(t_end, inclusive=False)


def trace_header(workload: Workload, seed: int, policy: str | None, duration_s: float,
                 interval_s: float | None = None) -> dict[str, Any]:
    """``interval_s``: the scrape period of its engine records, as ``kvtop record`` notes its own."""
    e = workload.engine
    extra: dict[str, Any] = {} if interval_s is None else {"interval_s": interval_s}
    return make_header(
        engine={"adapter": "vllm", "url": SIM_URL, "model": e.model, "version": SIM_VERSION},
        kv={"bytes_per_token": e.bytes_per_token, "block_size": e.block_size, "capacity_tokens": e.capacity_tokens},
        sim={"workload": workload.name, "seed": seed, "policy": policy or e.preemption_mode,
             "preemption_mode": e.preemption_mode, "duration_s": duration_s, "itl_target_s": e.itl_target_s,
             "max_num_seqs": e.max_num_seqs, "max_num_batched_tokens": e.max_num_batched_tokens,
             "chunked_prefill": e.chunked_prefill},
        **extra,
    )


def _token_lines(t: float, seqs: list[Seq]) -> str:
    """The JSON lines ``to_dict(RequestRecord(t, id, event, n=1, source="sim"))`` would give, built
    directly: token records are most of a trace and json.dumps per record dominated the run time."""
    ts = repr(trace_time(float(t)))
    return "".join(
        f'{{"kind":"request","t":{ts},"id":{json.dumps(s.id)},"event":"'
        f'{"first_token" if s.generated == 1 else "token"}","n":1,"source":"sim"}}\n'
        for s in seqs)


def simulate_to_trace(workload: Workload, seed: int, duration_s: float, path: str, policy: str | None = None,
                      scrape_interval_s: float = 1.0, requests: list[RequestSpec] | None = None,
                      tick: Callable[[float], bool] | None = None) -> SimResult:
    with TraceWriter(path, trace_header(workload, seed, policy, duration_s, scrape_interval_s)) as w:
        f = w._f  # same file, same buffering: token lines are appended in time order with the rest

        def tokens(t: float, seqs: list[Seq]) -> int:
            f.write(_token_lines(t, seqs))
            w.count += len(seqs)
            w.flush_if_due()
            return len(seqs)

        sim = Simulation(workload, seed, duration_s, w.write, scrape_interval_s=scrape_interval_s, emit_tokens=tokens,
                         requests=iter(requests) if requests is not None else None)
        return sim.run(tick)
