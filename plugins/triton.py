"""Triton Inference Server + TensorRT-LLM backend adapter (``:8002/metrics``).

Facts: docs/engines.md §6 (from the backend README; the mapping of type labels to kvtop
fields is inferred from their names). One record per TensorRT-LLM model (``model``/``version``
labels). ``nv_inference_*`` counters have no ``_total`` on the wire. KV capacity in tokens is
``max`` blocks x ``tokens_per`` block. The backend exports no preemption counter; with the
MAX_UTILIZATION scheduler policy it may pause requests, so ``preempts`` stays True and stalls
are found per stream.
"""

from __future__ import annotations

from kvtop.adapters import EngineAdapter, Keep, Labels, Page, Setting, as_int, counter_names, read_page
from kvtop.adapters.detect import SURE
from kvtop.model.records import EngineRecord

P = "nv_trt_llm_"
KV = "nv_trt_llm_kv_cache_block_metrics"
REQ = "nv_trt_llm_request_metrics"
_CORE = (KV, REQ)
_TTFT_MS = "nv_inference_first_response_histogram_ms"  # decoupled models, Triton >= 24.x
# by-type families copied to extra: family -> type label
_TYPED_EXTRA = {
    "nv_trt_llm_runtime_memory_metrics": "memory_type",
    "nv_trt_llm_general_metrics": "general_type",
    "nv_trt_llm_inflight_batcher_metrics": "inflight_batcher_specific_metric",
    "nv_trt_llm_disaggregated_serving_metrics": "disaggregated_serving_type",
}
_NV_COUNTERS = (
    "nv_inference_count", "nv_inference_exec_count", "nv_inference_request_duration_us",
    "nv_inference_queue_duration_us", "nv_inference_compute_input_duration_us",
    "nv_inference_compute_infer_duration_us", "nv_inference_compute_output_duration_us",
)


class TritonAdapter(EngineAdapter):
    name = "triton"
    description = "Triton Inference Server with the TensorRT-LLM backend"
    fields = frozenset(
        {"kv_usage", "running", "waiting", "requests_finished_total", "kv_capacity_tokens", "block_size", "ttft", "model"}
    )
    preempts = True
    # TensorRT-LLM caps a prompt at max_num_tokens unless enable_chunked_context is set, which
    # Triton's config.pbtxt leaves off
    chunks_prefills = False
    settings = {
        Setting.GPU_MEMORY: "kv_cache_free_gpu_mem_fraction (config.pbtxt)",
        Setting.MAX_TOTAL_TOKENS: "max_tokens_in_paged_kv_cache (config.pbtxt)",
        Setting.ADMISSION: "batch_scheduler_policy guaranteed_no_evict|max_utilization (config.pbtxt)",
        Setting.CHUNKED_PREFILL: "enable_chunked_context (config.pbtxt)",
        Setting.OFFLOAD_SIZE: "kv_cache_host_memory_bytes (config.pbtxt)",
        Setting.PREFIX_REUSE: "enable_kv_cache_reuse (config.pbtxt)",
        Setting.MAX_SEQS: "trtllm-build --max_batch_size",
        Setting.BATCHED_TOKENS: "trtllm-build --max_num_tokens",
    }

    @classmethod
    def detect(cls, metric_names: set[str]) -> float:
        if any(m.startswith(P) for m in metric_names):
            return SURE
        # Triton without TensorRT-LLM families: low, so an engine-specific adapter on the same
        # page (e.g. vllm: metrics of Triton's vLLM backend) wins
        return 0.35 if any(m.startswith("nv_inference_") for m in metric_names) else 0.0

    def parse(self, text: str, t: float) -> list[EngineRecord]:
        return self._records(read_page(text, _CORE), t)

    def _records(self, page: Page, t: float) -> list[EngineRecord]:
        inst: dict[tuple[str | None, str | None], None] = {}
        for n in page.samples:
            if n.startswith(P):
                for lb, _ in page.samples[n]:
                    inst.setdefault((lb.get("model"), lb.get("version")))
        if not inst:
            rec = EngineRecord(t=t, adapter=self.name, warnings=list(page.warnings))
            rec.warnings.append("no nv_trt_llm_ metrics on the page: not a TensorRT-LLM model (KV data n/a)")
            pending = page.value("nv_inference_pending_request_count")
            if pending is not None:
                rec.extra["pending_requests"] = pending
            return [rec]
        models = {m for m, _ in inst}
        out = []
        for m, v in inst:
            def keep(lb: Labels, m: str | None = m, v: str | None = v) -> bool:
                return lb.get("model") == m and lb.get("version", v) == v

            rec = self._one(page, t, keep)
            rec.model = m
            if len(inst) > 1:
                rec.engine = m if len(models) == len(inst) else f"{m}:{v}"
            if v is not None:
                rec.extra["model_version"] = v
            rec.warnings = list(page.warnings)
            out.append(rec)
        return out

    def _one(self, page: Page, t: float, keep: Keep) -> EngineRecord:
        rec = EngineRecord(t=t, adapter=self.name)

        def typed(family: str, label: str) -> dict[str, float]:
            return {lb[label]: v for lb, v in page.select(family, keep) if label in lb}

        req = typed(REQ, "request_type")
        rec.running = req.get("active")
        rec.waiting = req.get("waiting")
        for k in ("max", "scheduled", "context"):
            if k in req:
                rec.extra[f"requests_{k}"] = req[k]

        kv = typed(KV, "kv_cache_block_type")
        if kv:
            rec.extra["kv_blocks"] = {k: kv[k] for k in ("max", "free", "used", "reused") if k in kv}
        if "fraction" in kv:
            rec.kv_usage = kv["fraction"]
        elif kv.get("max"):
            if "used" in kv:
                rec.kv_usage = kv["used"] / kv["max"]
        if "tokens_per" in kv:
            rec.block_size = as_int(kv["tokens_per"])
            if "max" in kv:
                rec.kv_capacity_tokens = as_int(kv["max"] * kv["tokens_per"])

        success = page.value(counter_names("nv_inference_request_success"), keep)
        failure = page.value(counter_names("nv_inference_request_failure"), keep)
        if success is not None or failure is not None:
            rec.requests_finished_total = (success or 0.0) + (failure or 0.0)
        if failure is not None:
            rec.extra["requests_failed_total"] = failure
        pending = page.value("nv_inference_pending_request_count", keep)
        if pending is not None:
            rec.extra["pending_requests"] = pending
        for base in _NV_COUNTERS:
            val = page.value(counter_names(base), keep)
            if val is not None:
                rec.extra[base.removeprefix("nv_")] = val
        for family, label in _TYPED_EXTRA.items():
            d = typed(family, label)
            if not d and family + "_total" in page.samples:
                d = typed(family + "_total", label)
            if d:
                rec.extra[family.removeprefix("nv_trt_llm_")] = d
        rec.ttft = page.histogram(_TTFT_MS, keep, scale=0.001)
        return rec
