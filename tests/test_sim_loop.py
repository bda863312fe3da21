"""The prescription loop on the simulated engine: for every preset whose verdict is not no_action, the
advisor's own flags, applied to the engine, must make the same traffic come out improved in `kvtop compare`.

The fast, deterministic form runs the simulator offline: the preset's run (the incident), `kvtop advise
--emit-flags`, then its arrivals replayed (`simulate --arrivals-from`) on the preset as it was and with the
flags (`--engine-flags`). The tooling form runs the same loop through `kvtop load` against `sim-server`
(testkit/sim_loop.py; slow, and noisy on a busy host: its token steps are a few wall milliseconds).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from conftest import run_kvtop

from testkit.sim_loop import run_loop

# Findings, not tolerances. prefill-interference's --max-num-batched-tokens 1024 (goodput 447 -> 775 of 775,
# 2026-12-02) costs +15 % p99 TTFT (712 -> 818 ms), chunked prefill's known price: the presets state no TTFT
# target, so `kvtop compare` names it a trade-off, which is what an operator without a TTFT contract must
# weigh; the verdict states the price it expects (test_chunked_prefill_states_the_ttft_it_costs asserts both).
# cancel-heavy was one too (p99 end-to-end 29.5 -> 35.2 s): B completed the 76 long requests whose
# clients A lost, and compare took that percentile over completed requests only; it now compares
# end-to-end latency only between runs that completed the same share (goodput 69 -> 191 of 191 judges it).
# preemption-storm was one too while its prescription was an admission limit (--max-num-seqs 8: p99 TTFT
# 22.3 -> 60.1 s); the advisor now sizes the KV cache for the peak in flight instead
# (--kv-cache-memory-bytes, the limit kept as a safety bound): goodput 82 -> 142 of 142, p99 TTFT
# 22.3 s -> 117 ms, no preemptions.
# slow-decode was one too while its prescription was 3/4 of the running batch (--max-num-seqs 196: goodput
# 3 -> 8 of 717, p99 TTFT 434 ms -> 33.2 s): no batch meets the ITL target and serves its load, so its
# verdict is scale_out with no flag (test_slow_decode_is_beyond_any_batch_limit).
PRESETS = ("preemption-storm", "cancel-heavy", "swap-vs-recompute")


def _advise(trace: str) -> dict[str, Any]:
    r = run_kvtop("advise", "--trace", trace, "--format", "json")
    assert r.returncode == 0, r.stderr
    doc: dict[str, Any] = json.loads(r.stdout)
    return doc


@pytest.mark.parametrize("preset", PRESETS)
def test_the_advisors_flags_improve_the_same_traffic(preset: str, tmp_path: Path):
    a, a0, b = (str(tmp_path / f"{x}.jsonl") for x in ("A", "A0", "B"))
    assert run_kvtop("simulate", "--preset", preset, "--duration", "120", "-o", a).returncode == 0
    r = run_kvtop("advise", "--trace", a, "--emit-flags")
    flags = r.stdout.strip()
    assert r.returncode == 0 and flags, f"{preset}: no flags to try ({r.stderr})"
    # long enough for every replayed request to end, under either configuration
    for out, extra in ((a0, ()), (b, ("--engine-flags", flags))):
        r = run_kvtop("simulate", "--preset", preset, "--duration", "200", "--arrivals-from", a, "-o", out, *extra)
        assert r.returncode == 0, r.stderr
    doc = json.loads(run_kvtop("compare", a0, b, "--format", "json").stdout)
    assert doc["outcome"] == "improved", (preset, flags, doc["better"], doc["worse"], doc["reasons"])
    # the same requests were offered, and none was shed to get there
    assert doc["a"]["offered"] == doc["b"]["offered"]
    assert doc["b"]["cancelled"] + doc["b"]["errors"] <= doc["a"]["cancelled"] + doc["a"]["errors"] + \
        0.02 * doc["a"]["offered"]


@pytest.mark.slow
async def test_the_storm_loop_through_load_and_sim_server(tmp_path: Path):
    r = await run_loop("preemption-storm", tmp_path, speed=4.0, duration_s=40.0)
    assert r.verdict == "admission" and "--kv-cache-memory-bytes" in r.flags
    c = r.compare
    assert r.outcome == "improved", (c["better"], c["worse"], c["reasons"])
    assert c["b"]["preemptions_per_completed"] < 0.5 * c["a"]["preemptions_per_completed"]


def _replay(preset: str, arrivals: str, out: str, *flags: str) -> None:
    # long enough for every replayed request to end
    r = run_kvtop("simulate", "--preset", preset, "--duration", "200", "--arrivals-from", arrivals, "-o", out, *flags)
    assert r.returncode == 0, r.stderr


def test_slow_decode_is_beyond_any_batch_limit(tmp_path: Path):
    """slow-decode offers more tokens per second than any batch within the ITL target generates: the verdict
    says so with its arithmetic and emits no flag; the limit that meets the target queues the rest (its
    replay), and the replicas it names each meet the target (the same arrivals dealt round-robin)."""
    a, a0, b, half, h = (str(tmp_path / f"{x}.jsonl") for x in ("A", "A0", "B", "half", "H"))
    assert run_kvtop("simulate", "--preset", "slow-decode", "--duration", "120", "-o", a).returncode == 0
    r = run_kvtop("advise", "--trace", a, "--emit-flags")
    # what a launcher script sees: success, an empty line, and the verdict named on stderr
    assert r.returncode == 0 and r.stdout == "\n" and "verdict scale_out" in r.stderr, (r.stdout, r.stderr)
    v = _advise(a)
    nums = {k: x["value"] for k, x in v["numbers"].items()}
    assert v["action"] == "scale_out" and v["settings"] == []
    demand = nums["arrival_rate"] * nums["output_mean"]
    assert nums["offered_tokens_per_s"] == pytest.approx(demand, rel=1e-3)
    within = [p for p in nums["decode_curve"] if p["itl_ms"] <= nums["itl_target"] * 1e3]
    best = max(within, key=lambda p: p["tokens_per_s"])
    assert best["tokens_per_s"] < demand  # the engine's own best within the target falls short of the load
    why = next(x for x in v["reasons"] if x.startswith("no batch limit meets"))
    assert f"{demand:,.0f} tokens/s" in why and f"{best['tokens_per_s']:,.0f} tokens/s" in why
    replicas = nums["replicas_needed"]
    assert replicas == math.ceil(demand / (0.9 * best["tokens_per_s"])) and f"at least {replicas} replicas" in why

    # the claim: a limit that meets the target serves less than the load, so its queue grows
    _replay("slow-decode", a, a0)
    _replay("slow-decode", a, b, "--engine-flags", f"--max-num-seqs {math.floor(best['running'])}")
    doc = json.loads(run_kvtop("compare", a0, b, "--format", "json").stdout)
    assert doc["b"]["ttft_p99_s"] > 10 * doc["a"]["ttft_p99_s"], (doc["a"]["ttft_p99_s"], doc["b"]["ttft_p99_s"])
    assert doc["b"]["goodput"] < 0.1 * doc["b"]["offered"]

    # the remedy: one of `replicas` engines, given every replicas-th request, meets the target
    with open(a) as src, open(half, "w") as dst:
        for line in src:
            d = json.loads(line)
            if d["kind"] == "header" or (d["kind"] == "request" and int(d["id"].rsplit("-", 1)[1]) % replicas == 0):
                dst.write(line)
    _replay("slow-decode", half, h)
    one = _advise(h)
    assert one["action"] != "scale_out" and one["action"] != "reduce_batch", one["reasons"]
    doc = json.loads(run_kvtop("compare", a0, h, "--format", "json").stdout)
    assert doc["b"]["goodput"] >= 0.95 * doc["b"]["offered"] > 0


def test_chunked_prefill_states_the_ttft_it_costs(tmp_path: Path):
    """prefill-interference's chunk budget restores goodput at a TTFT price its verdict names beforehand:
    without a TTFT target the replay is a trade-off (p99 TTFT the only figure worse), and the rise it
    measures is the one the verdict stated (strict: it fails once the prescription stops costing TTFT)."""
    a, a0, b = (str(tmp_path / f"{x}.jsonl") for x in ("A", "A0", "B"))
    assert run_kvtop("simulate", "--preset", "prefill-interference", "--duration", "120", "-o", a).returncode == 0
    v = _advise(a)
    assert v["action"] == "chunked_prefill"
    cost = v["numbers"]["chunked_ttft_cost"]["value"]
    # the preset does not chunk prefills: the budget goes out with the switch vLLM needs beside it
    assert [s["flag"] for s in v["settings"]] == ["--max-num-batched-tokens", "--enable-chunked-prefill"]
    setting = v["settings"][0]
    price = f"{cost * 1e3:+.0f} ms"
    assert price in setting["why"] and any(price in r and "TTFT" in r for r in v["reasons"])
    _replay("prefill-interference", a, a0)
    _replay("prefill-interference", a, b, "--engine-flags",
            f"{setting['flag']} {setting['value']} --enable-chunked-prefill")
    doc = json.loads(run_kvtop("compare", a0, b, "--format", "json").stdout)
    assert doc["outcome"] == "trade_off", (doc["better"], doc["worse"])
    assert doc["b"]["goodput"] > doc["a"]["goodput"] and doc["outside_contract"] == [
        w for w in doc["worse"] if w.startswith("p99 TTFT")]
    # the chunk steps are longer than a decode step: p99 ITL may rise, but stays within the target
    assert all(w.startswith(("p99 TTFT", "p99 ITL")) for w in doc["worse"])
    assert doc["b"]["itl_p99_s"] <= doc["itl_target_s"]
    rise = doc["b"]["ttft_p99_s"] - doc["a"]["ttft_p99_s"]
    assert 0.5 * cost <= rise <= 2 * cost, (rise, cost)
    # with a TTFT target the operator's contract judges it: goodput decides, and the budget helps
    target_ms = str(round(2 * doc["b"]["ttft_p99_s"] * 1e3))
    doc = json.loads(run_kvtop("compare", a0, b, "--ttft-target-ms", target_ms, "--format", "json").stdout)
    assert doc["outcome"] == "improved", (doc["better"], doc["worse"])
