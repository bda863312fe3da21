"""Typed observation records (docs/design.md §3): what every source emits and every trace holds.

A record is a timestamped fact. ``t`` is seconds on a monotonic clock from the start of the run.
Fields a source cannot fill stay ``None`` and are written as JSON ``null`` ("n/a" in views).
Readers ignore unknown fields and unknown kinds so the trace format can grow.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

TRACE_FORMAT = "kvtop-trace"
TRACE_VERSION = 1
# what kvtop's simulated engine answers for its version (vLLM: /version): the advisor knows its own world
SIM_ENGINE_VERSION = "kvtop-sim"


def trace_time(t: float) -> float:
    """A record time as traces hold it: to the microsecond (finer clock digits are noise, and six
    decimals keep lines short and exactly parseable by the analyzer's fast path)."""
    return round(t, 6)

REQUEST_EVENTS = frozenset(
    {"arrive", "first_token", "token", "resync", "finish", "cancel", "error", "preempt", "resume"}
)


@dataclass(slots=True)
class Histogram:
    """A cumulative Prometheus histogram: ``buckets`` are (upper bound, cumulative count)."""

    buckets: list[tuple[float, float]]
    count: float
    sum: float

    def to_dict(self) -> dict[str, Any]:
        # JSON has no Infinity: the +Inf bound is written as the string "+Inf" (float() reads it back).
        return {"buckets": [[le if le != float("inf") else "+Inf", c] for le, c in self.buckets],
                "count": self.count, "sum": self.sum}

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> Histogram | None:
        if d is None:
            return None
        return cls([(float(le), float(c)) for le, c in d["buckets"]], float(d["count"]), float(d["sum"]))


@dataclass(slots=True)
class GpuRecord:
    kind: ClassVar[str] = "gpu"
    t: float
    index: int
    uuid: str | None = None
    name: str | None = None
    lost: bool = False
    mem_used_bytes: int | None = None
    mem_total_bytes: int | None = None
    mem_reserved_bytes: int | None = None
    pcie_tx_bytes_per_s: float | None = None
    pcie_rx_bytes_per_s: float | None = None
    # "field_counters" (cumulative NVML counters, true interval average) or "throughput_20ms".
    pcie_source: str | None = None
    # NVML's cumulative PCIe byte counters as read (field_counters mode only): what the agent exports
    # as kvtop_gpu_pcie_{tx,rx}_bytes_total, exact at any scrape interval.
    pcie_tx_bytes_total: int | None = None
    pcie_rx_bytes_total: int | None = None
    pcie_link_gen: int | None = None
    pcie_link_width: int | None = None
    pcie_link_gen_max: int | None = None
    pcie_link_width_max: int | None = None
    pcie_replay_count: int | None = None
    util_pct: float | None = None
    mig_mode: bool | None = None
    # Memory held by processes we believe belong to the engine (None: unknown / not permitted).
    engine_proc_mem_bytes: int | None = None
    notes: list[str] = field(default_factory=list)


@dataclass(slots=True)
class HostRecord:
    kind: ClassVar[str] = "host"
    t: float
    mem_total_bytes: int | None = None
    mem_available_bytes: int | None = None
    swap_total_bytes: int | None = None
    swap_used_bytes: int | None = None
    # Best pinned-memory signal and which one it is (none of them is exact; docs/host-and-gpu.md §5).
    pinned_bytes: int | None = None
    pinned_signal: str | None = None
    # Every signal read, by name, so views can show them side by side.
    pinned_signals: dict[str, int | None] = field(default_factory=dict)
    shmem_bytes: int | None = None
    cgroup_shmem_bytes: int | None = None
    cgroup_mem_max_bytes: int | None = None
    notes: list[str] = field(default_factory=list)


# One engine instance as its records name it: (the URL kvtop scraped, the engine's own instance label).
EngineKey = tuple[str | None, str | None]


@dataclass(slots=True)
class EngineRecord:
    """One engine (one DP rank / ``engine`` label) as read from one scrape, normalised."""

    kind: ClassVar[str] = "engine"
    t: float
    adapter: str
    url: str | None = None
    engine: str | None = None  # the engine's own instance label (vLLM ``engine``, SGLang dp_rank ...)
    model: str | None = None
    up: bool = True
    kv_usage: float | None = None  # 0..1
    running: float | None = None
    waiting: float | None = None
    preemptions_total: float | None = None
    prompt_tokens_total: float | None = None
    generation_tokens_total: float | None = None
    prefix_hits_total: float | None = None
    prefix_queries_total: float | None = None
    requests_finished_total: float | None = None
    requests_aborted_total: float | None = None
    kv_capacity_tokens: int | None = None
    block_size: int | None = None
    offload_capacity_bytes: int | None = None
    offload_out_bytes_total: float | None = None  # GPU -> host
    offload_in_bytes_total: float | None = None  # host -> GPU
    offload_out_seconds_total: float | None = None
    offload_in_seconds_total: float | None = None
    itl: Histogram | None = None  # seconds
    ttft: Histogram | None = None  # seconds
    # Changes when the engine process restarts (vLLM ``*_created``, llama.cpp start header, ...).
    restart_token: float | None = None
    version: str | None = None
    warnings: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    # the limits the engine runs under where its interfaces say them, by the names a witness step
    # uses (``max_num_seqs``: llama.cpp's slot count from /slots; ``max_model_len``: the model cards
    # of vLLM's and SGLang's /v1/models, TGI's /info)
    limits: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class RequestRecord:
    kind: ClassVar[str] = "request"
    t: float
    id: str
    event: str
    n: int | None = None  # tokens in this chunk (token / first_token / resync)
    prompt_tokens: int | None = None
    cls: str | None = None  # "class" on the wire
    source: str | None = None  # proxy, probe, engine, sim
    finish_reason: str | None = None
    status: int | None = None  # HTTP status for error
    error: str | None = None  # error type (never a message containing user text)
    completion_tokens: int | None = None
    # On finish / cancel / error from passive capture: bytes of this stream were lost (its token
    # count may be short; its "resync" records mark where).
    incomplete: bool | None = None
    # The engine that served the request, as the source reached it (the proxy's upstream URL, the
    # probe's URL, the captured connection's host:port); written on its "arrive" record. The
    # analysis matches it with engine records' ``url`` (``kvtop.model.engine_id``) so stalls on one
    # engine are judged with that engine's scrapes and streams only.
    engine: str | None = None
    # On finish, where the engine reports per-request times (vLLM ``--enable-per-request-metrics``,
    # llama.cpp's ``timings``), seconds on the engine's own clock: queued until first scheduled,
    # first scheduled until the first token (prefill, chunked steps, any preemption before it), first
    # until last token.
    engine_queue_s: float | None = None
    engine_ttft_s: float | None = None
    engine_decode_s: float | None = None
    # On finish, where the engine says it: prompt tokens it served from its prefix cache instead of
    # computing them (``usage.prompt_tokens_details.cached_tokens``; llama.cpp ``timings.cache_n``)
    cached_tokens: int | None = None


@dataclass(slots=True)
class TruthRecord:
    """Ground truth from simulated runs only. The analysis never reads these."""

    kind: ClassVar[str] = "truth"
    t: float
    event: str  # e.g. preempt, resume, prefill_stall, slow_step
    request_id: str | None = None
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class StepRecord:
    """One engine step as the engine itself logged it (the witness, ``kvtop.witness``): exact, where
    everything else in a trace is observed from outside."""

    kind: ClassVar[str] = "step"
    t: float  # the step's start
    end: float
    engine: str | None = None  # the engine (its URL as kvtop reaches it) whose witness wrote it
    # per request: [request id, tokens scheduled, of them prompt (prefill), of them recomputed after
    # a preemption, tokens produced]; ids are the trace's request ids where the request carried one
    reqs: list[list[Any]] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)  # preempted while this step was planned
    resumed: list[str] = field(default_factory=list)  # scheduled again after a preemption
    finished: list[list[str]] = field(default_factory=list)  # [id, finish reason]
    aborted: list[str] = field(default_factory=list)  # aborted (the client went away) since the last step
    # per resumed request: [id, positions the engine had again without computing them (its prefix
    # cache's blocks, or a KV connector's load)]; absent where the witness did not say
    restored: list[list[Any]] = field(default_factory=list)
    # on the first step read after each witness header (the engine started, or its file rolled over):
    # the limits its scheduler runs under, vLLM's defaults applied (max_num_seqs,
    # max_num_batched_tokens, max_model_len) and whether it chunks prefills (chunked_prefill)
    limits: dict[str, int | bool] = field(default_factory=dict)


Record = GpuRecord | HostRecord | EngineRecord | RequestRecord | TruthRecord | StepRecord

_BY_KIND: dict[str, type] = {
    c.kind: c for c in (GpuRecord, HostRecord, EngineRecord, RequestRecord, TruthRecord, StepRecord)
}
_FIELDS: dict[type, frozenset[str]] = {c: frozenset(f.name for f in dataclasses.fields(c)) for c in _BY_KIND.values()}


def to_dict(rec: Record) -> dict[str, Any]:
    """JSON-ready dict. Request records drop empty optional fields to keep traces small."""
    out: dict[str, Any] = {"kind": rec.kind}
    for f in dataclasses.fields(rec):
        v = getattr(rec, f.name)
        if isinstance(v, Histogram):
            v = v.to_dict()
        if isinstance(rec, RequestRecord):
            if v is None:
                continue
            if f.name == "cls":
                out["class"] = v
                continue
        if f.name in ("warnings", "notes", "extra", "pinned_signals", "preempted", "resumed", "finished",
                      "aborted", "restored", "limits") and not v:
            continue
        out[f.name] = v
    return out


def from_dict(d: dict[str, Any]) -> Record | None:
    """Typed record from a trace line; ``None`` for kinds this version does not know."""
    cls = _BY_KIND.get(d.get("kind", ""))
    if cls is None:
        return None
    names = _FIELDS[cls]
    kw = {k: v for k, v in d.items() if k in names}
    if cls is RequestRecord and "class" in d:
        kw["cls"] = d["class"]
    if cls is EngineRecord:
        kw["itl"] = Histogram.from_dict(kw.get("itl"))
        kw["ttft"] = Histogram.from_dict(kw.get("ttft"))
    rec: Record = cls(**kw)
    return rec
