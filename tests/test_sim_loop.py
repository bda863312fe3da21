"""The prescription loop on the simulated engine: for every preset whose verdict is not no_action, the
advisor's own flags, applied to the engine, must make the same traffic come out improved in `kvtop compare`.

The fast, deterministic form runs the simulator offline: the preset's run (the incident), `kvtop advise
--emit-flags`, then its arrivals replayed (`simulate --arrivals-from`) on the preset as it was and with the
flags (`--engine-flags`). The tooling form runs the same loop through `kvtop load` against `sim-server`
(testkit/sim_loop.py; slow, and noisy on a busy host: its token steps are a few wall milliseconds).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_kvtop

from testkit.sim_loop import run_loop

# Findings, not tolerances: since `kvtop compare` judges what the goodput contract (the presets' ITL
# target; they state no TTFT target) does not, these prescriptions come out a trade-off. Measured on
# this test's own runs (2026-12-02): slow-decode's --max-num-seqs 196 lifts goodput 3 -> 8 of 717 while
# p99 TTFT goes 434 ms -> 33.2 s (a smaller batch queues the rest; more KV does not shorten a decode step);
# prefill-interference's --max-num-batched-tokens 1024 (goodput 447 -> 775 of 775) costs +15 % p99
# TTFT (712 -> 818 ms), chunked prefill's known price. Strict: these fail loudly once they improve.
# cancel-heavy was one too (p99 end-to-end 29.5 -> 35.2 s): B completed the 76 long requests whose
# clients A lost, and compare took that percentile over completed requests only; it now compares
# end-to-end latency only between runs that completed the same share (goodput 69 -> 191 of 191 judges it).
# preemption-storm was one too while its prescription was an admission limit (--max-num-seqs 8: p99 TTFT
# 22.3 -> 60.1 s); the advisor now sizes the KV cache for the peak in flight instead
# (--kv-cache-memory-bytes, the limit kept as a safety bound): goodput 82 -> 142 of 142, p99 TTFT
# 22.3 s -> 117 ms, no preemptions.
TRADE_OFFS = {
    "slow-decode": "reduce_batch queues requests: p99 TTFT 434 ms -> 33 s for goodput 3 -> 8 of 717",
    "prefill-interference": "chunked prefill costs +15 % p99 TTFT, which the ITL-only contract does not judge",
}
PRESETS = [pytest.param(p, marks=pytest.mark.xfail(reason=TRADE_OFFS[p], strict=True)) if p in TRADE_OFFS else p
           for p in ("preemption-storm", "cancel-heavy", "prefill-interference", "slow-decode", "swap-vs-recompute")]


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
