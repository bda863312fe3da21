"""SGLang adapter: scheduler/tokenizer metrics, retraction (SGLang's preemption), HiCache, DP ranks.

Facts: docs/engines.md §3. One record per (``engine_type``, ``dp_rank``). Scheduler series
carry ``tp_rank``/``pp_rank``/``moe_ep_rank``; SGLang reports only attention-TP rank 0 unless
``--enable-metrics-for-all-schedulers``, in which case the other ranks repeat the same batch and are
skipped here (counting them would multiply running/queued). Tokenizer-side series (token counters,
TTFT/ITL) have no ``dp_rank``: they are server-wide and go on the lowest DP rank's record only.
"""

from __future__ import annotations

from kvtop.adapters import (
    EngineAdapter,
    Keep,
    Labels,
    Page,
    Setting,
    as_int,
    finite_or_none,
    prefix_score,
    read_page,
)
from kvtop.model.records import EngineRecord

P = "sglang:"
_CORE = ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage")
_RANKS = ("tp_rank", "pp_rank", "moe_ep_rank")
_ITL = ("sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds")
_TTFT = "sglang:time_to_first_token_seconds"
_HISTS = (*_ITL, _TTFT, "sglang:e2e_request_latency_seconds", "sglang:queue_time_seconds")
# gauges copied to ``extra`` under a short name
_EXTRA_GAUGES = {
    "gen_throughput": "sglang:gen_throughput",
    "new_token_ratio": "sglang:new_token_ratio",
    "cache_hit_rate": "sglang:cache_hit_rate",
    "num_used_tokens": "sglang:num_used_tokens",
    "kv_used_tokens": "sglang:kv_used_tokens",
    "kv_available_tokens": "sglang:kv_available_tokens",
    "kv_evictable_tokens": "sglang:kv_evictable_tokens",
    "num_paused_reqs": "sglang:num_paused_reqs",
    "num_grammar_queue_reqs": "sglang:num_grammar_queue_reqs",
    "context_len": "sglang:context_len",
    "num_pages": "sglang:num_pages",
    "hicache_host_used_tokens": "sglang:hicache_host_used_tokens",
    "hicache_host_total_tokens": "sglang:hicache_host_total_tokens",
    "retracted_input_tokens_total": "sglang:num_retracted_input_tokens_total",
    "retracted_output_tokens_total": "sglang:num_retracted_output_tokens_total",
    # HiCache moves tokens, not bytes: bytes need the model's bytes/token (docs/kv-science.md §1)
    "offload_out_tokens_total": "sglang:evicted_tokens_total",
    "offload_in_tokens_total": "sglang:load_back_tokens_total",
}
ITL_NOTE = (
    "SGLang observes inter_token_latency once per generated token (interval / new tokens), "
    "vLLM once per request per engine step: never compare raw ITL counts across engines"
)
RETRACT_GAUGE_NOTE = (
    "this SGLang exports only the gauge sglang:num_retracted_reqs (retractions in the last decode "
    "interval), not the counter num_retracted_requests_total: preemptions_total is n/a; count "
    "retractions from the scheduler log (kvtop.sources.logs) instead"
)


def _rank_key(v: str) -> tuple[int, str]:
    try:
        return (int(v), v)
    except ValueError:
        return (1 << 30, v)


class SglangAdapter(EngineAdapter):
    name = "sglang"
    description = "SGLang (--enable-metrics); retraction counted as preemption"
    fields = frozenset(
        {
            "kv_usage", "running", "waiting", "preemptions_total", "prompt_tokens_total",
            "generation_tokens_total", "prefix_hits_total", "prefix_queries_total",
            "requests_finished_total", "requests_aborted_total", "kv_capacity_tokens", "block_size",
            "offload_out_seconds_total", "offload_in_seconds_total", "itl", "ttft", "model",
        }
    )
    preempts = True  # retraction: the victim's KV is freed and it is recomputed later
    preempt_counted_at = "retract"
    chunks_prefills = True  # --chunked-prefill-size defaults by GPU memory; -1 switches it off
    budget_in_blocks = True
    settings = {
        Setting.MAX_SEQS: "--max-running-requests",
        Setting.CHUNKED_PREFILL: "--chunked-prefill-size",
        Setting.BATCHED_TOKENS: "--chunked-prefill-size",
        Setting.MAX_PREFILL_TOKENS: "--max-prefill-tokens",
        Setting.MAX_TOTAL_TOKENS: "--max-total-tokens",
        Setting.GPU_MEMORY: "--mem-fraction-static",
        Setting.ADMISSION: "--schedule-conservativeness",
        Setting.OFFLOAD_ENABLE: "--enable-hierarchical-cache",
        Setting.OFFLOAD_SIZE: "--hicache-size",
        Setting.OFFLOAD_RATIO: "--hicache-ratio",
        Setting.CTX: "--context-length",  # bounds prompt + output of one request
    }
    host_tier = "sglang_hicache"
    # arg_groups/validation_hook.py: "chunked_prefill_size must be divisible by page_size"; both
    # settings are that one flag
    setting_notes = {
        **dict.fromkeys((Setting.BATCHED_TOKENS, Setting.CHUNKED_PREFILL),
                        "SGLang refuses a --chunked-prefill-size that is not a multiple of its --page-size"),
        # tokenizer_manager.py (validate_total_tokens): prompt + max_new_tokens over the bound is refused
        Setting.CTX: "SGLang rejects a request whose prompt + max_new_tokens exceed it: clients that ask for more "
                     "tokens than they received need that much more",
    }
    # its model card states the context length it serves, --context-length or the model's own
    # (python/sglang/srt/entrypoints/http_server.py, ``available_models``)
    limits_path = "/v1/models"

    @classmethod
    def detect(cls, metric_names: set[str]) -> float:
        return prefix_score(metric_names, P, _CORE)

    def parse(self, text: str, t: float) -> list[EngineRecord]:
        page = read_page(text, _CORE)
        page.warnings.extend(page.incomplete_histograms(_HISTS))
        return self._records(page, t)

    def _records(self, page: Page, t: float) -> list[EngineRecord]:
        names = [n for n in page.samples if n.startswith(P)]
        if not names:
            return [EngineRecord(t=t, adapter=self.name, warnings=[*page.warnings, "no sglang: metrics on the page"])]
        # The lowest ranks within each data-parallel group: the group's reporting scheduler. With
        # --enable-dp-attention a group's ranks are global (dp_rank = tp_rank // attention TP size,
        # data_parallel_controller.py), so DP rank 1 reports as tp_rank "1" or "4": the lowest ranks
        # over the whole page would drop every group but the first.
        labels = [lb for n in names for lb, _ in page.samples[n]]
        chosen: dict[str | None, dict[str, str]] = {}
        for lb in labels:
            group = chosen.setdefault(lb.get("dp_rank"), {})
            for r in _RANKS:
                if r in lb and (r not in group or _rank_key(lb[r]) < _rank_key(group[r])):
                    group[r] = lb[r]
        skipped: dict[str, list[str]] = {}
        for r in _RANKS:
            kept = {g[r] for g in chosen.values() if r in g}
            rest = sorted({lb[r] for lb in labels if r in lb} - kept, key=_rank_key)
            if rest:
                skipped[r] = rest

        def rank_ok(lb: Labels) -> bool:
            return all(lb.get(r, want) == want for r, want in chosen.get(lb.get("dp_rank"), {}).items())

        keys: dict[tuple[str | None, str | None], None] = {}
        for n in names:
            for lb, _ in page.samples[n]:
                if rank_ok(lb) and "model_name" in lb:  # skips helper series such as func_latency{name}
                    keys.setdefault((lb.get("engine_type"), lb.get("dp_rank")))
        # A key lacking dp_rank (or engine_type) is the tokenizer's server-wide view of engines
        # that do carry the label: not an engine of its own.
        typed = any(et is not None for et, _ in keys)
        ranked_types = {et for et, dp in keys if dp is not None}
        inst = [
            k for k in keys if not (k[0] is None and typed) and not (k[1] is None and k[0] in ranked_types)
        ] or [(None, None)]
        inst.sort(key=lambda k: (k[0] or "", _rank_key(k[1] or "0")))
        types = list(dict.fromkeys(et for et, _ in inst))
        primary_dp = {et: next(dp for e, dp in inst if e == et) for et in types}

        out = []
        for et, dp in inst:
            def keep(lb: Labels, et: str | None = et, dp: str | None = dp) -> bool:
                if not rank_ok(lb):
                    return False
                if "engine_type" in lb:
                    if lb["engine_type"] != et:
                        return False
                elif et != types[0]:
                    return False
                if "dp_rank" in lb:
                    return lb["dp_rank"] == dp
                return dp == primary_dp[et]

            rec = self._one(page, t, keep)
            if len(types) > 1:
                rec.engine = et if dp is None else f"{et}/{dp}"
            else:
                rec.engine = dp
            if et is not None:
                rec.extra["engine_type"] = et
            if dp is not None:
                rec.extra["dp_rank"] = dp
                if dp != primary_dp[et]:
                    rec.extra.setdefault("notes", []).append(
                        "server-wide tokenizer metrics (token counters, TTFT, ITL) are on dp_rank "
                        f"{primary_dp[et]}'s record"
                    )
            if skipped:
                rec.extra["ranks_skipped"] = skipped
            rec.warnings = list(page.warnings)
            out.append(rec)
        return out

    def _one(self, page: Page, t: float, keep: Keep) -> EngineRecord:
        rec = EngineRecord(t=t, adapter=self.name)
        notes: list[str] = []
        rec.running = page.value("sglang:num_running_reqs", keep)
        rec.waiting = page.value("sglang:num_queue_reqs", keep)
        rec.kv_usage = page.value(("sglang:token_usage", "sglang:full_token_usage"), keep)
        rec.prompt_tokens_total = page.value("sglang:prompt_tokens_total", keep)
        rec.generation_tokens_total = page.value("sglang:generation_tokens_total", keep)
        rec.requests_finished_total = page.value("sglang:num_requests_total", keep)
        rec.requests_aborted_total = page.value("sglang:num_aborted_requests_total", keep)

        rec.preemptions_total = page.value("sglang:num_retracted_requests_total", keep)
        gauge = page.value("sglang:num_retracted_reqs", keep)
        if gauge is not None:
            rec.extra["retracted_reqs_last_interval"] = gauge
            if rec.preemptions_total is None:
                notes.append(RETRACT_GAUGE_NOTE)

        # cached_tokens_total{cache_source}: "total" when exported, else the sum of the sources
        cached = page.value("sglang:cached_tokens_total", lambda lb: keep(lb) and lb.get("cache_source") == "total")
        if cached is None:
            cached = page.value("sglang:cached_tokens_total", keep)
        if cached is not None:
            rec.prefix_hits_total = cached
            rec.prefix_queries_total = rec.prompt_tokens_total  # prompt tokens include cached ones

        self._capacity(page, keep, rec, notes)

        for nm in _ITL:
            h = page.histogram(nm, keep)
            if h is not None:
                rec.itl = h
                rec.extra["itl_metric"] = nm
                rec.extra["itl_semantics"] = "per_token"
                notes.append(ITL_NOTE)
                break
        rec.ttft = page.histogram(_TTFT, keep)

        ev = page.histogram("sglang:eviction_duration_seconds", keep)
        lb_ = page.histogram("sglang:load_back_duration_seconds", keep)
        if ev is not None:
            rec.offload_out_seconds_total = ev.sum
        if lb_ is not None:
            rec.offload_in_seconds_total = lb_.sum
        for short, nm in _EXTRA_GAUGES.items():
            v = page.value(nm, keep)
            if v is not None:
                rec.extra[short] = v
        rec.model = page.first_label(("sglang:num_running_reqs", "sglang:token_usage", "sglang:prompt_tokens_total"),
                                "model_name", keep) or page.first_label(tuple(page.samples), "model_name", keep)
        if notes:
            rec.extra["notes"] = notes
        return rec

    @staticmethod
    def _capacity(page: Page, keep: Keep, rec: EngineRecord, notes: list[str]) -> None:
        page_size = page.value("sglang:page_size", keep)
        cap = page.value("sglang:max_total_num_tokens", keep)
        source = "sglang:max_total_num_tokens"
        if cap is None:
            pages = page.value("sglang:num_pages", keep)
            if pages is not None and page_size:
                cap, source = pages * page_size, "num_pages x page_size"
        if cap is None:
            # info gauge exported 2026-02..2026-05; its label set is not pinned down, read what is there
            info = [lb for lb, _ in page.samples.get("sglang:cache_config_info", ()) if keep(lb)]
            if info:
                for key in ("max_total_num_tokens", "max_total_tokens"):
                    try:
                        cap, source = finite_or_none(float(info[0][key])), "cache_config_info"
                        break
                    except (KeyError, ValueError):
                        continue
                if page_size is None:
                    try:
                        page_size = finite_or_none(float(info[0]["page_size"]))
                    except (KeyError, ValueError):
                        pass
        if cap is None and rec.kv_usage:
            used = page.value(("sglang:num_used_tokens", "sglang:kv_used_tokens"), keep)
            if used is not None:
                cap, source = used / rec.kv_usage, "estimate: num_used_tokens / token_usage"
                notes.append("KV capacity estimated from num_used_tokens / token_usage (token_usage is rounded)")
        if cap is not None:
            rec.kv_capacity_tokens = as_int(round(cap)) if finite_or_none(cap) is not None else None
            rec.extra["kv_capacity_source"] = source
        if page_size is not None:
            rec.block_size = as_int(page_size)
        if rec.kv_usage is None and rec.kv_capacity_tokens:
            used = page.value(("sglang:num_used_tokens", "sglang:kv_used_tokens"), keep)
            if used is not None:
                rec.kv_usage = used / rec.kv_capacity_tokens
