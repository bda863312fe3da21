"""llama.cpp ``llama-server`` adapter (``--metrics``), with KV usage from ``GET /slots``.

Facts: docs/engines.md §5 and docs/real-engines.md. Quirks that shape this adapter:

* ``tokens_predicted_total`` / ``prompt_tokens_total`` move only when a request **finishes**, so a
  rate from them lags and comes in bursts; ``n_decode_total`` (``llama_decode()`` calls) moves live
  and is kept in ``extra`` for a live decode-step rate.
* ``prompt_tokens_seconds`` / ``predicted_tokens_seconds`` reset on every scrape (two scrapers steal
  each other's readings): never read.
* No KV metric (``kv_cache_usage_ratio`` was removed in 2025): usage = tokens held by processing
  slots / sum of the slots' ``n_ctx``, from ``/slots``.
* No preemption: a request that finds no free slot is deferred (``requests_deferred``); when a
  unified KV cache runs out, active streams end with an ``error`` event "Context size has been
  exceeded." — the proxy records those as request errors; no metric counts them.
* The restart token is the ``Process-Start-Time-Unix`` response header, which ``parse`` does not
  see (and which is not a Unix time): counter drops still reveal restarts.
"""

from __future__ import annotations

import json
from typing import Any

from kvtop.adapters import EngineAdapter, Page, Setting, as_int, counter_names, prefix_score, read_page
from kvtop.model.records import EngineRecord

P = "llamacpp:"
_CORE = ("llamacpp:requests_processing", "llamacpp:requests_deferred")
_EXTRA = {
    "n_decode_total": "llamacpp:n_decode_total",
    "n_busy_slots_per_decode": "llamacpp:n_busy_slots_per_decode",
    "n_tokens_max": "llamacpp:n_tokens_max",
    "prompt_seconds_total": "llamacpp:prompt_seconds_total",
    "tokens_predicted_seconds_total": "llamacpp:tokens_predicted_seconds_total",
    # removed upstream in 2025 (PR #13660); forks still export them: shown, never used as kv_usage
    "legacy_kv_cache_usage_ratio": "llamacpp:kv_cache_usage_ratio",
    "legacy_kv_cache_tokens": "llamacpp:kv_cache_tokens",
}
COUNTER_NOTE = (
    "llama.cpp token counters move only when a request finishes: token rates lag and burst; "
    "n_decode_total (llama_decode() calls, live) x n_busy_slots_per_decode approximates live decode tokens"
)
NO_PREEMPT_NOTE = (
    "llama.cpp never preempts: without a free slot a request is deferred (waiting); an exhausted "
    "unified KV cache aborts active streams with 'Context size has been exceeded.' (request errors)"
)


def _int(v: object) -> int | None:
    # JSON numbers only: "12" in /slots is a shape error, not a count
    return as_int(v) if isinstance(v, (int, float)) else None


class LlamaCppAdapter(EngineAdapter):
    name = "llamacpp"
    description = "llama.cpp llama-server (--metrics; KV usage from /slots; never preempts)"
    fields = frozenset(
        {
            "kv_usage", "running", "waiting", "prompt_tokens_total", "generation_tokens_total",
            "prefix_hits_total", "prefix_queries_total", "kv_capacity_tokens",
        }
    )
    preempts = False
    # update_slots() puts every generating slot's sampled token into the batch first and fills the
    # rest of --batch-size with prompt tokens (tools/server/server-context.cpp); the tier's build
    # aborts at start with --batch-size below --parallel (GGML_ASSERT n_outputs_max)
    budget_holds_decodes = True
    chunks_prefills = True  # a prompt longer than --batch-size is decoded in batches of it
    extra_paths = ("/slots",)
    settings = {
        Setting.PARALLEL: "--parallel",
        Setting.CTX: "-c",
        Setting.MAX_SEQS: "--parallel",
        Setting.BATCHED_TOKENS: "--batch-size",
        Setting.UBATCH: "--ubatch-size",
        Setting.KV_UNIFIED: "--kv-unified",
        Setting.CONTEXT_SHIFT: "--context-shift",
        Setting.CACHE_TYPE: "--cache-type-k / --cache-type-v",
        Setting.MAX_TOKENS: "n_predict (request) / --n-predict",
    }

    @classmethod
    def detect(cls, metric_names: set[str]) -> float:
        return prefix_score(metric_names, P, _CORE)

    def parse(self, text: str, t: float) -> list[EngineRecord]:
        return [self._record(read_page(text, _CORE), t)]

    def _record(self, page: Page, t: float) -> EngineRecord:
        rec = EngineRecord(t=t, adapter=self.name, warnings=list(page.warnings))
        if not any(n.startswith(P) for n in page.samples):
            rec.warnings.append("no llamacpp: metrics on the page")
            return rec
        rec.running = page.value("llamacpp:requests_processing")
        rec.waiting = page.value("llamacpp:requests_deferred")
        rec.prompt_tokens_total = page.value("llamacpp:prompt_tokens_total")
        rec.generation_tokens_total = page.value("llamacpp:tokens_predicted_total")
        cached = page.value("llamacpp:prompt_tokens_cached_total")
        if cached is not None:
            # prompt_tokens_total excludes cache-reused tokens: queries = computed + reused
            rec.prefix_hits_total = cached
            if rec.prompt_tokens_total is not None:
                rec.prefix_queries_total = rec.prompt_tokens_total + cached
        for short, base in _EXTRA.items():
            v = page.value(counter_names(base))
            if v is not None:
                rec.extra[short] = v
        rec.extra["notes"] = [COUNTER_NOTE, NO_PREEMPT_NOTE]
        return rec

    def parse_extra(self, path: str, body: str, records: list[EngineRecord]) -> None:
        if path != "/slots":
            return
        for rec in records:
            self._slots(body, rec)

    @staticmethod
    def _slots(body: str, rec: EngineRecord) -> None:
        try:
            data = json.loads(body)
        except ValueError:
            rec.warnings.append("/slots: not JSON (truncated?); kv_usage n/a")
            return
        if isinstance(data, dict) and "error" in data:
            err = data["error"]
            msg = err.get("message") if isinstance(err, dict) else err
            rec.warnings.append(f"/slots unavailable ({str(msg)[:80]}); kv_usage n/a (server started with --no-slots?)")
            return
        if not isinstance(data, list):
            rec.warnings.append("/slots: unexpected shape; kv_usage n/a")
            return
        n_ctx: list[int] = []
        held = decoded = idle_cached = processing = unknown = bad = 0
        for s in data:
            ctx = _int(s.get("n_ctx")) if isinstance(s, dict) else None
            if ctx is None:
                bad += 1
                continue
            n_ctx.append(ctx)
            # next_token is an array of one object in real output, a bare object in the README
            nt = s.get("next_token")
            nt = nt[0] if isinstance(nt, list) and nt else nt
            n_dec = _int(nt.get("n_decoded")) if isinstance(nt, dict) else None
            # n_prompt_tokens = the slot's cached token list: prompt plus tokens generated so far
            n_tok = _int(s.get("n_prompt_tokens"))
            if s.get("is_processing"):
                processing += 1
                decoded += n_dec or 0
                if n_tok is None:
                    unknown += 1
                else:
                    held += n_tok
            elif n_tok is not None:
                idle_cached += n_tok  # reusable prefix of a finished task, freed on demand
        if bad:
            rec.warnings.append(f"/slots: {bad} slot(s) without n_ctx skipped")
        cap = sum(n_ctx)
        info: dict[str, Any] = {"n_slots": len(n_ctx), "processing": processing}
        if n_ctx:
            info["n_ctx_per_slot"] = n_ctx[0] if len(set(n_ctx)) == 1 else n_ctx
        info["decoded_tokens"] = decoded
        if idle_cached:
            info["idle_cached_tokens"] = idle_cached
        rec.extra["slots"] = info
        if n_ctx:
            rec.limits["max_num_seqs"] = len(n_ctx)  # one slot per --parallel
        # A unified KV cache (--kv-unified; llama-server's default when --parallel is not given)
        # shows every slot the whole context: 4 slots of 8192 may be 8192 tokens shared or 4 x 8192.
        # Nothing on /slots, /props or /metrics says which; slots holding more than one slot's n_ctx
        # between them prove the split.
        shared = len(n_ctx) > 1 and len(set(n_ctx)) == 1 and held <= n_ctx[0]
        if shared:
            cap = 0
            info["kv_layout"] = "unknown"
        else:
            info["n_ctx_total"] = cap
        if unknown:
            rec.extra.setdefault("notes", []).append(
                "this llama-server's /slots lacks n_prompt_tokens for processing slots: kv_usage n/a"
            )
        elif shared:
            info["held_tokens"] = held
            c, n = n_ctx[0], len(n_ctx)
            info["kv_usage_if_unified"] = held / c
            info["kv_usage_if_split"] = held / (n * c)
            rec.warnings.append(
                f"llama-server does not say whether its {n} slots share one KV cache of {c} tokens (--kv-unified, "
                f"its default without --parallel) or hold {c} each ({n * c} in all): KV usage is "
                f"{held / c:.0%} if shared, {held / (n * c):.0%} if split; kv_usage n/a")
        elif cap:
            info["held_tokens"] = held
            rec.kv_usage = held / cap
        if cap:
            rec.kv_capacity_tokens = cap
