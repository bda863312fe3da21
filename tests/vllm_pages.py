"""Pages derived from the real vLLM 0.32.0 capture with chosen counter values (for rates/quantiles).

Every edit replaces one exact sample line of the capture; a missing line fails loudly, so the
helpers cannot silently produce an unchanged page.
"""

from __future__ import annotations

import re

from conftest import fixture_text

BASE = "vllm-0.32.0-cpu-live-idle.prom"
LB = 'engine="0",model_name="tiny-llama"'
ITL_BOUNDS = ("0.01", "0.025", "0.05", "0.075", "0.1", "0.15", "0.2", "0.3", "0.4", "0.5", "0.75", "1.0",
              "2.5", "5.0", "7.5", "10.0", "20.0", "40.0", "80.0", "+Inf")


def _set(text: str, series: str, value: float) -> str:
    pat = re.compile("^" + re.escape(series) + r" \S+$", re.M)
    new, n = pat.subn(f"{series} {float(value)!r}", text)
    assert n == 1, f"{series}: {n} matches"
    return new


def vllm_page(
    *,
    preemptions: float = 0,
    prompt: float = 0,
    generation: float = 0,
    kv: float = 0.0,
    running: float = 0,
    waiting: float = 0,
    itl: dict[str, float] | None = None,
    created: float | None = None,
) -> str:
    """The capture with these values. ``itl`` maps an upper bound to the *per-bucket* count
    (not cumulative); the helper writes the cumulative buckets, ``_count`` and ``_sum``."""
    t = fixture_text(BASE)
    t = _set(t, f"vllm:num_preemptions_total{{{LB}}}", preemptions)
    t = _set(t, f"vllm:prompt_tokens_total{{{LB}}}", prompt)
    t = _set(t, f"vllm:generation_tokens_total{{{LB}}}", generation)
    t = _set(t, f"vllm:kv_cache_usage_perc{{{LB}}}", kv)
    t = _set(t, f"vllm:num_requests_running{{{LB}}}", running)
    t = _set(t, f"vllm:num_requests_waiting{{{LB}}}", waiting)
    if itl:
        cum = 0.0
        total = 0.0
        for le in ITL_BOUNDS:
            n = itl.get(le, 0.0)
            cum += n
            if le != "+Inf":
                total += n * float(le)
            t = _set(t, f'vllm:inter_token_latency_seconds_bucket{{engine="0",le="{le}",model_name="tiny-llama"}}', cum)
        t = _set(t, f"vllm:inter_token_latency_seconds_count{{{LB}}}", cum)
        t = _set(t, f"vllm:inter_token_latency_seconds_sum{{{LB}}}", total)
    if created is not None:
        t = _set(t, f"vllm:prompt_tokens_created{{{LB}}}", created)
    return t
