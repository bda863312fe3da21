"""vLLM adapter: V1 names, V0 / renamed aliases, DP engines, cache_config_info, offload counters.

Facts: docs/engines.md §2. One record per ``engine`` label (data-parallel ranks).
"""

from __future__ import annotations

from kvtop.adapters import EngineAdapter, Page, Setting, as_int, finite_or_none, prefix_score, read_page
from kvtop.model.records import EngineRecord

P = "vllm:"

# (normalised field, candidate wire names newest first)
_GAUGES = {
    "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "running": ("vllm:num_requests_running",),
    "waiting": ("vllm:num_requests_waiting",),
}
_COUNTERS = {
    "preemptions_total": ("vllm:num_preemptions_total",),
    "prompt_tokens_total": ("vllm:prompt_tokens_total",),
    "generation_tokens_total": ("vllm:generation_tokens_total",),
    "prefix_hits_total": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
    "prefix_queries_total": ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
}
_ITL = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")
_TTFT = ("vllm:time_to_first_token_seconds",)
# offload: (field, legacy name + transfer_type, newer dashboard name)
_OFFLOAD = {
    "offload_out_bytes_total": (("vllm:kv_offload_total_bytes_total", "GPU_to_CPU"), "vllm:kv_offload_store_bytes_total"),
    "offload_in_bytes_total": (("vllm:kv_offload_total_bytes_total", "CPU_to_GPU"), "vllm:kv_offload_load_bytes_total"),
    "offload_out_seconds_total": (("vllm:kv_offload_total_time_total", "GPU_to_CPU"), "vllm:kv_offload_store_time_total"),
    "offload_in_seconds_total": (("vllm:kv_offload_total_time_total", "CPU_to_GPU"), "vllm:kv_offload_load_time_total"),
}
_GIB = 1 << 30


def _float_label(labels: dict[str, str], key: str) -> float | None:
    """cache_config_info values are str(python value): "None" and "" mean unknown."""
    v = labels.get(key)
    if v is None or v in ("None", ""):
        return None
    try:
        return finite_or_none(float(v))
    except ValueError:
        return None


def _int_label(labels: dict[str, str], key: str) -> int | None:
    v = _float_label(labels, key)
    return as_int(v)


class VllmAdapter(EngineAdapter):
    name = "vllm"
    description = "vLLM (V1 engine; V0 and renamed metrics accepted)"
    fields = frozenset(
        {
            "kv_usage", "running", "waiting", "preemptions_total", "prompt_tokens_total",
            "generation_tokens_total", "prefix_hits_total", "prefix_queries_total",
            "requests_finished_total", "requests_aborted_total", "kv_capacity_tokens", "block_size",
            "offload_capacity_bytes", "offload_out_bytes_total", "offload_in_bytes_total",
            "offload_out_seconds_total", "offload_in_seconds_total", "itl", "ttft", "model",
        }
    )
    preempts = True
    preempt_counted_at = "resume"  # V1 counts a preemption when the victim is scheduled again
    # --scheduling-policy fcfs (the default) admits the waiting queue in arrival order and stops at
    # the first request it cannot place; "priority" orders by each request's priority, then arrival
    admits_in_order = True
    # V1's scheduler takes every scheduled token, decodes first, out of --max-num-batched-tokens
    # (vllm/v1/core/sched/scheduler.py: token_budget), and SchedulerConfig refuses a --max-num-seqs
    # above it (docs/engines.md)
    budget_holds_decodes = True
    chunks_prefills = True  # unless --no-enable-chunked-prefill (or a model that cannot)
    version_path = "/version"  # {"version": "0.32.0"}: the advisor picks the flags of that version
    # its model cards state --max-model-len after vLLM's defaults (vllm/entrypoints/openai/models/serving.py)
    limits_path = "/v1/models"
    settings = {
        Setting.MAX_SEQS: "--max-num-seqs",
        Setting.BATCHED_TOKENS: "--max-num-batched-tokens",
        Setting.CHUNKED_PREFILL: "--enable-chunked-prefill",
        Setting.OFFLOAD_SIZE: "--kv-offloading-size",
        Setting.OFFLOAD_BACKEND: "--kv-offloading-backend",
        Setting.GPU_MEMORY: "--gpu-memory-utilization",
        Setting.KV_CACHE_BYTES: "--kv-cache-memory-bytes",  # overrides the memory share for the KV cache
        Setting.CTX: "--max-model-len",  # bounds prompt + output of one request
    }
    host_tier = "vllm_v1_offload"  # the KV offloading connector (V0's swap where the version says so)
    setting_notes = {
        # vllm/config/scheduler.py (verify_max_model_len): chunked prefill is on by default
        Setting.BATCHED_TOKENS: "with chunked prefill on (vLLM's default); vLLM refuses a budget below "
                                "--max-model-len where it is switched off",
        # vllm/entrypoints/serve/utils/api_utils.py (0.32): a longer prompt is an error, max_tokens is
        # lowered to what the bound leaves
        Setting.CTX: "vLLM rejects a longer prompt and shortens a request's max_tokens to what the bound leaves it",
    }

    @classmethod
    def detect(cls, metric_names: set[str]) -> float:
        return prefix_score(metric_names, P, core_prefixes=("vllm:num_requests_", "vllm:kv_cache", "vllm:gpu_cache"))

    def parse(self, text: str, t: float) -> list[EngineRecord]:
        page = read_page(text, ("vllm:num_requests_running", "vllm:num_requests_waiting"))
        page.warnings.extend(page.incomplete_histograms((*_ITL, *_TTFT)))
        return self.parse_page(page, t)

    def parse_page(self, page: Page, t: float) -> list[EngineRecord]:
        vllm_names = [n for n in page.samples if n.startswith(P)]
        # Series without an engine label (info gauges, older pages) belong to every engine.
        engines: list[str | None] = [e for e in page.label_values("engine", vllm_names) if e is not None] or [None]
        out = []
        for eng in engines:
            rec = self._one(page, t, None if eng is None else {"engine": eng})
            rec.engine = eng
            rec.warnings = list(page.warnings)
            out.append(rec)
        if not vllm_names:
            rec = EngineRecord(t=t, adapter=self.name, warnings=list(page.warnings) + ["no vllm: metrics on the page"])
            return [rec]
        return out

    def _one(self, page: Page, t: float, m: dict[str, str] | None) -> EngineRecord:
        rec = EngineRecord(t=t, adapter=self.name)
        for fld, names in _GAUGES.items():
            n = page.first_present(*names)
            if n:
                setattr(rec, fld, page.value(n, m))
        for fld, names in _COUNTERS.items():
            n = page.first_present(*names)
            if n:
                setattr(rec, fld, page.value(n, m))
        if page.has("vllm:request_success_total"):
            rec.requests_finished_total = page.value("vllm:request_success_total", m)
            rec.requests_aborted_total = page.value(
                "vllm:request_success_total", {**(m or {}), "finished_reason": "abort"}
            )
        # Histograms are keyed by their wire series (``<base>_bucket``), not the family name.
        n = page.first_present(*(b + "_bucket" for b in _ITL))
        if n:
            rec.itl = page.histogram(n[: -len("_bucket")], m)
        rec.ttft = page.histogram(_TTFT[0], m)
        for fld, ((legacy, direction), newer) in _OFFLOAD.items():
            if page.has(legacy):
                setattr(rec, fld, page.value(legacy, {**(m or {}), "transfer_type": direction}))
            elif page.has(newer):
                setattr(rec, fld, page.value(newer, m))
        # per-request histograms observed when a request finishes (vLLM V1): how often each finished
        # request was preempted, and the KV tokens its prefills computed (recompute included)
        for key, base in (("request_preemptions", "vllm:request_num_preemptions"),
                          ("prefill_kv_computed", "vllm:request_prefill_kv_computed_tokens")):
            h = page.histogram(base, m)
            if h is not None:
                rec.extra[key] = {"count": h.count, "sum": h.sum}
        rec.model = self._model(page, m)
        self._cache_config(page, m, rec)
        for n in ("vllm:prompt_tokens_created", "vllm:num_preemptions_created"):
            v = page.value(n, m)
            if v is not None:
                rec.restart_token = v
                break
        return rec

    @staticmethod
    def _model(page: Page, m: dict[str, str] | None) -> str | None:
        """The ``model_name`` label of this engine's series (gauges first: they always exist)."""
        for n in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
                  "vllm:generation_tokens_total", "vllm:prompt_tokens_total"):
            for lb, _ in page.select(n, m):
                if lb.get("model_name"):
                    return lb["model_name"]
        return None

    @staticmethod
    def _cache_config(page: Page, m: dict[str, str] | None, rec: EngineRecord) -> None:
        # Some versions publish cache_config_info without the ``engine`` label while the other
        # series carry it: one config then describes every engine.
        rows = page.select("vllm:cache_config_info", m) or [
            (lb, v) for lb, v in page.select("vllm:cache_config_info") if "engine" not in lb
        ]
        if not rows:
            return
        lb = rows[0][0]
        bs = _int_label(lb, "block_size")
        rec.block_size = bs
        size_tokens = _int_label(lb, "kv_cache_size_tokens")
        blocks = _int_label(lb, "num_gpu_blocks")
        if size_tokens is not None:
            rec.kv_capacity_tokens = size_tokens
        elif blocks is not None and bs is not None:
            rec.kv_capacity_tokens = blocks * bs
        off_gib = _float_label(lb, "kv_offloading_size")
        if off_gib is not None:
            rec.offload_capacity_bytes = as_int(off_gib * _GIB)
        elif (_int_label(lb, "num_cpu_blocks") or 0) > 0:
            # V0's swap space (GiB), only where it allocated blocks there: V1 has no swap (its pages
            # say num_cpu_blocks="None" beside the default swap_space 4), and --cpu-offload-gb
            # holds model weights, not KV
            gib = _float_label(lb, "swap_space")
            if gib:
                rec.offload_capacity_bytes = as_int(gib * _GIB)
        extra = {
            k: lb[k]
            for k in ("cache_dtype", "kv_offloading_backend", "enable_prefix_caching", "num_gpu_blocks",
                      "num_cpu_blocks", "kv_cache_memory_bytes", "gpu_memory_utilization", "sliding_window")
            if k in lb and lb[k] != "None"
        }
        if extra:
            rec.extra["cache_config"] = extra
