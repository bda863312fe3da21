"""Close the loop on the real vLLM: a recorded preemption storm, the advisor's own flags applied, the
same traffic replayed before and after, and `kvtop compare` says whether it got better.

The vLLM is the tier's tiny model on 1,056 KV token slots (testkit/engines/servers.py). The storm is
recorded through `kvtop record --proxy-listen`; `kvtop advise --trace --emit-flags` gives the flags;
`kvtop load --from` replays the recording against the engine as it was and against the engine
restarted with the flags. The prescription is judged as an operator would: the same offered load,
goodput at the 100 ms ITL contract (and at a 2 s TTFT as well), preemptions per completed request,
p99 ITL, and what the change cost outside the contract.
"""

from __future__ import annotations

import json
import time

import pytest

from kvtop.analysis.advice import chunking
from testkit.engines import servers, witness_workloads
from testkit.engines.kvtop_run import Recorder, read_trace
from testkit.engines.replay import advised, compare_pairs, measure, measure_on

pytestmark = pytest.mark.real_engine


@pytest.fixture(scope="module")
def loop(vllm_install, trace_dir) -> dict:
    py, model = vllm_install
    out: dict = {}
    src = trace_dir / "loop-source.jsonl"
    srv = servers.vllm_server(py, model)
    try:
        srv.start()
        with Recorder(src, srv.url) as rec:
            time.sleep(1.0)
            witness_workloads.storm(rec.proxy_url, servers.VLLM_MODEL_NAME)
            time.sleep(2.0)
            assert rec.stop() == 0, rec.stderr()
        out["flags"], _ = advised(src)
        before, out["replays"] = measure(src, srv.url, trace_dir, "loop", "before")
    finally:
        servers.cleanup(srv)
    after, spans = measure_on(servers.vllm_server(py, model, extra=tuple(out["flags"])), src, trace_dir, "loop", "after")
    out["replays"] += spans
    out["after_finish"] = [d for p in after for d in read_trace(p)
                           if d.get("kind") == "request" and d.get("event") == "finish"]
    # Judged on the ITL contract the storm broke (100 ms), and again with the TTFT an operator of this
    # interactive service would also hold it to: prompts of 46-79 tokens (their prefill is
    # milliseconds, so time to first token is all queueing), 600-token answers at 100 ms a token; a
    # user reading along waits for the first word about as long as for 20 words at that pace: 2 s,
    # the TTFT MLPerf Inference's Llama-2-70B server scenario pairs with a looser per-token target.
    for key, extra in (("compare", ()), ("compare_ttft", ("--ttft-target-ms", "2000"))):
        out[key] = compare_pairs(before, after, 100, trace_dir / f"loop-{key.replace('_', '-')}.json", *extra)
    return out


def test_the_advisor_prescribes_real_flags_for_the_storm(loop):
    """Eight ~679-token requests cannot share 1,056 KV slots: any admission limit queues them, so the
    advisor sizes the KV cache for the peak in flight instead (8 x 704 tokens in 32-token blocks x
    1,024 B per token, rounded up to whole MiB: 6 MiB), on the CPU host's available memory, and keeps a
    limit that admits the peak as a safety bound."""
    flags = loop["flags"]
    assert "--kv-cache-memory-bytes" in flags, flags
    kv = int(flags[flags.index("--kv-cache-memory-bytes") + 1])
    assert kv >= 8 * 679 * (servers.VLLM_KV_BYTES // 1056) > servers.VLLM_KV_BYTES
    if "--max-num-seqs" in flags:  # a safety bound that does not queue the eight
        n = int(flags[flags.index("--max-num-seqs") + 1])
        assert 8 <= n < servers.VLLM_MAX_NUM_SEQS
    if "--max-model-len" in flags:  # admits every recorded request (prompt + output)
        assert int(flags[flags.index("--max-model-len") + 1]) >= 67 + 600


def test_the_prescription_measured_better_on_the_same_traffic(loop):
    """What the prescription buys on this engine, measured on the same eight requests: with a KV cache
    that holds them all, no request is preempted and none waits in the engine's queue (an admission
    limit alone queued them: p99 TTFT 250 ms -> 13 s). Two runs (2026-12-02, this box shared by three
    builds): `improved` (p99 ITL 632 -> 158 ms, time over the 100 ms target 109 -> 7.8 s, p99 end-to-end
    54.4 -> 12.8 s, output 88 -> 371 tokens/s, p99 TTFT 658 -> 620 ms) and a `trade_off` on p99 TTFT
    alone, 489 -> 786 ms, with everything else better by as much. That TTFT is one prefill step: the
    eight arrive within 0.1 s and vLLM prefilled them in one step of 0.53-0.65 s (vLLM's own per-request
    TTFT), except in that run's `before`, where the client's arrival jitter split them into steps of
    0.21 and 0.25 s. So the outcome is `improved`, or a trade-off whose only worse figure is p99 TTFT
    while the engine queued no request. Goodput stayed 0 of 8 in both of those runs: with eight
    sequences in one batch the loaded CPU's decode step passed 100 ms now and then. On an otherwise
    idle box (two later runs) goodput went 0 -> 7 of 8, time over the target 57.5 -> 0.58 s and 43.7 ->
    0.17 s, with p99 TTFT +74 % and +17 % and, in one, p99 ITL 19 -> 24.1 ms (a batch of eight takes a
    longer step, still within the target): a trade-off at the ITL-only contract, improved with a 2 s
    TTFT target.

    Each configuration is replayed twice and `compare --also` pools the pairs. In one CI run (box
    otherwise idle) a single `after` replay lost 3.3 s over the target with p99 ITL 25.6 ms: a stall
    that held all eight streams at once, where preemptions stall one stream at a time. One such stall
    costs every request of a run its goodput (one request got through `before` by luck: "worse:
    goodput 1 -> 0 of 8"). A replay of this storm with the witness on (2026-12-02, five runs) showed
    the engine stepping every 7 ms or less through a 76 ms stall of every stream: such stalls are
    outside the engine's scheduler (see ``testkit.engines.replay.replay`` for one of the whole box)."""
    c = loop["compare"]
    t = loop["compare_ttft"]
    print("\n[real-engines] loop:", c.get("summary"), "| with a 2 s TTFT target:", t.get("summary"),
          "| flags", loop["flags"])
    print("[real-engines] replay arrival spans (s), before 1, 2 / after 1, 2, by try:", loop["replays"])
    a, b = c["a"], c["b"]
    print("[real-engines] before/after:", json.dumps(a)[:600], "\n", json.dumps(b)[:600])
    assert a["offered"] == b["offered"] == 16 and a["completed"] == b["completed"] == a["offered"], (a, b)
    # every measured replay prefilled prompts the engine had not seen (its own counters say so)
    assert max(a["prefix_hit_shares"] + b["prefix_hit_shares"]) < 0.05, (a, b)
    assert b["preemptions_per_completed"] == 0 < a["preemptions_per_completed"], (a, b)
    assert sum(b["over_target_s"].values()) < 0.5 * sum(a["over_target_s"].values()), (a, b)
    assert b["goodput"] >= a["goodput"] and t["b"]["goodput"] >= t["a"]["goodput"], (a, b)
    assert b["e2e_p99_s"] < a["e2e_p99_s"] and b["output_tokens_per_s"] > a["output_tokens_per_s"], (a, b)
    # vLLM's own per-request queue time (--enable-per-request-metrics): nobody waited for admission
    queued = [d["engine_queue_s"] for d in loop["after_finish"] if d.get("engine_queue_s") is not None]
    assert len(queued) == 16 and max(queued) < 0.05, queued
    assert c["outcome"] in ("improved", "trade_off"), c
    # what may get worse: the eight prompts prefilled in one step (p99 TTFT) and each decode step of a
    # batch of eight (p99 ITL 19 -> 24.1 ms in one run, within the target: goodput 0 -> 7 of 8); the
    # time over the target, asserted above, is what the contract pays for
    assert all(w.startswith(("p99 TTFT", "p99 ITL")) for w in c["worse"]), c["worse"]


# The prefill-interference loop: the tier's prefill server (16 MiB of KV: nothing is preempted) with a
# token budget that holds a whole 1,566-token prompt in one step, so every prompt stalls the decoding
# streams for one long step, and the batch limit vLLM gives a CPU server that sets none (128), above
# any budget that splits the prompts: vLLM refuses to start with --max-num-batched-tokens below
# --max-num-seqs, so a budget printed alone would not start the engine after the change. The
# recording runs kvtop's witness, which states the limits the engine runs under.
UNCHUNKED = ("--max-num-batched-tokens", "2048", "--max-num-seqs", "128")
# The contract the loop is judged at: 100 ms, or on a box whose engine prefills too slowly for the
# smallest round budget (64 tokens) to keep a step 10 % under it, the next of these that it can. A local
# CI run (2026-12-06) measured 559 and then 831 prompt tokens/s where the loop was written at 1,447: a
# 64-token chunk beside the 13 ms decode step took about 91 ms, and the advisor rightly prescribed no
# budget at 100 ms (disaggregate) on two recordings in a row.
TARGETS_MS = (100, 150, 200)


def test_the_engine_refuses_a_budget_below_its_batch_limit(vllm_install):
    """Why the prefill loop's prescription carries --max-num-seqs (the vLLM adapter's
    ``budget_holds_decodes``): this vLLM will not start with --max-num-batched-tokens 64 beside the
    --max-num-seqs 128 the loop's server runs; a vLLM that stops refusing fails here first."""
    py, model = vllm_install
    srv = servers.vllm_server(py, model, extra=UNCHUNKED + ("--max-num-batched-tokens", "64"))
    try:
        with pytest.raises(servers.EngineSetupError) as e:
            srv.start(timeout=180)
        assert "max_num_batched_tokens (64) must be greater than or equal to max_num_seqs (128)" in str(e.value)
    finally:
        servers.cleanup(srv)


@pytest.fixture(scope="module")
def prefill_loop(vllm_install, trace_dir) -> dict:
    py, model = vllm_install
    ps = witness_workloads.PREFILL_SERVER
    out: dict = {}
    src = trace_dir / "prefill-loop-source.jsonl"
    wfile = trace_dir / "prefill-loop-witness.jsonl"
    srv = servers.vllm_server(py, model, kv_bytes=ps["kv_bytes"], max_model_len=ps["max_model_len"], extra=UNCHUNKED,
                              witness=wfile)
    try:
        srv.start()
        # A recording made while the box was busy elsewhere is run once more: with one core taken by a
        # busy loop (by hand, 2026-12-03) 68 % of the decode gaps passed the 100 ms target, and the
        # advisor rightly said no budget meets it there (disaggregate, no flag). A second such
        # recording fails the test with that verdict.
        for attempt in range(2):
            # the second recording replaces the first (--force), with prompts the engine has not seen:
            # the first set sits in its prefix cache (1,500-token prompts then took 5-23 ms, no stall)
            with Recorder(src, srv.url, extra=("--force", "--witness", str(wfile))) as rec:
                time.sleep(1.0)
                witness_workloads.prefill_heavy(rec.proxy_url, servers.VLLM_MODEL_NAME, fresh=attempt)
                time.sleep(2.0)
                assert rec.stop() == 0, rec.stderr()
            out["flags"], out["verdict"] = advised(src, TARGETS_MS[0])
            if out["flags"]:
                break
        out["target_ms"] = TARGETS_MS[0]
        for target_ms in TARGETS_MS[1:]:
            if out["flags"]:
                break
            out["target_ms"] = target_ms
            out["flags"], out["verdict"] = advised(src, target_ms)
        print(f"\n[real-engines] prefill loop judged at {out['target_ms']} ms, flags {out['flags']}")
        before, out["replays"] = measure(src, srv.url, trace_dir, "prefill-loop", "before")
    finally:
        servers.cleanup(srv)
    after, spans = measure_on(servers.vllm_server(py, model, kv_bytes=ps["kv_bytes"], max_model_len=ps["max_model_len"],
                                                  extra=UNCHUNKED + tuple(out["flags"])),
                              src, trace_dir, "prefill-loop", "after")
    out["replays"] += spans
    out["compare"] = compare_pairs(before, after, out["target_ms"], trace_dir / "prefill-loop-compare.json")
    return out


def test_the_advisor_chunks_the_long_prompts(prefill_loop):
    """The recording's spikes are every decoding stream stalled while a whole prompt is prefilled (0.7-1.7 s
    steps against a 100 ms target); the advisor prescribes the largest round budget whose worst step,
    at the prefill rate the engine measured, stays 10 % under the target: one that splits each prompt."""
    v = prefill_loop["verdict"]
    assert v["action"] == "chunked_prefill", v["action"]
    flags = prefill_loop["flags"]
    assert flags[:1] == ["--max-num-batched-tokens"] and len(flags) in (2, 4), flags
    budget = int(flags[1])
    assert budget in chunking.LADDER and budget < 1498, budget  # the shortest long prompt is 1,498 tokens
    # the engine ran --max-num-seqs 128, as its witness said: a budget below it brings the batch limit
    # down with it (the engine restarted with both flags started: the fixture's `after` replays ran on
    # it), still above the most sequences the recording ran at once; a budget of 128 (a CI run whose
    # witness measured 2,153 tokens/s priced its step 67 ms) needs no such change and names none
    assert v["numbers"]["max_seqs_current"]["value"] == 128
    assert flags[2:] == (["--max-num-seqs", str(budget)] if budget < 128 else []), flags
    assert v["numbers"]["running_peak"]["value"] <= budget
    assert v["numbers"]["chunk_worst_step"]["value"] <= 0.9 * prefill_loop["target_ms"] / 1e3


def test_the_chunked_budget_measured_better_on_the_same_traffic(prefill_loop):
    """Two runs by hand (2026-12-03, box otherwise idle; budget 64 both times): goodput at the 100 ms
    ITL contract 16 -> 20 of 20, time over the target 11.8 s -> 0 and 15.4 s -> 0, p99 TTFT 1.19 s ->
    519 ms and 1.08 s -> 573 ms, p99 end-to-end 6.94 -> 4.67 s and 8.3 -> 4.96 s: `improved`.

    The advisor's stated price, TTFT +10 % (its cost model: each chunk re-reads the KV before it and
    pays a step), was not paid on this engine: vLLM's own TTFT of the 1,500-token prompts fell from
    0.68-1.05 s whole to 0.44-0.56 s in 64-token chunks, and the decoders' engine decode time from 8.1
    to 4.8 s. This CPU engine prefills a long prompt faster in small pieces (tests/fixtures/loop
    keeps one such run). A first tier run: `improved` too (goodput 16 -> 20, time over the target
    20.7 s -> 75 ms), with p99 ITL 34.4 -> 40.3 ms named worse: the stalls became many chunk steps,
    each a little longer than a decode step. So the outcome may be `improved`, or a trade-off whose
    worse figures are the TTFT the advisor named as the price and a p99 ITL still under the target."""
    c = prefill_loop["compare"]
    print("\n[real-engines] prefill loop:", c.get("summary"), "| flags", prefill_loop["flags"])
    print("[real-engines] prefill replay arrival spans (s), before 1, 2 / after 1, 2, by try:", prefill_loop["replays"])
    a, b = c["a"], c["b"]
    print("[real-engines] before/after:", json.dumps(a)[:600], "\n", json.dumps(b)[:600])
    assert a["offered"] == b["offered"] == 20 and a["completed"] == b["completed"] == 20, (a, b)
    assert max(a["prefix_hit_shares"] + b["prefix_hit_shares"]) < 0.05, (a, b)  # cold prefills only
    over_a, over_b = sum(a["over_target_s"].values()), sum(b["over_target_s"].values())
    # of the time over the target that the analysis gives an engine cause, most is the prefill the
    # budget addresses; a stall kvtop reads as the host hanging (its own scrape answered late, nothing
    # in the engine's times) is no engine setting's to fix: one CI run had a 0.83 s hang of every stream
    # a second into the first before-run, 2.9 s over the target of the 3.4 s there, with 0.5 s of prefill
    engine_a = over_a - a["over_target_s"].get("unknown", 0)
    assert a["over_target_s"].get("prefill_interference", 0) > 0.5 * engine_a > 0, a
    assert over_b < 0.5 * over_a, (a, b)
    assert b["goodput"] > a["goodput"], (a, b)
    assert b["preemptions_per_completed"] == 0, b
    assert c["outcome"] in ("improved", "trade_off"), c
    # what may get worse: the TTFT the advisor named as the price, and p99 ITL within the target (each
    # stall became ~25 steps of a 64-token chunk beside the decodes: 34.4 -> 40.3 ms in one tier run),
    # and the end-to-end latency by no more than the TTFT rose (a request's end waits for its first
    # token: the same price, once per request; a CI run 2026-12-07: TTFT 698 ms -> 1.4 s, end to end
    # 5.16 -> 5.69 s, +10 %)
    assert all(w.startswith(("p99 TTFT", "p99 ITL", "p99 end-to-end")) for w in c["worse"]), c["worse"]
    if any(w.startswith("p99 end-to-end") for w in c["worse"]):
        assert b["e2e_p99_s"] - a["e2e_p99_s"] <= b["ttft_p99_s"] - a["ttft_p99_s"], (a, b)
    # a p99 ITL that got worse stays within the target; one that improved is judged by the goodput and
    # the time over the target above (a CI run on a loaded box: 671 -> 100.23 ms, goodput 9 -> 18 of 20)
    if any(w.startswith("p99 ITL") for w in c["worse"]):
        assert b["itl_p99_s"] < prefill_loop["target_ms"] / 1e3, b
