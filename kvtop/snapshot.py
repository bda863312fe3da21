"""The Snapshot: the one immutable value every view renders (docs/design.md §1).

The core derives it from its state; the TUI, the headless report, the exporter and tests only
read it. JSON output follows ``kvtop/schemas/snapshot.schema.json``: numbers stay numbers,
unknown is ``null``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from kvtop.model.analysis import AnalysisReport

# Severity thresholds (docs/host-and-gpu.md §6; vLLM kv-cache dashboard).
KV_WARN = 0.90
KV_CRIT = 0.98
PREEMPT_WARN_PER_S = 0.0  # any preemption is worth a look
PREEMPT_CRIT_PER_S = 1.0


@dataclass(frozen=True, slots=True)
class GpuView:
    index: int
    uuid: str | None
    name: str | None
    lost: bool = False
    mem_used_bytes: int | None = None
    mem_total_bytes: int | None = None
    mem_reserved_bytes: int | None = None
    pcie_tx_bytes_per_s: float | None = None
    pcie_rx_bytes_per_s: float | None = None
    pcie_source: str | None = None
    pcie_link_gen: int | None = None
    pcie_link_width: int | None = None
    pcie_link_gen_max: int | None = None
    pcie_link_width_max: int | None = None
    # Theoretical per-direction capacity at the *current* gen/width (docs/host-and-gpu.md §2).
    pcie_capacity_bytes_per_s: float | None = None
    # Current link below the max while traffic flows (idle links down-train on purpose).
    link_downtrained: bool = False
    pcie_replay_count: int | None = None
    util_pct: float | None = None
    mig_mode: bool | None = None
    engine_proc_mem_bytes: int | None = None
    pcie_tx_history: tuple[float, ...] = ()
    pcie_rx_history: tuple[float, ...] = ()
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class HostView:
    mem_total_bytes: int | None = None
    mem_available_bytes: int | None = None
    swap_total_bytes: int | None = None
    swap_used_bytes: int | None = None
    pinned_bytes: int | None = None
    pinned_signal: str | None = None
    pinned_signals: dict[str, int | None] = field(default_factory=dict)
    shmem_bytes: int | None = None
    cgroup_shmem_bytes: int | None = None
    cgroup_mem_max_bytes: int | None = None
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class EngineView:
    url: str
    adapter: str | None
    up: bool
    engine: str | None = None
    model: str | None = None
    error: str | None = None  # why it is down / unreadable, one line
    stale_s: float | None = None  # seconds since the last good scrape
    preempts: bool = True  # False: this engine never preempts (TGI, llama.cpp)
    kv_usage: float | None = None
    running: float | None = None
    waiting: float | None = None
    preemptions_total: float | None = None
    preemptions_per_s: float | None = None
    prompt_tokens_per_s: float | None = None
    generation_tokens_per_s: float | None = None
    itl_p50_s: float | None = None
    itl_p99_s: float | None = None
    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None
    kv_capacity_tokens: int | None = None
    block_size: int | None = None
    restarts: int = 0
    kv_usage_history: tuple[float, ...] = ()
    preemptions_history: tuple[float, ...] = ()  # preemptions/s per tick
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class RequestView:
    id: str
    state: str  # waiting, running, finished, cancelled, error
    cls: str | None = None
    source: str | None = None
    tokens: int = 0
    age_s: float = 0.0
    current_gap_s: float | None = None
    max_gap_s: float | None = None
    spikes: int = 0
    preempt_spikes: int = 0
    last_cause: str | None = None


@dataclass(frozen=True, slots=True)
class EventView:
    t: float
    severity: str  # info, warning, error
    kind: str  # preemption_burst, engine_restart, engine_down, engine_up, source_error, link_downtrained, verdict_change
    message: str


@dataclass(frozen=True, slots=True)
class Snapshot:
    kvtop_version: str
    taken_at: str  # ISO-8601 UTC
    t: float  # run clock
    window_s: float
    gpu_status: str  # "ok" or the one-line reason there is no GPU data
    gpus: tuple[GpuView, ...] = ()
    host: HostView | None = None
    engines: tuple[EngineView, ...] = ()
    requests: tuple[RequestView, ...] = ()
    events: tuple[EventView, ...] = ()
    itl_target_s: float | None = None
    analysis: AnalysisReport | None = None  # spikes, causes, verdict
    paused: bool = False
    source_label: str = "live"  # live, replay FILE, demo
    host_status: str = "ok"  # "ok" or why there is no host data ("off (--no-host)")
    # passive capture (--capture): port, status ("ok" or why not) and its loss counters; None when off
    capture: dict[str, Any] | None = None

    def to_json(self, include_history: bool = False) -> dict[str, Any]:
        """The documented JSON contract (schemas/snapshot.schema.json)."""

        def clean(obj: Any) -> Any:
            d = dataclasses.asdict(obj)
            if not include_history:
                d = {k: v for k, v in d.items() if not k.endswith("_history")}
            for k, v in d.items():
                if isinstance(v, tuple):
                    d[k] = list(v)
            return d

        out: dict[str, Any] = {
            "kvtop_version": self.kvtop_version,
            "taken_at": self.taken_at,
            "window_s": self.window_s,
            "gpu_status": self.gpu_status,
            "gpus": [clean(g) for g in self.gpus],
            "host": clean(self.host) if self.host else {},
            "engines": [clean(e) for e in self.engines],
        }
        if self.requests:
            out["requests"] = [
                {("class" if k == "cls" else k): v for k, v in clean(r).items()} for r in self.requests
            ]
        if self.events:
            out["events"] = [clean(e) for e in self.events]
        if self.analysis is not None:
            out["analysis"] = self.analysis.to_dict()
        if self.capture is not None:
            out["capture"] = dict(self.capture)
        return finite(out)


def finite(obj: Any) -> Any:
    """JSON has no NaN/Infinity (a histogram without _sum, a 0/0 rate): unknown is null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [finite(v) for v in obj]
    return obj
