"""Engine records in kvtop's trace format, written from the generator's own engine state.

The generator knows what each scrape's /metrics page says (``pages`` renders it), so it writes the
normalised record itself instead of asking kvtop's adapters to read the page: a trace that an
adapter helped write could not catch that adapter misreading a page. ``tests/test_tracegen.py``
checks that kvtop's vllm, sglang and tgi adapters read exactly these records from the rendered pages.

Field order and omissions follow the trace format (kvtop/schemas/trace.schema.json, ``engine``
lines): every field present, ``null`` where the page has no such series, ``warnings`` only when
there are some (a rendered page never has any), ``extra`` only when non-empty. The notes are the
ones a recording of these engine families carries.
"""

from __future__ import annotations

from typing import Any

from .pages import Cum, State

# the normalised fields of an engine line, in the trace's order (``extra`` follows)
FIELDS = ("t", "adapter", "url", "engine", "model", "up", "kv_usage", "running", "waiting", "preemptions_total",
          "prompt_tokens_total", "generation_tokens_total", "prefix_hits_total", "prefix_queries_total",
          "requests_finished_total", "requests_aborted_total", "kv_capacity_tokens", "block_size",
          "offload_capacity_bytes", "offload_out_bytes_total", "offload_in_bytes_total",
          "offload_out_seconds_total", "offload_in_seconds_total", "itl", "ttft", "restart_token", "version")

SGLANG_ITL_NOTE = ("SGLang observes inter_token_latency once per generated token (interval / new tokens), "
                   "vLLM once per request per engine step: never compare raw ITL counts across engines")
TGI_NO_PREEMPT_NOTE = "TGI never preempts a running request: KV pressure shows as tgi_queue_size and queue time"
TGI_ITL_NOTE = ("TGI exports a per-request MEAN time per output token (tgi_request_mean_time_per_token_duration), "
                "not inter-token gaps: its tail hides stalls; stalls are visible only per stream (proxy/probe)")


def histogram(h: Cum) -> dict[str, Any]:
    """A cumulative histogram as a trace holds it: (upper bound, cumulative count) with ``"+Inf"`` last."""
    buckets: list[list[Any]] = []
    acc = 0
    for b, c in zip(h.bounds, h.counts, strict=True):
        acc += c
        buckets.append([b, float(acc)])
    buckets.append(["+Inf", float(h.n)])
    return {"buckets": buckets, "count": float(h.n), "sum": h.total}


def _line(t: float, adapter: str, url: str, extra: dict[str, Any], **fields: Any) -> dict[str, Any]:
    d: dict[str, Any] = {"kind": "engine"}
    for f in FIELDS:
        d[f] = fields.get(f)
    d.update(t=t, adapter=adapter, url=url, up=True)
    if extra:
        d["extra"] = extra
    return d


def vllm_record(t: float, url: str, s: State, itl: Cum, ttft: Cum, npre: Cum, created: float) -> dict[str, Any]:
    """What ``vllm_page`` exposes: engine "0", finished = every ``finished_reason`` (abort included)."""
    extra = {"request_preemptions": {"count": float(npre.n), "sum": npre.total},
             "cache_config": {"cache_dtype": "auto", "enable_prefix_caching": "True",
                              "num_gpu_blocks": str(s.total_blocks)}}
    return _line(t, "vllm", url, extra, engine="0", model=s.model, kv_usage=s.used_blocks / s.total_blocks,
                 running=float(s.running), waiting=float(s.waiting), preemptions_total=float(s.preemptions),
                 prompt_tokens_total=float(s.prompt), generation_tokens_total=float(s.generation),
                 requests_finished_total=float(s.abort + s.length + s.stop), requests_aborted_total=float(s.abort),
                 kv_capacity_tokens=s.total_blocks * s.block, block_size=s.block, itl=histogram(itl),
                 ttft=histogram(ttft), restart_token=created)


def sglang_record(t: float, url: str, s: State, itl: Cum, ttft: Cum) -> dict[str, Any]:
    """What ``sglang_page`` exposes: retractions as preemptions, capacity from max_total_num_tokens."""
    extra = {"kv_capacity_source": "sglang:max_total_num_tokens", "itl_metric": "sglang:inter_token_latency_seconds",
             "itl_semantics": "per_token", "num_used_tokens": float(s.used_blocks * s.block),
             "notes": [SGLANG_ITL_NOTE]}
    return _line(t, "sglang", url, extra, model=s.model, kv_usage=s.used_blocks / s.total_blocks,
                 running=float(s.running), waiting=float(s.waiting), preemptions_total=float(s.preemptions),
                 prompt_tokens_total=float(s.prompt), generation_tokens_total=float(s.generation),
                 requests_finished_total=float(s.stop + s.length + s.abort), requests_aborted_total=float(s.abort),
                 kv_capacity_tokens=s.total_blocks * s.block, block_size=s.block, itl=histogram(itl),
                 ttft=histogram(ttft))


def tgi_record(t: float, url: str, s: State, itl: Cum) -> dict[str, Any]:
    """What ``tgi_page`` exposes: no model label, no KV usage (only the batch's token reservation)."""
    cap = s.total_blocks * s.block
    reserved = float(s.used_blocks * s.block)
    extra = {"batch_current_max_tokens": reserved, "batch_token_reservation": reserved / float(cap),
             "requests_total": float(s.stop + s.length + s.abort),
             "itl_metric": "tgi_request_mean_time_per_token_duration", "itl_semantics": "per_request_mean_tpot",
             "notes": [TGI_NO_PREEMPT_NOTE, TGI_ITL_NOTE]}
    return _line(t, "tgi", url, extra, running=float(s.running), waiting=float(s.waiting),
                 prompt_tokens_total=float(s.prompt), generation_tokens_total=float(s.generation),
                 requests_finished_total=float(s.stop + s.length), kv_capacity_tokens=cap, itl=histogram(itl))
