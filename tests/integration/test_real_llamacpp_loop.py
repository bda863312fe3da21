"""Close the loop on the real llama.cpp: long prompts prefilled in the batch of three decoding slots,
the advisor's `--batch-size` applied, the same traffic replayed before and after, and `kvtop compare`
says whether it got better.

llama-server puts every generating slot's token in the `--batch-size` batch first and fills the rest
with prompt tokens (docs/engines.md §5.2), so a batch smaller than a prompt splits its prefill across
several decode steps, as vLLM's token budget does. The prescription is judged as the vLLM loops judge
theirs (tests/integration/test_real_vllm_loop.py): the same offered load, goodput at the ITL contract
the recording was advised at, and what the change cost outside it.
"""

from __future__ import annotations

import json
import time

import pytest

from testkit.engines import load, servers, witness_workloads
from testkit.engines.kvtop_run import Recorder
from testkit.engines.replay import advised, compare_pairs, measure, measure_on

pytestmark = pytest.mark.real_engine

MODEL = "gemma-3-270m"
# 4 slots of 2,048 tokens: three decode while prompts of 700-1,500 tokens take the fourth one at a
# time; lengths apart, so the engine's own times show how a prompt's later positions raise its cost
CTX, SLOTS = 8192, 4
LONG_PROMPTS = (700, 1100, 1500)
# One replay a side (the vLLM loops pool two): the change moves goodput by half the requests, far
# beyond what one replay's noise moves, and the tier's time is CI's
REPLAYS = 1
DECODE_TOKENS = 300  # the decoders outlast the prompts' prefills, one after another on the free slot
# The contract the loop is judged at: the tightest of these at which the advisor finds a batch whose
# chunk steps stay 10 % under it. This CPU engine's 64-token step beside 50 ms decode steps takes
# 0.25-0.35 s by its own ``timings``: no batch meets 100-200 ms, and the advisor says so
# (disaggregate) rather than print one
TARGETS_MS = (100, 200, 300, 400, 500)


@pytest.fixture(scope="module")
def batch_loop(llamacpp_install, trace_dir) -> dict:
    binary, model = llamacpp_install
    out: dict = {}
    src = trace_dir / "llamacpp-loop-source.jsonl"
    srv = servers.llama_server(binary, model, ctx=CTX, parallel=SLOTS)
    try:
        srv.start(timeout=120)
        load.drive(srv.url, MODEL, SLOTS, 8, seed=99)  # a fresh slot's first request is ~1 s slower
        # each its own first words: a slot reuses the longest prefix it holds (llama.cpp's prompt cache)
        texts = [f"Document {k}: {load.llama_prompt_of(srv.url, n)[0]}" for k, n in enumerate(LONG_PROMPTS)]
        with Recorder(src, srv.url) as rec:
            time.sleep(1.0)
            witness_workloads.prompts_beside_decoders(rec.proxy_url, MODEL, texts, decoders=SLOTS - 1,
                                                      decode_tokens=DECODE_TOKENS)
            time.sleep(2.0)
            assert rec.stop() == 0, rec.stderr()
        for target_ms in TARGETS_MS:
            out["target_ms"] = target_ms
            out["flags"], out["verdict"] = advised(src, target_ms)
            if out["flags"]:
                break
        print(f"\n[real-engines] llama.cpp loop judged at {out['target_ms']} ms, flags {out['flags']}")
        before, out["replays"] = measure(src, srv.url, trace_dir, "llamacpp-loop", "before", REPLAYS)
    finally:
        servers.cleanup(srv)
    after, spans = measure_on(servers.llama_server(binary, model, ctx=CTX, parallel=SLOTS, extra=tuple(out["flags"])),
                              src, trace_dir, "llamacpp-loop", "after", REPLAYS, timeout=120)
    out["replays"] += spans
    out["compare"] = compare_pairs(before, after, out["target_ms"], trace_dir / "llamacpp-loop-compare.json")
    return out


def test_the_advisor_splits_the_prompts_with_the_batch(batch_loop):
    """A batch that splits each prompt and holds the decoding slots' tokens, whose chunk step at the
    prefill rate the engine's own ``timings`` gave stays 10 % under the contract."""
    v = batch_loop["verdict"]
    assert v["action"] == "chunked_prefill", v["action"]
    flags = batch_loop["flags"]
    assert flags[:1] == ["--batch-size"] and len(flags) == 2, flags
    # a batch that splits the ~1,500-token prompts and holds the decoding slots' tokens
    assert SLOTS <= int(flags[1]) < 1400, flags
    rate, k_att = v["numbers"]["prefill_rate"], v["numbers"]["k_att"]
    # llama.cpp's timings, not the stalls; prompts of several lengths: a fit, not the median. Its
    # attention term is measured where the six requests resolve it (two runs of three: in the third
    # the per-token time fell with length, 3.4 -> 2.65 ms, and the assumed 8B-class figure stood)
    assert "fitted to the engine's own TTFT" in rate["note"], rate
    print(f"\n[real-engines] llama.cpp prefill: {rate['value']:.0f} tokens/s at a prompt's start, "
          f"k_att {k_att['value']:.3g} ({k_att['source']})")
    assert v["numbers"]["chunk_worst_step"]["value"] <= 0.9 * batch_loop["target_ms"] / 1e3


def test_the_batch_measured_better_on_the_same_traffic(batch_loop):
    """Two runs (2026-12-06, one replay a side, box otherwise idle): llama.cpp's timings fitted
    489 tokens/s at a prompt's start and k_att 2.0e-4; `--batch-size 64` at 300 ms, priced 253 ms,
    the engine's p99 ITL 304 ms (1.20x): goodput 3 -> 6 of 6, time over the target 23.6 s -> 0.08 s,
    p99 TTFT +78 % (the price the advisor named; the prompts take the one free slot in turn, so each
    also waits longer for the one before it). The second run's fit (502 tokens/s, k_att 4.7e-4) priced
    the step 348 ms and judged at 400 ms; p99 ITL 298 ms (0.86x), goodput 3 -> 6 of 6. In a third
    (CI's, box loaded) the fit could not resolve the attention term, the 8B-class k_att stood, the
    step was priced 227 ms at 300 ms and took 304 ms (1.34x): goodput 3 -> 6 of 6; a fourth: k_att
    1.4e-4, priced 224 ms, took 316 ms (1.41x). With prompts of
    one length (no fit, the 8B-class k_att assumed where llama.cpp names no model) the step ran
    1.01-1.47x its price, once missing a 300 ms target by 85 ms; before the engine's own times were
    read, the stalls' rate (968 tokens/s, where llama-server had split each prompt over two steps) gave
    `--batch-size 64` at 150 ms for a 127 ms step that took 190-400 ms. The fit rests on six requests
    and moves between runs, so the loop asserts what held in every run: the time over the target at
    least halved, the p99 ITL cut, the step the engine took within 1.6x the advisor's price, and
    nothing worse but what a longer prefill costs."""
    c = batch_loop["compare"]
    v = batch_loop["verdict"]
    print("\n[real-engines] llama.cpp loop:", c.get("summary"), "| flags", batch_loop["flags"])
    print("[real-engines] llama.cpp replay arrival spans (s), before / after, by try:", batch_loop["replays"])
    a, b = c["a"], c["b"]
    print("[real-engines] before/after:", json.dumps(a)[:600], "\n", json.dumps(b)[:600])
    n = REPLAYS * (SLOTS - 1 + len(LONG_PROMPTS))
    assert a["offered"] == b["offered"] == n and a["completed"] == b["completed"] == n, (a, b)
    over_a, over_b = sum(a["over_target_s"].values()), sum(b["over_target_s"].values())
    assert over_b < 0.5 * over_a, (a, b)
    assert b["itl_p99_s"] < 0.5 * a["itl_p99_s"], (a, b)
    assert b["goodput"] >= a["goodput"], (a, b)
    # the step the engine took, against the one the advisor priced
    priced = v["numbers"]["chunk_worst_step"]["value"]
    print(f"[real-engines] llama.cpp chunk step priced {priced * 1e3:.0f} ms, p99 ITL after {b['itl_p99_s'] * 1e3:.0f} ms")
    assert b["itl_p99_s"] <= 1.6 * priced, (priced, b)
    assert c["outcome"] in ("improved", "trade_off"), c
    # what may get worse: the TTFT the advisor named as the price, and what a longer prefill adds to
    # the streams that decode through it and to the run's throughput
    assert all(w.startswith(("p99 TTFT", "p99 end-to-end", "output throughput")) for w in c["worse"]), c["worse"]
