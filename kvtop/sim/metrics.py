"""The simulated engine's /metrics page in vLLM V1 names and semantics (docs/engines.md §2).

Rendered with prometheus-client from the engine's plain counters at scrape time (a custom
collector), so updating the counters costs nothing per token. The page carries the families kvtop's
vLLM adapter reads (and a few more a vLLM operator expects), labels ``model_name`` and
``engine="0"``, counters with ``_total`` and ``_created``, and vLLM's histogram buckets.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from kvtop.sim.engine import Engine
from kvtop.sim.stats import Hist

_GIB = 1 << 30


class EngineCollector:
    def __init__(self, engine: Engine, created: float | None = None):
        self.engine = engine
        self.created = time.time() if created is None else created
        cfg = engine.cfg
        self.labels = {"engine": "0", "model_name": cfg.model}
        swap = cfg.preemption_mode == "swap"
        self.cache_config = {
            "block_size": str(cfg.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": str(cfg.prefix_caching),
            "engine": "0",
            "gpu_memory_utilization": "0.9",
            "kv_cache_memory_bytes": str(cfg.num_gpu_blocks * cfg.block_bytes),
            "kv_cache_size_tokens": str(cfg.capacity_tokens),
            "kv_offloading_backend": "native" if swap else "None",
            "kv_offloading_size": repr(cfg.swap.host_capacity_bytes / _GIB) if swap else "None",
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(cfg.num_gpu_blocks),
            "sliding_window": "None",
        }

    def _counter(self, name: str, doc: str, value: float, extra: dict[str, str] | None = None,
                 fam: CounterMetricFamily | None = None) -> CounterMetricFamily:
        labels = {**self.labels, **(extra or {})}
        if fam is None:
            fam = CounterMetricFamily(name, doc, labels=sorted(labels))
        keys = sorted(labels)
        fam.add_metric([labels[k] for k in keys], value, created=self.created)
        return fam

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        fam = GaugeMetricFamily(name, doc, labels=sorted(self.labels))
        fam.add_metric([self.labels[k] for k in sorted(self.labels)], value)
        return fam

    def _hist(self, name: str, doc: str, h: Hist) -> HistogramMetricFamily:
        fam = HistogramMetricFamily(name, doc, labels=sorted(self.labels))
        buckets = [(_le(le), float(c)) for le, c in h.cumulative()]
        fam.add_metric([self.labels[k] for k in sorted(self.labels)], buckets, h.sum)
        return fam

    def collect(self) -> Iterator[Metric]:
        e = self.engine
        st = e.stats
        yield self._gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                          e.num_running)
        yield self._gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                          e.num_waiting)
        waiting = GaugeMetricFamily("vllm:num_requests_waiting_by_reason", "Waiting requests by reason.",
                                    labels=sorted([*self.labels, "reason"]))
        for reason, v in (("capacity", len(e.waiting)), ("deferred", len(e.swapping_in))):
            lb = {**self.labels, "reason": reason}
            waiting.add_metric([lb[k] for k in sorted(lb)], v)
        yield waiting
        yield self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", e.kv_usage)
        yield self._counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                            st.prefix_queries)
        yield self._counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                            st.prefix_hits)
        yield self._counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                            st.preemptions)
        yield self._counter("vllm:prompt_tokens", "Number of prefill tokens processed.", st.prompt_tokens)
        yield self._counter("vllm:generation_tokens", "Number of generation tokens processed.", st.generation_tokens)
        success: CounterMetricFamily | None = None
        for reason in ("stop", "length", "abort", "error", "repetition"):
            success = self._counter("vllm:request_success", "Count of successfully processed requests.",
                                    st.finished[reason], {"finished_reason": reason}, success)
        assert success is not None
        yield success
        yield self._hist("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                         st.iteration_tokens)
        yield self._hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", st.ttft)
        yield self._hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", st.itl)
        yield self._hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", st.e2e)
        if e.cfg.preemption_mode == "swap":
            for base, doc, src in (("vllm:kv_offload_total_bytes", "Bytes moved by KV offload.", st.offload_bytes),
                                   ("vllm:kv_offload_total_time", "Seconds spent in KV offload.", st.offload_time)):
                moved: CounterMetricFamily | None = None
                for direction in ("GPU_to_CPU", "CPU_to_GPU"):
                    moved = self._counter(base, doc, src[direction], {"transfer_type": direction}, moved)
                assert moved is not None
                yield moved
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=sorted(self.cache_config))
        info.add_metric([self.cache_config[k] for k in sorted(self.cache_config)], 1.0)
        yield info


def _le(le: float) -> str:
    return "+Inf" if le == float("inf") else repr(float(le))


class MetricsPage:
    """A registry holding one engine's collector; ``render()`` is the /metrics body."""

    def __init__(self, engine: Engine, created: float | None = None):
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = EngineCollector(engine, created)
        self.registry.register(self.collector)

    def render(self) -> str:
        return generate_latest(self.registry).decode("utf-8")
