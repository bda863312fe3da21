"""docs/kv-science.md §12 acceptance scenarios S1-S6 through `kvtop advise` (every quoted number within ±5 %)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtop.analysis.advice import scenario

HERE = Path(__file__).parent / "scenarios"
FILES = sorted(HERE.glob("S*.json"))


def close(actual, expected, rel=0.05):
    return actual == pytest.approx(expected, rel=rel)


def flags(v):
    """A verdict's settings as {flag: value} (the JSON is a list of {setting, flag, value, why})."""
    return {f["flag"] or f["setting"]: f["value"] for f in v["settings"]}


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_scenario(path):
    doc = scenario.load(path)
    exp = doc["expect"]
    v = scenario.evaluate(doc)["verdict"]
    assert v["action"] == exp["action"]
    if "mechanism" in exp:
        assert v["mechanism"] == exp["mechanism"]
    if "marginal" in exp:
        assert v["marginal"] is exp["marginal"]
    nums = v["numbers"]
    for k, want in exp.get("numbers", {}).items():
        assert k in nums, f"{path.stem}: {k} missing"
        assert close(nums[k]["value"], want), f"{path.stem}: {k} = {nums[k]['value']} != {want}"
    for k, want in exp.get("at_least", {}).items():
        assert nums[k]["value"] >= want, f"{k} = {nums[k]['value']} < {want}"
    for k, want in exp.get("values", {}).items():
        assert nums[k]["value"] == want
    for k, want in exp.get("gates", {}).items():
        assert nums["gates"]["value"][k] is want
    for k, want in exp.get("settings", {}).items():
        assert flags(v).get(k) == want
    for k in exp.get("settings_keys", []):
        assert k in flags(v)
    if "victims" in exp:
        rows = {r["name"]: r for r in nums["victims"]["value"]}
        for name, want in exp["victims"].items():
            for k, x in want.items():
                assert close(rows[name][k], x), f"victim {name} {k}: {rows[name][k]} != {x}"
    if "chunk_rows" in exp:
        rows = {str(r["budget"]): r for r in nums["chunk_rows"]["value"]}
        for b, want in exp["chunk_rows"].items():
            for k, x in want.items():
                if isinstance(x, bool):
                    assert rows[b][k] is x
                else:
                    assert close(rows[b][k], x), f"budget {b} {k}: {rows[b][k]} != {x}"
    # every number says where it came from
    assert all(n["source"] in ("measured", "given", "config", "assumed", "derived") for n in nums.values())


def test_s1_numbers_hand_computed():
    """S1 spelled out: V = 32,000 x 81,920 B; BW_eff = 0.8 x 1.25 MiB / (1.25 MiB/50 GB/s + 6 us)."""
    v = scenario.evaluate(scenario.load(HERE / "S1.json"))["verdict"]["numbers"]
    g = 1.25 * (1 << 20)
    bw = 0.8 * g / (g / 50e9 + 6e-6)
    assert v["bytes_moved"]["value"] == pytest.approx(32000 * 81920)
    assert v["bw_eff"]["value"] == pytest.approx(bw, rel=1e-4)
    assert v["t_out"]["value"] == pytest.approx(32000 * 81920 / bw, rel=1e-4)
    assert v["bw_eff"]["source"] == "derived"  # from given parts, not an assumed default


def test_s2_without_busy_link_still_recompute():
    """S2: even with the link idle the 46 ms swap resume is slower than an 8 ms recompute."""
    doc = scenario.load(HERE / "S2.json")
    doc["link"]["utilization"] = 0.0
    v = scenario.evaluate(doc)["verdict"]
    assert v["action"] == "recompute"
    assert v["numbers"]["gates"]["value"]["link"] is True


def test_s3_low_cancel_is_swap():
    doc = scenario.load(HERE / "S3.json")
    doc["preemption"] = {"seq_tokens": 3000, "cancel_prob": 0.0}
    v = scenario.evaluate(doc)["verdict"]
    assert v["action"] == "swap"  # 87.7 ms blocking swap < 126.8 ms recompute when everyone resumes


def test_advise_cli_json_and_text(kvtop_cli):
    r = kvtop_cli("advise", "--scenario", str(HERE / "S5.json"), "--format", "json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["verdict"]["action"] == "chunked_prefill"
    assert flags(out["verdict"]) == {"--max-num-batched-tokens": 1024}
    r = kvtop_cli("advise", "--scenario", str(HERE / "S1.json"))
    assert r.returncode == 0
    assert "SWAP" in r.stdout and "--kv-offloading-size" in r.stdout


def test_advise_invalid_scenario(kvtop_cli, tmp_path):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps({"model": "llama-3.1-8b", "preemption": {"cancel_prob": 1.5}}))
    r = kvtop_cli("advise", "--scenario", str(p))
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "cancel_prob" in r.stderr and "Traceback" not in r.stderr
    p.write_text("{not json")
    r = kvtop_cli("advise", "--scenario", str(p))
    assert r.returncode == 2 and "not JSON" in r.stderr
    r = kvtop_cli("advise", "--scenario", str(tmp_path / "missing.json"))
    assert r.returncode == 2 and r.stderr.startswith("kvtop: error:")
    p.write_text(json.dumps({"preemption": {"seq_tokens": 10}}))  # KV size unknowable
    r = kvtop_cli("advise", "--scenario", str(p))
    assert r.returncode == 2


# ---- issue 13 regressions: each number below is worked out by hand in the docstring ----------

def _verdict(doc: dict) -> dict:
    scenario.validate(doc)
    return scenario.evaluate(doc)["verdict"]


def test_gemma2_sliding_window_bytes_keep_the_link_gate_open():
    """Gemma-2-9B, 8,192 tokens, bf16: 21 global layers hold 8,192 tokens, 21 local layers 4,096.

    per layer per token = 2·8·256·2 = 8,192 B
    V = 8,192 · (21·8,192 + 21·4,096) = 2,113,929,216 B (2.11 GB), not 42·8,192·8,192 = 2,818,572,288
    link demand at 3.3 preemptions/s, p = 0: 3.3 · V · 2 = 13.95 GB/s <= 0.8 · 20 GB/s = 16 GB/s
    (the naive 2.82 GB would need 18.60 GB/s and fail the gate, flipping the verdict to recompute).
    """
    doc = {"model": "gemma-2-9b", "engine": "vllm", "prefill": {"tokens_per_s": 10000, "k_att": 1e-5},
           "link": {"bw_eff_gbps": 20}, "host": {"pinned_free_bytes": 100e9},
           "preemption": {"seq_tokens": 8192, "cancel_prob": 0, "per_minute": 198}}
    v = _verdict(doc)
    n = v["numbers"]
    V = 8192 * (21 * 8192 + 21 * 4096)
    assert V == 2_113_929_216
    # reported numbers carry 6 significant digits
    assert n["bytes_moved"]["value"] == pytest.approx(V, rel=1e-5)
    assert n["freed_bytes"]["value"] == pytest.approx(V, rel=1e-5)
    assert n["link_demand"]["value"] == pytest.approx(3.3 * V * 2, rel=1e-5)
    assert n["gates"]["value"]["link"] is True
    assert v["action"] == "swap"
    # recommended pool: 4 sequences = 8.456 GB = 7.875 GiB -> 8 GiB
    assert flags(v)["--kv-offloading-size"] == 8


def test_mistral_v01_window_caps_host_bytes():
    """Mistral-7B-v0.1 at 32K: every layer windowed at 4,096, so a sequence holds 4,096 tokens.

    V = 32 layers · 2·8·128·2 B · 4,096 = 536,870,912 B (512 MiB), not 32,768 · 131,072 = 4.29 GB.
    Host gate with 4 GB pinned free: 0.54 GB fits (4.29 GB would not).
    """
    doc = {"model": "mistral-7b-v0.1", "prefill": {"tokens_per_s": 25000, "k_att": 1.8781e-5},
           "link": {"bw_eff_gbps": 40}, "host": {"pinned_free_bytes": 4e9},
           "preemption": {"seq_tokens": 32768, "cancel_prob": 0}}
    v = _verdict(doc)
    n = v["numbers"]
    assert 32 * 4096 * 4096 == 536_870_912
    assert n["bytes_moved"]["value"] == pytest.approx(536_870_912, rel=1e-5)
    assert n["gates"]["value"]["host"] is True
    assert v["action"] == "swap"
    # the pool (4 x 512 MiB = 2 GiB) fits the 4 GB too
    assert n["offload_pool"]["value"] == pytest.approx(4 * 536_870_912, rel=1e-5)


def test_two_rare_preemptions_are_no_action():
    """Two preemptions at 0.002 per completed request: 2 < 3 spikes, and 0.2 % of streams < 1 %.

    analyze's spike-pattern rule (>= 3 spikes and >= 0.05 % of gaps or >= 1 % of streams) says this
    is no ITL-miss pattern: no action, no swap setting.
    """
    doc = json.loads((HERE / "S1.json").read_text())
    doc.pop("expect")
    doc["observed"] = {"preemptions": 2}
    doc["preemption"]["per_completed"] = 0.002
    v = _verdict(doc)
    assert v["action"] == "no_action"
    assert v["settings"] == []
    assert v["numbers"]["decided_by"]["value"][0]["gate"] == "spike_pattern"
    # 0.002 per completed request alone (no count) also fails the 1 %-of-streams rule
    doc["observed"] = {}
    assert _verdict(doc)["action"] == "no_action"
    # at 0.02 per completed request (2 % of streams) the same preemptions matter
    doc["preemption"]["per_completed"] = 0.02
    assert _verdict(doc)["action"] == "swap"


def test_itl_within_target_is_no_action():
    """docs/kv-science.md §11: ITL p99 95 ms under a 100 ms target -> no action, whatever the preemptions."""
    doc = json.loads((HERE / "S1.json").read_text())
    doc.pop("expect")
    doc["slo"] = {"itl_ms": 100}
    doc["observed"] = {"itl_p99_ms": 95, "preemptions": 40, "window_s": 600}
    v = _verdict(doc)
    assert v["action"] == "no_action"
    assert v["numbers"]["decided_by"]["value"][0]["gate"] == "itl_target_met"
    doc["observed"]["itl_p99_ms"] = 400
    assert _verdict(doc)["action"] == "swap"


def test_prefill_counts_every_step_over_the_target():
    """24,000-token prompts at an 8,192-token budget on Llama-3.1-8B (a = 1/25,000, k_att = 1.8781e-5).

    steps: 8,192 + 8,192 + 7,616 tokens; t_step = 22 ms + a·len + a·k·(end² − start²)
        = 0.40009 s, 0.50092 s, 0.55769 s -> all three over the 100 ms target
    at 0.2 prompts/s each stream sees per second 0.6 long samples and
    (1 − 0.2·1.45870)/0.022 = 32.19 ordinary ones: share = 0.6/32.79 = 1.83 % (> 1 %, so p99 ≈ a long step).
    Counting only the longest step gave 0.2/((1 − 0.2·0.55769)/0.022 + 0.2) = 0.49 % (< 1 %).
    """
    a, k = 1 / 25000, 1.8781e-5
    steps = []
    for start, ln in ((0, 8192), (8192, 8192), (16384, 7616)):
        steps.append(0.022 + a * ln + a * k * ((start + ln) ** 2 - start ** 2))
    assert steps == pytest.approx([0.40009, 0.50092, 0.55769], abs=1e-4)
    share = 0.2 * 3 / ((1 - 0.2 * sum(steps)) / 0.022 + 0.2 * 3)
    assert share == pytest.approx(0.0183, abs=2e-4)
    doc: dict = {"model": "llama-3.1-8b", "engine": "vllm", "prefill": {"tokens_per_s": 25000, "k_att": 1.8781e-5},
                 "slo": {"itl_ms": 100}, "observed": {"decode_step_ms": 22},
                 "traffic": {"long_prompt_tokens": 24000, "long_prompts_per_s": 0.2},
                 "engine_settings": {"max_num_batched_tokens": 8192}}
    v = _verdict(doc)
    assert v["action"] == "chunked_prefill"
    assert v["numbers"]["spike_share"]["value"] == pytest.approx(share, rel=1e-3)
    assert any("so p99 ITL ≈ that step" in r for r in v["reasons"])
    # ten times rarer prompts: 0.18 % of gaps -> the p99 target holds, no action
    doc["traffic"]["long_prompts_per_s"] = 0.02
    v = _verdict(doc)
    assert v["action"] == "no_action" and v["numbers"]["decided_by"]["value"][0]["gate"] == "spike_pattern"


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_every_verdict_names_the_gate_that_decided_it(path, kvtop_cli):
    v = scenario.evaluate(scenario.load(path))["verdict"]
    assert v["numbers"]["decided_by"]["value"], f"{path.stem}: no deciding gate"
    assert all(d["gate"] and d["detail"] for d in v["numbers"]["decided_by"]["value"])


def test_advise_text_says_which_gate_decided(kvtop_cli):
    r = kvtop_cli("advise", "--scenario", str(HERE / "S12.json"))
    assert r.returncode == 0, r.stderr
    assert "decided by: cause_weight" in r.stdout and "97%" in r.stdout
    assert "ADMISSION" in r.stdout


def test_lost_time_outweighs_spike_counts():
    """S12 with the time over target removed: 27 of 143 spikes (19 %) is no dominant cause."""
    doc = scenario.load(HERE / "S12.json")
    for c in doc["observed"]["causes"].values():
        c.pop("lost_s")
    v = scenario.evaluate(doc)["verdict"]
    assert v["action"] == "insufficient_data"
    # a single cause explaining most of the lost time always decides, however many short gaps there are
    doc = scenario.load(HERE / "S12.json")
    doc["observed"]["causes"]["unknown"].update(spikes=5000, lost_s=170)  # 181 / 351 = 52 %
    doc["observed"]["spikes"] = 5027
    assert scenario.evaluate(doc)["verdict"]["action"] == "admission"


def test_no_host_tier_emits_no_offload_setting():
    v = scenario.evaluate(scenario.load(HERE / "S8.json"))["verdict"]
    assert not any("offload" in k for k in flags(v))
    assert any("no host KV tier" in r for r in v["reasons"])
    s1 = scenario.evaluate(scenario.load(HERE / "S1.json"))["verdict"]
    assert s1["action"] == "swap"  # the same case with a host tier


def test_freed_bytes_are_totals_for_gqa_and_mla_alike():
    """freed bytes = moved bytes over all ranks when nothing is shared, for GQA (S1) and MLA (S13)."""
    for name in ("S1", "S13"):
        n = scenario.evaluate(scenario.load(HERE / f"{name}.json"))["verdict"]["numbers"]
        assert n["freed_bytes"]["value"] == pytest.approx(n["bytes_moved_total"]["value"], rel=1e-5)
        assert n["kv_bytes_per_token"]["value"] == pytest.approx(
            n["kv_bytes_per_token_rank"]["value"] * n["ranks"]["value"], rel=1e-5)


@pytest.mark.parametrize("impl,keys", [
    ("vllm_v0_swap", {"--preemption-mode": "swap", "--swap-space": 3}),
    ("vllm_v1_offload", {"--kv-offloading-backend": "native", "--kv-offloading-size": 10}),
    ("lmcache", {"--kv-offloading-backend": "lmcache", "--kv-offloading-size": 10}),
    ("sglang_hicache", {"--enable-hierarchical-cache": True, "--hicache-size": 3}),
])
def test_swap_settings_per_implementation(impl, keys):
    """S1 (70B TP4, 32,000 tokens): V = 32,000 x 81,920 = 2.62 GB per rank, 10.49 GB over 4 ranks.

    With 11 GB of pinned memory free the pool holds one sequence (10.49 GB, not 4 x 10.49):
    V1 connector / LMCache --kv-offloading-size (all ranks): 10.49e9 / 2^30 = 9.77 -> 10 GiB (vLLM
    gives LMCache its local_cpu and max_local_cpu_size itself, so no LMCache setting is printed);
    V0 --swap-space (per GPU) = 2.62e9 / 2^30 = 2.44 -> 3 GiB; HiCache --hicache-size (per rank) 2.62 -> 3 GB.
    """
    doc = scenario.load(HERE / "S1.json")
    doc["swap"] = {"implementation": impl}
    doc["host"] = {"pinned_free_bytes": 11e9}
    v = scenario.evaluate(doc)["verdict"]
    assert v["action"] == "swap"
    for k, want in keys.items():
        assert flags(v)[k] == want, (k, v["settings"])


def test_every_printed_swap_setting_is_a_flag_the_engine_takes():
    """Every host-tier setting of a swap verdict is a command-line flag (no LMCache config key is
    printed as if it were one: vLLM derives them from --kv-offloading-size, and says so)."""
    for impl in ("vllm_v0_swap", "vllm_v1_offload", "lmcache", "sglang_hicache"):
        doc = scenario.load(HERE / "S1.json")
        doc["swap"] = {"implementation": impl}
        v = scenario.evaluate(doc)["verdict"]
        assert all(f["flag"].startswith("--") for f in v["settings"]), (impl, v["settings"])
    assert any("max_local_cpu_size" in r for r in v["reasons"]) is False  # the last was HiCache
    doc = scenario.load(HERE / "S1.json")
    doc["swap"] = {"implementation": "lmcache"}
    v = scenario.evaluate(doc)["verdict"]
    # vLLM 0.32's lmcache backend is a standalone LMCache server's client: the size does not size it
    assert any("standalone LMCache server" in r and "GB per rank" in r for r in v["reasons"]), v["reasons"]


def test_sglang_sizes_its_host_pool_per_rank_and_above_the_gpus_pool():
    """S1 on SGLang (TP 4, 200 GB pinned free): the pool for the assumed four preempted 32,000-token
    sequences is 41.9 GB over the ranks, and SGLang's --hicache-size is GB per rank: 10.49 -> 11, with
    or without the implementation stated (it was 40, all ranks in GiB, where it was not). With the
    GPUs' KV pool known (4 x 52 GB) and 300 GB free, HiCache backs it up to the host, and releases up
    to 0.5.9 refuse a host pool no larger than it: 52 + 10.49 -> 63 GB per rank. Where the host has no room for both,
    the pool stays the sequences' and the verdict says what SGLang will do with it."""
    for swap in ({"mode": "async"}, {"implementation": "sglang_hicache"}):
        doc = scenario.load(HERE / "S1.json")
        doc["engine"], doc["swap"] = "sglang", swap
        v = scenario.evaluate(doc)["verdict"]
        assert flags(v) == {"--enable-hierarchical-cache": True, "--hicache-size": 11}, v["settings"]
        assert any("confirm --hicache-size exceeds it per rank" in r for r in v["reasons"]), v["reasons"]
    doc["capacity"] = {"kv_pool_bytes": 4 * 52e9}
    doc["host"] = {"pinned_free_bytes": 300e9}
    v = scenario.evaluate(doc)["verdict"]
    assert flags(v)["--hicache-size"] == 63, v["settings"]
    doc["host"] = {"pinned_free_bytes": 100e9}
    v = scenario.evaluate(doc)["verdict"]
    assert flags(v)["--hicache-size"] == 11, v["settings"]
    assert any("the host has no room for both" in r for r in v["reasons"]), v["reasons"]


def test_an_older_vllm_is_not_given_a_kv_size_flag_it_lacks():
    """S6 wants a larger KV cache (210 GB per GPU); --kv-cache-memory-bytes first appears in vLLM
    0.10.2 (its arg_utils.py; 0.10.1.1's has none), so on 0.10.1 the verdict names no such flag and
    says why, while 0.10.2 and 0.32 get it."""
    def kv_flag(version: str) -> dict:
        doc = scenario.load(HERE / "S6.json")
        doc["engine_version"] = version
        doc["engine_settings"] = {**doc.get("engine_settings", {}), "gpu_memory_utilization": 0.9}
        doc["observed"], doc["slo"] = {"decode_step_ms": 30}, {"itl_ms": 100}
        doc["traffic"] = {**doc["traffic"], "inflight_peak": 400}
        return scenario.evaluate(doc)["verdict"]
    old = kv_flag("0.10.1")
    assert "--kv-cache-memory-bytes" not in flags(old), old["settings"]
    assert any("predates --kv-cache-memory-bytes (first in vLLM 0.10.2)" in r for r in old["reasons"]), old["reasons"]
    for version in ("0.10.2", "0.32.0"):
        assert flags(kv_flag(version))["--kv-cache-memory-bytes"] == 209715200000, version


def test_counted_spikes_without_causes_fall_back_to_the_sections():
    """S1 with 40 spikes in 20,000 gaps (0.2 % >= 0.05 %) and no per-cause split: the preemption
    section is the cause; with 2 spikes the pattern fails and nothing is changed."""
    doc = scenario.load(HERE / "S1.json")
    doc["observed"] = {"spikes": 40, "gaps": 20000}
    v = scenario.evaluate(doc)["verdict"]
    assert v["action"] == "swap"
    assert [d["gate"] for d in v["numbers"]["decided_by"]["value"]][:2] == ["spike_pattern", "premise"]
    doc["observed"] = {"spikes": 2, "gaps": 20000}
    assert scenario.evaluate(doc)["verdict"]["action"] == "no_action"
