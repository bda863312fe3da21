"""The verdict's gates on analyze's own inputs: weighing by lost time, and churn from counters alone."""

from __future__ import annotations

import pytest

from kvtop.analysis.analyzer import Analyzer
from kvtop.analysis.report import build_report, render_verdict_text

STEP = 0.02


def _run(recs, **kw):
    an = Analyzer(**kw)
    an.set_header({"engine": {"adapter": "vllm", "model": "meta-llama/Llama-3.1-8B-Instruct"}})
    for d in sorted(recs, key=lambda d: d["t"]):
        an.feed_dict(d)
    an.finish()
    return an


def _storm_scrapes(dur=60, pre_per_s=0.53, done_per_s=0.24, kv=1.0, waiting=3):
    """Engine scrapes once a second, the counters of the issue-12 storm (no request records)."""
    out = []
    for i in range(dur + 1):
        out.append({"kind": "engine", "t": float(i), "adapter": "vllm", "url": "u", "engine": "0",
                    "kv_usage": kv, "running": 8, "waiting": waiting,
                    "preemptions_total": round(pre_per_s * i), "requests_finished_total": round(done_per_s * i),
                    "prompt_tokens_total": 900.0 * i})
    return out


def test_counters_alone_say_admission_with_an_honest_confidence():
    """60 s at 0.53 preemptions/s and 0.24 completions/s: 32 / 14 = 2.29 preemptions per completed
    request (> 0.05), KV at 1.0 and 3 waiting: churn, so admission, without one request record."""
    rep = build_report(_run(_storm_scrapes()))
    v = rep["verdict"]
    assert rep["basis"] == "aggregate"
    assert v["numbers"]["preemptions_per_completed"]["value"] == pytest.approx(32 / 14, rel=1e-3)
    assert v["action"] == "admission"
    gates = [d["gate"] for d in v["numbers"]["decided_by"]["value"]]
    assert gates[0] == "churn_counters" and "admission" in gates
    # below what per-request timings give, above a guess
    assert 0.4 <= v["confidence"] <= 0.75
    text = render_verdict_text(v)
    hint = next(line for line in text.splitlines() if "per-request evidence" in line)
    assert "--probe RATE" in hint and "--capture" in hint and "--proxy-listen" in hint


@pytest.mark.parametrize("kw", [dict(pre_per_s=0.0), dict(kv=0.5, waiting=0), dict(pre_per_s=0.005, done_per_s=0.24)])
def test_no_churn_no_admission_from_counters(kw):
    """No preemptions; or preemptions with KV half empty and nobody waiting; or 0.3 preemptions over 14
    completions (0.02 per completed request, under 0.05): the counters do not support admission."""
    v = build_report(_run(_storm_scrapes(**kw)))["verdict"]
    assert v["action"] != "admission"


def _tokens(n_streams, dur, silent):
    recs = []
    for i in range(n_streams):
        rid = f"r{i}"
        recs.append({"kind": "request", "t": 0.0, "id": rid, "event": "arrive", "prompt_tokens": 500})
        recs.append({"kind": "request", "t": 0.05, "id": rid, "event": "first_token", "n": 1})
    k = 1
    while 0.05 + k * STEP <= dur:
        t = round(0.05 + k * STEP, 6)
        for i in range(n_streams):
            rid = f"r{i}"
            if any(a < t < b for a, b in silent.get(rid, ())):
                continue
            recs.append({"kind": "request", "t": t, "id": rid, "event": "token", "n": 1})
        k += 1
    return recs


def test_verdict_weighs_time_over_target_not_spike_counts():
    """Two 3 s preemption stalls (counter steps at their ends, KV full) against many short lone gaps.

    Each 3 s stall costs 3 − 0.1 = 2.9 s over a 100 ms target: 5.8 s. Twelve 0.2 s gaps cost
    0.1 s each: 1.2 s. By count preemption would be 2 of 14 spikes (14 %); by time it is
    5.8 / 7.0 = 83 %, so the verdict treats preemption, whatever the short gaps are called.
    """
    silent = {"r0": [(5.0, 8.0)], "r1": [(20.0, 23.0)]}
    for j in range(12):
        silent.setdefault(f"r{2 + j % 6}", []).append((30.0 + j * 2.0, 30.2 + j * 2.0))
    recs = _tokens(8, 60.0, silent)
    pre = 0
    for i in range(61):
        t = i + 0.5
        pre += (t == 8.5) + (t == 23.5)
        full = 4 <= t <= 9 or 19 <= t <= 24  # KV full only around the two preemptions
        recs.append({"kind": "engine", "t": t, "adapter": "vllm", "url": "u", "engine": "0",
                     "kv_usage": 0.97 if full else 0.5, "running": 8 - full, "waiting": int(full), "preemptions_total": float(pre), "requests_finished_total": 0.0,
                     "prompt_tokens_total": 4000.0 + 10 * i})
    rep = build_report(_run(recs, itl_target_s=0.1))
    v = rep["verdict"]
    pre_n = rep["causes"]["preemption"]["count"]
    assert pre_n == 2 and rep["spikes_total"] == 14
    assert v["action"] in ("swap", "recompute", "admission")  # counting spikes said insufficient_data
    lost = v["numbers"]["lost_s_preemption"]["value"]
    assert lost == pytest.approx(5.8, abs=0.1)
    assert next(d for d in v["numbers"]["decided_by"]["value"] if d["gate"] == "cause_weight")["detail"].count(
        "preemption explains")
