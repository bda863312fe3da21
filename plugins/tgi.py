"""Hugging Face TGI adapter (v3.x router metrics).

Facts: docs/engines.md §4. TGI never preempts: its v3 queue reserves ``input + max_new_tokens``
at admission and keeps a request waiting instead, so KV pressure shows as queue size and queue
time, never as a mid-stream stall. Counters have no ``_total`` on the wire and no model label; the
model comes from ``GET /info`` when the scraper fetches it.
"""

from __future__ import annotations

import json

from kvtop.adapters import (
    EngineAdapter,
    Page,
    Setting,
    as_int,
    counter_names,
    positive_whole,
    prefix_score,
    read_page,
)
from kvtop.model.records import EngineRecord

P = "tgi_"
_CORE = ("tgi_queue_size", "tgi_batch_current_size")
_ITL = "tgi_request_mean_time_per_token_duration"
_DURATIONS = {
    "queue": "tgi_request_queue_duration",
    "request": "tgi_request_duration",
    "validation": "tgi_request_validation_duration",
    "inference": "tgi_request_inference_duration",
}
_HISTS = (_ITL, *_DURATIONS.values(), "tgi_request_input_length", "tgi_request_generated_tokens")
ITL_NOTE = (
    "TGI exports a per-request MEAN time per output token (tgi_request_mean_time_per_token_duration), "
    "not inter-token gaps: its tail hides stalls; stalls are visible only per stream (proxy/probe)"
)
# the limits /info states (router/src/lib.rs ``Info``), by the names ``EngineRecord.limits`` uses:
# --max-total-tokens bounds one request's prompt + output as vLLM's --max-model-len does;
# --max-batch-size is stated by TGI 1.x-2.x only where it was given
_INFO_LIMITS = {"max_model_len": "max_total_tokens", "max_num_seqs": "max_batch_size"}
NO_PREEMPT_NOTE = "TGI never preempts a running request: KV pressure shows as tgi_queue_size and queue time"


class TgiAdapter(EngineAdapter):
    name = "tgi"
    description = "Hugging Face text-generation-inference v3 (never preempts)"
    fields = frozenset(
        {
            "running", "waiting", "prompt_tokens_total", "generation_tokens_total",
            "requests_finished_total", "kv_capacity_tokens", "itl", "model",
        }
    )
    preempts = False
    extra_paths = ("/info",)
    settings = {
        Setting.MAX_BATCH_TOTAL_TOKENS: "--max-batch-total-tokens",
        Setting.MAX_SEQS: "--max-batch-size",
        Setting.ADMISSION: "--max-concurrent-requests",
        Setting.BATCHED_TOKENS: "--max-batch-prefill-tokens",
        Setting.CHUNKED_PREFILL: "--max-batch-prefill-tokens",
        Setting.WAITING_TOKENS: "--max-waiting-tokens",
        Setting.CTX: "--max-total-tokens",  # bounds prompt + output of one request
        Setting.MAX_INPUT_TOKENS: "--max-input-tokens",
        Setting.GPU_MEMORY: "--cuda-memory-fraction",
    }
    # backends/v3/src/main.rs (TGI 3.3): the router refuses to start otherwise; whether TGI chunks
    # prefills depends on its attention backend, which no metric names
    setting_notes = {
        Setting.BATCHED_TOKENS: "TGI refuses a --max-batch-prefill-tokens below --max-input-tokens unless it chunks "
                                "prefills (its flashinfer or flashdecoding attention backends), and one above "
                                "--max-batch-total-tokens",
        # router validation: input + max_new_tokens above --max-total-tokens is an error
        Setting.CTX: "TGI rejects a request whose prompt + max_new_tokens exceed it: clients that ask for more "
                     "tokens than they received need that much more",
    }

    @classmethod
    def detect(cls, metric_names: set[str]) -> float:
        return prefix_score(metric_names, P, _CORE)

    def parse(self, text: str, t: float) -> list[EngineRecord]:
        page = read_page(text, _CORE)
        page.warnings.extend(page.incomplete_histograms(_HISTS))
        return [self._record(page, t)]

    def _record(self, page: Page, t: float) -> EngineRecord:
        rec = EngineRecord(t=t, adapter=self.name, warnings=list(page.warnings))
        if not any(n.startswith(P) for n in page.samples):
            rec.warnings.append("no tgi_ metrics on the page")
            return rec
        rec.running = page.value("tgi_batch_current_size")
        rec.waiting = page.value("tgi_queue_size")
        cap = page.value(("tgi_batch_max_total_tokens", "tgi_batch_total_tokens"))
        if cap is not None:
            rec.kv_capacity_tokens = as_int(cap)
        cur = page.value("tgi_batch_current_max_tokens")
        if cur is not None:
            rec.extra["batch_current_max_tokens"] = cur
            if cap:
                # tokens reserved by the running batch: TGI's own budget, not measured KV usage
                rec.extra["batch_token_reservation"] = cur / cap
        # token counters: histogram sums (prompt length is observed at validation, generated
        # tokens when a request finishes)
        rec.prompt_tokens_total = page.value("tgi_request_input_length_sum")
        rec.generation_tokens_total = page.value("tgi_request_generated_tokens_sum")
        success = page.value(counter_names("tgi_request_success"))
        failure = page.value(counter_names("tgi_request_failure"))
        if success is not None or failure is not None:
            rec.requests_finished_total = (success or 0.0) + (failure or 0.0)
        by_err: dict[str, float] = {}
        for n in counter_names("tgi_request_failure"):
            for lb, v in page.select(n):
                by_err[lb.get("err", "?")] = by_err.get(lb.get("err", "?"), 0.0) + v
        if by_err:
            rec.extra["request_failures_by_err"] = by_err
        count = page.value(counter_names("tgi_request_count"))
        if count is not None:
            rec.extra["requests_total"] = count

        rec.itl = page.histogram(_ITL)
        if rec.itl is not None:
            rec.extra["itl_metric"] = _ITL
            rec.extra["itl_semantics"] = "per_request_mean_tpot"
        for short, base in _DURATIONS.items():
            h = page.histogram(base)
            if h is not None:
                rec.extra[f"{short}_duration_count"] = h.count
                rec.extra[f"{short}_duration_sum_s"] = h.sum
            else:
                # an un-bucketed histogram renders as a summary: keep its quantiles
                q = {lb["quantile"]: v for lb, v in page.select(base) if "quantile" in lb}
                if q:
                    rec.extra[f"{short}_duration_quantiles"] = q
        rec.extra["notes"] = [NO_PREEMPT_NOTE] + ([ITL_NOTE] if rec.itl is not None else [])
        return rec

    def parse_extra(self, path: str, body: str, records: list[EngineRecord]) -> None:
        if path != "/info":
            return
        try:
            info = json.loads(body)
        except ValueError:
            for r in records:
                r.warnings.append("/info: not JSON")
            return
        if not isinstance(info, dict):
            return
        for r in records:
            if isinstance(info.get("model_id"), str):
                r.model = info["model_id"]
            if isinstance(info.get("version"), str):
                r.version = info["version"]
            mbt = positive_whole(info.get("max_batch_total_tokens"))  # TGI 1.x-2.x
            if r.kv_capacity_tokens is None and mbt is not None:
                r.kv_capacity_tokens = mbt
            for key, name in _INFO_LIMITS.items():
                v = positive_whole(info.get(name))
                if v is not None:
                    r.limits.setdefault(key, v)
