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

PRESETS = ("preemption-storm", "cancel-heavy", "prefill-interference", "slow-decode", "swap-vs-recompute")


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
    assert r.verdict == "admission" and "--max-num-seqs" in r.flags
    c = r.compare
    assert r.outcome == "improved", (c["better"], c["worse"], c["reasons"])
    assert c["b"]["preemptions_per_completed"] < 0.5 * c["a"]["preemptions_per_completed"]
