"""What `kvtop agent` publishes to Prometheus: kvtop's findings as metric families.

Naming follows Prometheus conventions: prefix ``kvtop_``, base units (seconds, bytes, ratios),
``_total`` for counters, no colons. GPU series reuse the DCGM exporter's quantities and label names
(``gpu``, ``UUID``) so they sit next to ``DCGM_FI_DEV_FB_USED`` & co. in the same queries.

Cardinality is bounded by construction and never includes a request id. Every label means one
thing and its values are tokens (docs/fleet.md "Series"):
  engine      one per engine instance the agent scrapes (``host:port``, ``/rank`` for DP ranks)
  model_name  the model the engine reports serving (vLLM's label of the same name), "" if none
  cause       preemption, prefill_interference, slow_decode, unknown
  gpu, UUID   one per GPU on the node; signal: gup_pinned, engine_shmem, cgroup_shmem, mlocked
  observer    proxy, probe, capture (how a stream was observed)
  action, mechanism  the advisor's enums, as state-sets: every value present, the current one 1
Spike, stall, verdict and client-side histogram series exist for the engine the streams are observed
in front of (the proxy's / probe's); every other engine adds its state only. bench/agent_metrics.py:
69 series for one engine (no GPU), +7 per further engine, +10 per GPU, the same at 50 or 1,000
live requests (docs/fleet.md "Series").

Two paths keep ``/metrics`` cheap whatever the load: per-token work (client-side gap and TTFT
histograms) happens as records arrive, and everything derived from the core (spike counters, the
verdict, engine and GPU state) is rebuilt once per agent tick into a cached list of families
that a scrape only formats.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvtop import __version__
from kvtop.analysis.advice.advisor import ACTIONS
from kvtop.model.analysis import AnalysisCounters
from kvtop.model.records import EngineRecord, Record, RequestRecord
from kvtop.model.sanitize import redact_url
from kvtop.snapshot import Snapshot

CAUSES = ("preemption", "prefill_interference", "slow_decode", "unknown")
# a preemption storm's stalls reach tens of seconds; a small model's first token comes in milliseconds
GAP_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_MAX_STREAMS = 20_000  # open streams remembered for gap / TTFT (oldest forgotten first)
MECHANISMS = ("swap", "recompute")
# the host source's signal names are prose for the console; label values are tokens
SIGNAL_TOKENS = {"pinned (all GUP)": "gup_pinned", "engine RssShmem (incl. CUDA pinned)": "engine_shmem",
                 "cgroup shmem": "cgroup_shmem", "Mlocked (excludes CUDA pinned)": "mlocked"}
# downward-API variables (deploy/kubernetes/): which pod, namespace and node the agent runs in
POD_ENV = (("pod", "POD_NAME"), ("namespace", "POD_NAMESPACE"), ("node", "NODE_NAME"))


def signal_token(name: str) -> str:
    tok = SIGNAL_TOKENS.get(name)
    if tok is None:  # a signal added later: still a token, never prose
        tok = "_".join("".join(c if c.isalnum() else " " for c in name.lower()).split())
    return tok


def engine_label(url: str | None, engine: str | None = None) -> str:
    """Bounded, readable engine label: the scrape target's host:port, plus the DP rank if several.
    Credentials in the URL never reach a label (``***@host:port``, as the scraper shows the URL)."""
    u = redact_url(url) if url else "?"
    parts = urlsplit(u if "://" in u else "http://" + u)
    base = parts.netloc or u
    if parts.path and parts.path.rstrip("/") not in ("", "/metrics"):
        base += parts.path.rstrip("/")
    if engine not in (None, "", "0"):
        base += f"/{engine}"
    return base


class _Cached(Collector):
    def __init__(self) -> None:
        self.families: list[Any] = []

    def collect(self) -> Iterator[Any]:
        return iter(self.families)  # the list is swapped whole by update(): never half-built


class AgentMetrics:
    """Registry + record sink + per-tick update. Touch it from the agent's event loop only."""

    def __init__(self, request_engine: str | None = None, env: Mapping[str, str] | None = None):
        # requests are observed in front of one engine (the proxy's / probe's upstream)
        self.request_engine = request_engine or "?"
        env = os.environ if env is None else env
        self.placement = [env.get(var, "") for _, var in POD_ENV]
        # the _created series (a counter's or histogram's creation time) are noise to an alert and a
        # dashboard: not exported (prometheus_client's switch is process-wide; the agent's process)
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry(auto_describe=False)
        self._cached = _Cached()
        self.registry.register(self._cached)
        self.gap = Histogram("kvtop_stream_inter_token_gap_seconds",
                             "Client-side gap between streamed token chunks of the observed streams",
                             ["engine"], buckets=GAP_BUCKETS, registry=self.registry)
        self.ttft = Histogram("kvtop_stream_time_to_first_token_seconds",
                              "Client-side time from request to first streamed token",
                              ["engine"], buckets=TTFT_BUCKETS, registry=self.registry)
        self.streams = Counter("kvtop_streams_observed", "Streams kvtop observed, by how it saw them",
                               ["engine", "observer"], registry=self.registry)
        self.scrape_errors = Counter("kvtop_engine_scrape_errors", "Failed scrapes of an engine", ["engine"],
                                     registry=self.registry)
        self._gap_child = self.gap.labels(self.request_engine)
        self._ttft_child = self.ttft.labels(self.request_engine)
        self._open: OrderedDict[str, tuple[float, float | None]] = OrderedDict()  # id -> (arrive, last token)
        self._engines: dict[tuple[str | None, str | None], Any] = {}  # (url, engine) -> its scrape-error child
        self.dropped = 0  # records a sink could not keep (set by the agent)
        self.updates = 0

    # -- per record (hot path) ----------------------------------------------------------------
    def sink(self, rec: Record) -> None:
        if type(rec) is RequestRecord:
            ev = rec.event
            if ev == "token" or ev == "first_token":
                st = self._open.get(rec.id)
                if st is None:
                    self._remember(rec.id, (rec.t, rec.t))
                    return
                arrive, last = st
                if last is None:
                    self._ttft_child.observe(max(0.0, rec.t - arrive))
                else:
                    self._gap_child.observe(max(0.0, rec.t - last))
                self._open[rec.id] = (arrive, rec.t)
            elif ev == "arrive":
                self.streams.labels(self.request_engine, rec.source or "unknown").inc()
                self._remember(rec.id, (rec.t, None))
            elif ev in ("finish", "cancel", "error"):
                self._open.pop(rec.id, None)
        elif type(rec) is EngineRecord:
            key = (rec.url, rec.engine)
            if key not in self._engines:
                # every engine's error counter exists from its first scrape, at 0: increase() then sees
                # the first failure as one (a series born at 1 shows none)
                self._engines[key] = self.scrape_errors.labels(engine_label(rec.url, rec.engine))
            if not rec.up:
                self._engines[key].inc()

    def _remember(self, rid: str, st: tuple[float, float | None]) -> None:
        self._open[rid] = st
        if len(self._open) > _MAX_STREAMS:
            self._open.popitem(last=False)

    # -- per tick -----------------------------------------------------------------------------
    def update(self, snap: Snapshot, totals: AnalysisCounters | None = None, stale_after_s: float = 10.0,
               analysis_lag_s: float | None = None) -> None:
        """Rebuild the derived families from one snapshot and the live analysis's running totals
        (``LiveAnalysis.counters()``: the snapshot's report covers a window, the counters all time)."""
        fams: list[Any] = []

        def gauge(name: str, doc: str, labels: list[str] | None = None) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels or [])
            fams.append(g)
            return g

        def counter(name: str, doc: str, labels: list[str]) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            fams.append(c)
            return c

        info = gauge("kvtop_agent_info", "kvtop agent version, and the pod, namespace and node it runs in "
                     "(Kubernetes downward API; empty elsewhere)", ["version", *(k for k, _ in POD_ENV)])
        info.add_metric([__version__, *self.placement], 1)
        gauge("kvtop_agent_last_update_timestamp_seconds",
              "Unix time of the agent's last analysis tick (a stale agent stops moving it)").add_metric([], time.time())

        el = ["engine", "model_name"]
        e_up = gauge("kvtop_engine_up", "1 if the engine's last scrape succeeded", [*el, "adapter"])
        e_kv = gauge("kvtop_engine_kv_cache_usage_ratio", "KV cache usage of the engine (0..1)", el)
        e_run = gauge("kvtop_engine_running_requests", "Requests in the engine's running batch", el)
        e_wait = gauge("kvtop_engine_waiting_requests", "Requests waiting in the engine's queue", el)
        e_pre = counter("kvtop_engine_preemptions", "The engine's own preemption counter, as scraped (it starts "
                        "again from 0 when the engine restarts, as any counter of a restarted process)", el)
        e_age = gauge("kvtop_engine_last_success_age_seconds", "Seconds since the engine's /metrics last answered", el)
        stale = gauge("kvtop_engine_stale", "1 if the engine's /metrics has not answered for a while", el)
        models: dict[str, str] = {}
        for e in snap.engines:
            lab = engine_label(e.url, e.engine)
            k = [lab, e.model or ""]
            models.setdefault(lab, e.model or "")
            e_up.add_metric([*k, e.adapter or "unknown"], 1.0 if e.up else 0.0)
            if not e.up:
                # what a dead engine last said is not its state now: its gauges go (Prometheus marks
                # them stale) rather than hold old values on a dashboard; its counter stays (a counter
                # that vanished and came back would read as a reset)
                if e.preemptions_total is not None:
                    e_pre.add_metric(k, e.preemptions_total)
                if e.stale_s is not None:
                    e_age.add_metric(k, e.stale_s)
                stale.add_metric(k, 1.0)
                continue
            if e.kv_usage is not None:
                e_kv.add_metric(k, e.kv_usage)
            if e.running is not None:
                e_run.add_metric(k, e.running)
            if e.waiting is not None:
                e_wait.add_metric(k, e.waiting)
            if e.preemptions_total is not None:
                e_pre.add_metric(k, e.preemptions_total)
            if e.stale_s is not None:
                e_age.add_metric(k, e.stale_s)
            stale.add_metric(k, 1.0 if (not e.up or e.stale_s is None or e.stale_s > stale_after_s) else 0.0)
        gauge("kvtop_gpu_stale", "1 if NVML stopped answering (0 when the GPU is not read: --no-gpu)").add_metric(
            [], 0.0 if snap.gpu_status == "ok" or snap.gpu_status.startswith("disabled") else 1.0)

        lab = self.request_engine
        k = [lab, models.get(lab, "")]
        spikes = counter("kvtop_token_gap_spikes", "Inter-token gaps above the ITL target, by attributed cause",
                         [*el, "cause"])
        stall = counter("kvtop_stall_seconds", "Seconds streams stalled in spikes, by attributed cause",
                        [*el, "cause"])
        counts = totals.spikes_by_cause if totals else {}
        secs = totals.stall_s_by_cause if totals else {}
        for c in CAUSES:
            spikes.add_metric([*k, c], float(counts.get(c, 0)))
            stall.add_metric([*k, c], float(secs.get(c, 0.0)))
        attributed = counter("kvtop_preemptions_attributed",
                             "Streams whose stall kvtop attributed to preemption (compare kvtop_engine_preemptions_total)",
                             el)
        attributed.add_metric(k, float(totals.preemptions_attributed if totals else 0))
        rep = snap.analysis
        verdict = rep.verdict if rep is not None else None
        # state-sets: the label set never changes, so changes() and alerts see a verdict change as a value
        v_act = gauge("kvtop_verdict", "The advisor's current action (1) among every possible one (0)", [*el, "action"])
        action = verdict.action if verdict is not None else None
        for a in ACTIONS:
            v_act.add_metric([*k, a], 1.0 if a == action else 0.0)
        v_mech = gauge("kvtop_verdict_mechanism", "The eviction mechanism the verdict names (1; all 0 when none)",
                       [*el, "mechanism"])
        mech = verdict.mechanism if verdict is not None else None
        for mm in MECHANISMS:
            v_mech.add_metric([*k, mm], 1.0 if mm == mech else 0.0)
        v_conf = gauge("kvtop_verdict_confidence", "Confidence of the current verdict (0..1)", el)
        if verdict is not None and verdict.confidence is not None:
            v_conf.add_metric(k, float(verdict.confidence))
        tgt = rep.itl_target_s if rep is not None else snap.itl_target_s
        if tgt:
            gauge("kvtop_itl_target_seconds", "ITL target the spikes are measured against", el).add_metric(
                k, float(tgt))

        if snap.host is not None:
            h = snap.host
            sig_g = gauge("kvtop_host_memory_signal_bytes", "Host memory signals kvtop weighs for pinned memory, side "
                          "by side (none exact, never sum them; docs/host-and-gpu.md)", ["signal"])
            for sig, v in sorted(h.pinned_signals.items()):
                if v is not None:
                    sig_g.add_metric([signal_token(sig)], float(v))
            if h.pinned_bytes is not None and h.pinned_signal is not None:
                gauge("kvtop_host_pinned_memory_bytes", "Best estimate of host pinned (page-locked) memory, and the "
                      "signal it comes from", ["signal"]).add_metric([signal_token(h.pinned_signal)], float(h.pinned_bytes))
            if h.mem_available_bytes is not None:
                gauge("kvtop_host_memory_available_bytes", "Host MemAvailable").add_metric([], h.mem_available_bytes)

        gl = ["gpu", "UUID"]
        g_used = gauge("kvtop_gpu_fb_used_bytes", "GPU framebuffer memory used (DCGM_FI_DEV_FB_USED, in bytes)", gl)
        g_tot = gauge("kvtop_gpu_fb_total_bytes", "GPU framebuffer memory total", gl)
        # NVML's cumulative counters where the driver has them (exact at any scrape interval: rate() them);
        # the 20 ms throughput sample otherwise, as a gauge (one of the two per GPU, never both)
        c_tx = counter("kvtop_gpu_pcie_tx_bytes", "PCIe bytes sent by the GPU since the driver loaded "
                       "(NVML_FI_DEV_PCIE_COUNT_TX_BYTES)", gl)
        c_rx = counter("kvtop_gpu_pcie_rx_bytes", "PCIe bytes received by the GPU since the driver loaded "
                       "(NVML_FI_DEV_PCIE_COUNT_RX_BYTES)", gl)
        g_tx = gauge("kvtop_gpu_pcie_tx_sampled_bytes_per_second", "PCIe transmit rate, NVML's 20 ms sample (only "
                     "where the driver has no byte counters)", gl)
        g_rx = gauge("kvtop_gpu_pcie_rx_sampled_bytes_per_second", "PCIe receive rate, NVML's 20 ms sample (only "
                     "where the driver has no byte counters)", gl)
        g_gen = gauge("kvtop_gpu_pcie_link_gen", "Current PCIe link generation (DCGM_FI_DEV_PCIE_LINK_GEN)", gl)
        g_genm = gauge("kvtop_gpu_pcie_link_gen_max", "Maximum PCIe link generation", gl)
        g_w = gauge("kvtop_gpu_pcie_link_width", "Current PCIe link width in lanes (DCGM_FI_DEV_PCIE_LINK_WIDTH)", gl)
        g_wm = gauge("kvtop_gpu_pcie_link_width_max", "Maximum PCIe link width in lanes", gl)
        g_dt = gauge("kvtop_gpu_pcie_link_downtrained", "1 if the link runs below its max gen/width under load", gl)
        g_rp = counter("kvtop_gpu_pcie_replay", "PCIe replay counter (DCGM_FI_DEV_PCIE_REPLAY_COUNTER)", gl)
        for view in snap.gpus:
            g = view.record
            k = [str(g.index), g.uuid or ""]
            sampled = g.pcie_source != "field_counters"
            vals: tuple[tuple[Any, float | int | None], ...] = (
                (g_used, g.mem_used_bytes), (g_tot, g.mem_total_bytes),
                (c_tx, g.pcie_tx_bytes_total), (c_rx, g.pcie_rx_bytes_total),
                (g_tx, g.pcie_tx_bytes_per_s if sampled else None), (g_rx, g.pcie_rx_bytes_per_s if sampled else None),
                (g_gen, g.pcie_link_gen), (g_genm, g.pcie_link_gen_max),
                (g_w, g.pcie_link_width), (g_wm, g.pcie_link_width_max), (g_rp, g.pcie_replay_count))
            for fam, val in vals:
                if val is not None:
                    fam.add_metric(k, float(val))
            g_dt.add_metric(k, 1.0 if view.link_downtrained else 0.0)

        gauge("kvtop_analysis_lag_seconds",
              "How far the analysis trails the newest record (spikes wait for their evidence window)").add_metric(
            [], max(0.0, analysis_lag_s or 0.0))
        gauge("kvtop_analysis_pending_spikes", "Spikes waiting for their evidence window").add_metric(
            [], float((rep.pending_spikes or 0) if rep is not None else 0))
        counter("kvtop_dropped_records", "Records kvtop could not keep (trace write failures)", []).add_metric(
            [], float(self.dropped))
        self._cached.families = fams
        self.updates += 1

    def render(self) -> bytes:
        return generate_latest(self.registry)

