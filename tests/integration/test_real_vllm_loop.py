"""Close the loop on the real vLLM: a recorded preemption storm, the advisor's own flags applied, the
same traffic replayed before and after, and `kvtop compare` says whether it got better.

The vLLM is the tier's tiny model on 1,056 KV token slots (testkit/engines/servers.py). The storm is
recorded through `kvtop record --proxy-listen`; `kvtop advise --trace --emit-flags` gives the flags;
`kvtop load --from` replays the recording against the engine as it was and against the engine
restarted with the flags. The prescription is judged as an operator would: the same offered load,
goodput at a 2 s TTFT and 100 ms ITL contract, preemptions per completed request, p99 ITL.
"""

from __future__ import annotations

import json
import shlex
import time

import pytest

from testkit.engines import servers, witness_workloads
from testkit.engines.kvtop_run import Recorder, kvtop

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
        r = kvtop("advise", "--trace", str(src), "--emit-flags")
        assert r.returncode == 0, r.stderr
        out["flags"] = shlex.split(r.stdout.strip())
        before = trace_dir / "loop-before.jsonl"
        r = kvtop("load", "--from", str(src), "--url", srv.url, "-o", str(before), "--no-gpu", timeout=900)
        assert r.returncode == 0, r.stderr
    finally:
        servers.cleanup(srv)
    srv = servers.vllm_server(py, model, extra=tuple(out["flags"]))
    try:
        srv.start()
        after = trace_dir / "loop-after.jsonl"
        r = kvtop("load", "--from", str(src), "--url", srv.url, "-o", str(after), "--no-gpu", timeout=900)
        assert r.returncode == 0, r.stderr
    finally:
        servers.cleanup(srv)
    # The contract an operator of this service would hold it to, read from the traffic: interactive
    # streams (every answer streamed), prompts of 46-79 tokens (their prefill is milliseconds, so time
    # to first token is all queueing), 600-token answers judged at 100 ms a token. A user reading along
    # waits for the first word about as long as for 20 words at that pace: 2 s, the TTFT that MLPerf
    # Inference's Llama-2-70B server scenario pairs with a looser per-token target (200 ms) than ours.
    # Without it, goodput ignores TTFT and compare calls a queue traded for stalls a trade-off.
    r = kvtop("compare", str(before), str(after), "--itl-target-ms", "100", "--ttft-target-ms", "2000",
              "--format", "json")
    assert r.returncode == 0, r.stderr
    out["compare"] = json.loads(r.stdout)
    (trace_dir / "loop-compare.json").write_text(r.stdout)
    return out


def test_the_advisor_prescribes_real_flags_for_the_storm(loop):
    flags = loop["flags"]
    assert "--max-num-seqs" in flags, flags
    n = int(flags[flags.index("--max-num-seqs") + 1])
    assert 1 <= n < servers.VLLM_MAX_NUM_SEQS  # fewer than the engine admits today
    if "--max-model-len" in flags:  # admits every recorded request (prompt + output)
        assert int(flags[flags.index("--max-model-len") + 1]) >= 67 + 600


def test_the_prescription_measured_better_on_the_same_traffic(loop):
    c = loop["compare"]
    print("\n[real-engines] loop:", c.get("summary"), "flags", loop["flags"])
    a, b = c["a"], c["b"]
    print("[real-engines] before/after:", json.dumps(a)[:600], "\n", json.dumps(b)[:600])
    assert c["outcome"] == "improved", c
