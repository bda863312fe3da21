"""A token budget vLLM accepts with the batch it runs (docs/kv-science.md §9).

vLLM V1 takes every token a step schedules out of ``--max-num-batched-tokens``, each running
sequence's decode token first, and refuses to start with a ``--max-num-seqs`` above the budget (where
none is given it lowers its default to it). So a chunk gets the budget less the decodes beside it, a
budget below the batch the engine ran would cap that batch, and a budget printed for a server whose
batch limit is larger must come with that limit lowered. The witness states the limits the engine
runs under; the simulator refuses the pair vLLM refuses."""

from __future__ import annotations

import copy
import gzip
import json
from pathlib import Path

import pytest
from conftest import REPO, flags, judge, run_kvtop

from kvtop.model.records import to_dict
from kvtop.sim.flags import apply_engine_flags
from kvtop.sim.workload import WorkloadError, load_preset
from kvtop.sources.witness import WitnessReader
from kvtop.witness.steplog import StepLog

CHUNK_SOURCE = REPO / "tests" / "fixtures" / "loop" / "vllm-chunk-source.jsonl.gz"

# docs/kv-science.md §12 S5 (12,000-token prompts beside a 96-sequence batch, 22 ms decode step,
# 100 ms target), with the batch's peak
S5 = {
    "name": "long prompts beside a busy batch", "engine": "vllm", "model": "llama-3.1-8b",
    "prefill": {"tokens_per_s": 25000, "k_att": 1.8781e-5}, "slo": {"itl_ms": 100},
    "observed": {"decode_step_ms": 22, "kv_usage": 0.65, "preemptions": 0, "running": 96, "running_peak": 180},
    "traffic": {"long_prompt_tokens": 12000, "long_prompts_per_s": 0.5},
    "engine_settings": {"max_num_batched_tokens": 16384},
}


def _rows(v: dict) -> dict[int, dict]:
    return {r["budget"]: r for r in v["numbers"]["chunk_rows"]["value"]}


def test_a_chunk_gets_what_the_decodes_leave_of_the_budget():
    """1,024 tokens a step beside 96 decodes carry 928 prompt tokens: 13 steps for 12,000 (12 if the
    budget were the chunk's alone), and the stated TTFT price counts them."""
    v = judge(copy.deepcopy(S5))
    assert flags(v) == {"--max-num-batched-tokens": 1024}
    assert _rows(v)[1024]["steps"] == 13 and _rows(v)[2048]["steps"] == 7  # ceil(12000 / (2048 - 96))
    assert v["numbers"]["chunked_prefill_phase"]["value"] == pytest.approx(0.874, abs=0.001)
    # an engine whose chunk size is the prompt's alone (SGLang's --chunked-prefill-size)
    sg = copy.deepcopy(S5)
    sg["engine"] = "sglang"
    w = judge(sg)
    assert flags(w) == {"--chunked-prefill-size": 1024} and _rows(w)[1024]["steps"] == 12
    assert not any("--max-running-requests" in f["why"] for f in w["settings"])


def test_llamacpp_batch_holds_its_slots_decodes_and_its_parallel_comes_down_with_it():
    """llama-server fills --batch-size with every generating slot's token first, then prompt tokens,
    and aborts at start with --batch-size below --parallel (the tier checks its build does)."""
    doc = copy.deepcopy(S5)
    doc["engine"] = "llamacpp"
    doc["observed"].update(running=3, running_peak=4)
    doc["engine_settings"] = {"max_num_seqs": 128}
    doc["slo"]["itl_ms"] = 30
    v = judge(doc)
    # --kv-unified keeps each slot's room at the whole -c: --parallel alone splits it over the slots
    assert flags(v) == {"--batch-size": 64, "--parallel": 64, "--kv-unified": True}
    assert _rows(v)[64]["steps"] == 197  # ceil(12000 / (64 - 3))
    why = next(f["why"] for f in v["settings"] if f["flag"] == "--parallel")
    assert why.startswith("the engine will not start with a token budget of 64 below its --parallel of 128")


def test_a_budget_for_tgi_says_what_tgi_refuses():
    """TGI 3.3's router will not start with a prefill budget below --max-input-tokens unless its
    attention backend chunks prefills, which nothing kvtop reads names: the budget's why says so."""
    doc = copy.deepcopy(S5)
    doc["engine"] = "tgi"
    v = judge(doc)
    assert flags(v) == {"--max-batch-prefill-tokens": 1024}
    why = v["settings"][0]["why"]
    assert why.startswith("a 12000-token prompt in steps of 1024 tokens")
    assert why.endswith("TGI refuses a --max-batch-prefill-tokens below --max-input-tokens unless it chunks prefills "
                        "(its flashinfer or flashdecoding attention backends), and one above --max-batch-total-tokens")


def test_a_budget_below_the_batch_the_engine_ran_is_not_prescribed():
    """At a 30 ms target only a 64-token budget keeps the step 10 % under it; the engine ran up to 180
    sequences at once, which vLLM would no longer hold: no budget, and the reason says why."""
    doc = copy.deepcopy(S5)
    doc["slo"]["itl_ms"] = 30
    v = judge(doc)
    assert "--max-num-batched-tokens" not in flags(v)
    assert _rows(v)[64]["holds_batch"] is False and _rows(v)[256]["holds_batch"] is True
    assert any("a budget of 64 tokens keeps each step within the target" in r
               and "it ran up to 180 at once and 96 on average" in r and "cap the batch below the traffic" in r
               for r in v["reasons"])
    assert "disaggregate" in v["also"]
    # the same traffic on a batch that fits: the budget is prescribed
    doc["observed"]["running_peak"] = 40
    doc["observed"]["running"] = 30
    assert flags(judge(doc))["--max-num-batched-tokens"] == 64


def test_a_larger_batch_limit_is_lowered_to_the_budget_with_it():
    """A server known to run --max-num-seqs 2048 would refuse --max-num-batched-tokens 1024 alone."""
    doc = copy.deepcopy(S5)
    doc["engine_settings"]["max_num_seqs"] = 2048
    v = judge(doc)
    assert flags(v) == {"--max-num-batched-tokens": 1024, "--max-num-seqs": 1024}
    why = next(f["why"] for f in v["settings"] if f["flag"] == "--max-num-seqs")
    assert why.startswith("the engine will not start with a token budget of 1024 below its --max-num-seqs of 2048")
    assert "ran at most 180 sequences at once" in why
    # one already within the budget needs nothing
    doc["engine_settings"]["max_num_seqs"] = 256
    assert flags(judge(doc)) == {"--max-num-batched-tokens": 1024}
    # not known: the budget says what to check
    v = judge(copy.deepcopy(S5))
    assert ("the engine will not start with --max-num-seqs above 1024: lower a larger one to 1024 too; the engine "
            "ran at most 180 sequences at once") in v["settings"][0]["why"]


def test_the_simulator_refuses_the_pair_vllm_refuses():
    wl = load_preset("healthy")  # --max-num-seqs 128
    with pytest.raises(WorkloadError, match=r"max_num_batched_tokens \(64\) must be at least max_num_seqs \(128\)"):
        apply_engine_flags(wl, "--max-num-batched-tokens 64")
    e = apply_engine_flags(wl, "--max-num-batched-tokens 64 --max-num-seqs 64").engine
    assert (e.max_num_batched_tokens, e.max_num_seqs) == (64, 64)
    r = run_kvtop("simulate", "--preset", "healthy", "--duration", "1", "-o", "/dev/null",
                  "--engine-flags", "--max-num-batched-tokens 64")
    assert r.returncode == 2 and "must be at least max_num_seqs" in r.stderr and "Traceback" not in r.stderr


def test_the_witness_states_the_engines_limits_on_the_first_step_after_each_start(tmp_path: Path):
    p = tmp_path / "w.jsonl"
    log = StepLog(str(p), "vllm", "0.32.0", extra={"limits": {"max_num_seqs": 256, "max_num_batched_tokens": 2048,
                                                             "max_model_len": 1024}})
    log.step(10.0, 10.02, [("a", 1, 0, 0, 1)], [], [], [], [])
    log.step(10.02, 10.04, [("a", 1, 0, 0, 1)], [], [], [], [])
    log.close()
    # the engine restarted with other limits and appended to the same file
    log = StepLog(str(p), "vllm", "0.32.0", extra={"limits": {"max_num_seqs": 64, "max_num_batched_tokens": 64,
                                                             "max_model_len": 1024}})
    log.step(20.0, 20.02, [("b", 1, 0, 0, 1)], [], [], [], [])
    log.close()
    recs = WitnessReader(str(p), 9.0, engine="http://127.0.0.1:8000", from_start=True).read()
    assert [r.limits.get("max_num_seqs") for r in recs] == [256, None, 64]
    assert "limits" not in to_dict(recs[1]) and to_dict(recs[0])["limits"]["max_num_batched_tokens"] == 2048


def _with_limits(tmp_path: Path, limits: dict[str, int]) -> str:
    """The real engine's chunk-loop recording with one witness step stating ``limits``."""
    lines = gzip.open(CHUNK_SOURCE, "rt").read().splitlines()
    first = json.loads(lines[1])
    step = {"kind": "step", "t": first["t"], "end": first["t"] + 0.01, "engine": "http://127.0.0.1:1",
            "reqs": [], "limits": limits}
    out = tmp_path / "t.jsonl"
    out.write_text("\n".join([lines[0], json.dumps(step), *lines[1:]]) + "\n")
    return str(out)


def _advise(path: str) -> dict:
    r = run_kvtop("advise", "--trace", path, "--itl-target-ms", "100", "--format", "json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_the_real_engines_stated_limits_make_the_budget_one_it_accepts(tmp_path: Path):
    """The real vLLM's prefill loop gets 64 tokens a step (tests/test_prefill_budget.py). Where its
    witness says it runs --max-num-seqs 256, 64 alone would not start: both flags are printed; where it
    says 16 (as the tier's engine runs), the budget alone."""
    v = _advise(_with_limits(tmp_path, {"max_num_seqs": 256, "max_num_batched_tokens": 2048, "max_model_len": 1024}))
    assert flags(v) == {"--max-num-batched-tokens": 64, "--max-num-seqs": 64}
    cur = v["numbers"]["max_seqs_current"]
    assert (cur["value"], cur["source"], cur["note"]) == (256, "measured", "the engine's witness")
    assert v["numbers"]["running_peak"]["value"] == 5  # the engine's running gauge over the recording
    v = _advise(_with_limits(tmp_path, {"max_num_seqs": 16, "max_num_batched_tokens": 2048, "max_model_len": 1024}))
    assert flags(v) == {"--max-num-batched-tokens": 64}
    assert "will not start" not in v["settings"][0]["why"]
    # limits no engine runs under are no current setting
    v = _advise(_with_limits(tmp_path, {"max_num_seqs": -3, "max_num_batched_tokens": "64", "max_model_len": True}))
    assert not {"max_seqs_current", "batched_tokens_current", "max_model_len_current"} & set(v["numbers"])
    # the printed pair starts the simulated engine as vLLM would start
    r = run_kvtop("simulate", "--preset", "healthy", "--duration", "1", "-o", str(tmp_path / "s.jsonl"),
                  "--engine-flags", "--max-num-batched-tokens 64 --max-num-seqs 64")
    assert r.returncode == 0, r.stderr
