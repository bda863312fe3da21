"""kv-science §12 acceptance scenarios S1-S6 through `kvtop advise` (every quoted number within ±5 %)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtop.analysis import scenario

HERE = Path(__file__).parent / "scenarios"
FILES = sorted(HERE.glob("S*.json"))


def close(actual, expected, rel=0.05):
    return actual == pytest.approx(expected, rel=rel)


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
        assert v["settings"].get(k) == want
    for k in exp.get("settings_keys", []):
        assert k in v["settings"]
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
    assert out["verdict"]["settings"] == {"--max-num-batched-tokens": 1024}
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
