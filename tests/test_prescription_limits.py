"""Prescriptions the engine accepts, with the traffic it was seen serving (the engines' own checks).

Each case is a value kvtop printed that the engine refuses at start or that refuses requests the
trace saw: vLLM's SchedulerConfig (a budget below --max-model-len without chunked prefill, or below
--max-num-seqs), SGLang's page-size check of --chunked-prefill-size, TGI's router (a prefill budget
below --max-input-tokens without chunking), TensorRT-LLM's max_num_tokens without chunked context,
and a length bound below a request that was cancelled rather than finished."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

from conftest import flags, judge, run_kvtop

from kvtop.analysis.report import render_verdict_text
from kvtop.analysis.scan import analyze_trace
from kvtop.model.analysis import FlagSetting, Verdict

# docs/kv-science.md §12 S5: 12,000-token prompts beside a 96-sequence batch, a 22 ms decode step
S5 = {
    "name": "long prompts beside a busy batch", "engine": "vllm", "model": "llama-3.1-8b",
    "prefill": {"tokens_per_s": 25000, "k_att": 1.8781e-5}, "slo": {"itl_ms": 100},
    "observed": {"decode_step_ms": 22, "kv_usage": 0.65, "preemptions": 0, "running": 96},
    "traffic": {"long_prompt_tokens": 12000, "long_prompts_per_s": 0.5},
    "engine_settings": {},
}


def _s5(engine: str, **settings: object) -> dict:
    doc = copy.deepcopy(S5)
    doc["engine"] = engine
    doc["engine_settings"].update(settings)
    return doc


def test_a_budget_goes_out_with_chunking_where_the_engine_does_not_chunk():
    # vLLM with chunked prefill off refuses --max-num-batched-tokens 1024 below its --max-model-len
    v = judge(_s5("vllm", enable_chunked_prefill=False, max_model_len=16384))
    assert flags(v) == {"--max-num-batched-tokens": 1024, "--enable-chunked-prefill": True}
    # ... where it chunks (vLLM's default), the budget alone
    assert flags(judge(_s5("vllm"))) == {"--max-num-batched-tokens": 1024}
    assert flags(judge(_s5("vllm", enable_chunked_prefill=True))) == {"--max-num-batched-tokens": 1024}
    # TensorRT-LLM caps a prompt at max_num_tokens unless chunked context is on (off in config.pbtxt)
    t = judge(_s5("triton"))
    assert flags(t) == {"trtllm-build --max_num_tokens": 1024, "enable_chunked_context (config.pbtxt)": True}
    # TGI that does not chunk has no switch: a budget below its longest prompt is refused, so none
    g = judge(_s5("tgi", enable_chunked_prefill=False))
    assert flags(g) == {}
    assert any("no switch kvtop can set" in r and "--max-batch-prefill-tokens" in r for r in g["reasons"]), g["reasons"]


def test_sglang_budget_is_a_whole_number_of_pages():
    # SGLang refuses a --chunked-prefill-size its --page-size does not divide: with 128-token pages at
    # a 30 ms target only 64 tokens per step fitted, and no multiple of 128 does
    doc = _s5("sglang")
    doc["slo"]["itl_ms"] = 30
    assert flags(judge(doc)) == {"--chunked-prefill-size": 64}
    doc["capacity"] = {"block_size": 128}
    v = judge(doc)
    assert flags(v) == {} and v["action"] == "chunked_prefill" and "disaggregate" in v["also"]
    assert [r["budget"] for r in v["numbers"]["chunk_rows"]["value"]] == [4096, 3072, 2048, 1536, 1024, 768, 512,
                                                                           384, 256, 128]
    doc["slo"]["itl_ms"] = 100
    assert flags(judge(doc)) == {"--chunked-prefill-size": 1024}


def test_a_batch_limit_above_the_known_budget_is_not_given():
    # vLLM refuses --max-num-seqs 128 beside --max-num-batched-tokens 64, and the budget already holds
    # the batch to 64 sequences
    doc = {"name": "admission beside a small token budget", "engine": "vllm", "engine_version": "0.32.0",
           "model": "llama-3.1-8b", "slo": {"itl_ms": 100}, "cause": "preemption",
           "preemption": {"seq_tokens": 300, "per_completed": 0.5, "cancel_prob": 0},
           "capacity": {"kv_capacity_tokens": 40000, "block_size": 16},
           "traffic": {"prompt_mean": 200, "output_mean": 100, "output_p90": 150, "request_tokens_p90": 330,
                       "request_tokens_max": 600, "inflight_peak": 60},
           "observed": {"decode_step_ms": 10}, "engine_settings": {"max_num_batched_tokens": 64}}
    v = judge(doc)
    assert v["action"] == "admission" and "--max-num-seqs" not in flags(v)
    assert any("a limit of 128 sequences is not given" in r for r in v["reasons"]), v["reasons"]
    doc["engine_settings"]["max_num_batched_tokens"] = 256
    assert flags(judge(doc))["--max-num-seqs"] == 128


def test_the_fallback_budget_never_raises_a_smaller_one():
    doc = {"name": "prefill interference, sizes unknown", "engine": "vllm", "model": "llama-3.1-8b",
           "cause": "prefill_interference", "slo": {"itl_ms": 100}, "observed": {"spikes": 50},
           "engine_settings": {"max_num_batched_tokens": 512}}
    v = judge(doc)
    assert "--max-num-batched-tokens" not in flags(v)  # was 2048 under "lower the budget"
    assert any("already 512" in r for r in v["reasons"])
    doc["engine_settings"]["max_num_batched_tokens"] = 8192
    assert flags(judge(doc)) == {"--max-num-batched-tokens": 2048}


def test_a_prompt_longer_than_the_ladder_is_not_said_to_fit_one_step():
    doc = {"name": "queue behind budget, 30k prompts", "engine": "vllm", "model": "llama-3.1-8b",
           "cause": "prefill_interference", "prefill": {"tokens_per_s": 25000, "k_att": 1.8781e-5},
           "slo": {"itl_ms": 100},
           "observed": {"decode_step_ms": 22, "running": 8, "engine_queue_p90_ms": 20000, "preemptions": 0,
                        "completed": 100},
           "traffic": {"long_prompt_tokens": 30000, "long_prompts_per_s": 0.1},
           "engine_settings": {"max_num_batched_tokens": 2048}}
    v = judge(doc)
    (s,) = v["settings"]
    assert s["value"] == 16384 and "in 2 steps" in s["why"] and "one step holds" not in s["why"]


def test_a_switch_reads_as_the_command_line_takes_it():
    # `--enable-hierarchical-cache True` is an unrecognised argument to SGLang's store_true flag
    v = Verdict("swap", settings=(FlagSetting("offload_enable", "--enable-hierarchical-cache", True, "why"),
                                  FlagSetting("offload_size", "--hicache-size", 3, "size"),
                                  FlagSetting("chunked_prefill", "enable_chunked_context (config.pbtxt)", True)))
    text = render_verdict_text(v)
    assert "settings: --enable-hierarchical-cache  --hicache-size 3  enable_chunked_context (config.pbtxt) true" in text
    assert "True" not in text


def test_the_length_bound_holds_requests_that_were_cancelled(tmp_path: Path):
    # a 7,000-token prompt whose client gave up during the storm: --max-model-len 4864 would now
    # refuse it ("Input length (7000) exceeds model's maximum context length")
    trace = tmp_path / "storm.jsonl"
    assert run_kvtop("simulate", "--preset", "preemption-storm", "--seed", "1", "--duration", "40",
                     "-o", str(trace)).returncode == 0
    before = flags(analyze_trace(str(trace)).verdict.to_dict())["--max-model-len"]
    lines = trace.read_text().splitlines()
    t = json.loads(lines[len(lines) // 2])["t"]
    with trace.open("a") as f:
        f.write(json.dumps({"kind": "request", "t": t, "id": "long-1", "event": "arrive", "prompt_tokens": 7000}) + "\n")
        f.write(json.dumps({"kind": "request", "t": t + 1.5, "id": "long-1", "event": "cancel"}) + "\n")
    after = flags(analyze_trace(str(trace)).verdict.to_dict())["--max-model-len"]
    assert before < 7000 and after == math.ceil(7000 / 256) * 256
