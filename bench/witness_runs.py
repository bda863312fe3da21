"""Real vLLM workloads recorded with the witness, and kvtop's inference scored against it.

Starts the tiny-model vLLM (testkit/engines) with ``--scheduler-cls kvtop.witness.vllm.WitnessScheduler``,
records each workload of testkit/engines/witness_workloads.py through ``kvtop record --proxy-listen
--witness``, and prints the matrix of eval/witness_matrix.py (inference vs the engine's log, at 100 ms
and at 2.5x the median decode step). The engine's steps/s with and without the witness are in
bench/witness_overhead.py.

    python -m bench.witness_runs [--out DIR] [--only storm,prefill,mixed]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from eval.witness_matrix import matrix, render
from testkit.engines import servers, witness_workloads
from testkit.engines.kvtop_run import Recorder


def record(srv: servers.Server, wfile: Path, trace: Path, drive) -> Path:  # type: ignore[no-untyped-def]
    with Recorder(trace, srv.url, extra=("--witness", str(wfile))) as rec:
        time.sleep(1.0)
        drive(rec.proxy_url, servers.VLLM_MODEL_NAME)
        time.sleep(2.5)
        rc = rec.stop()
    if rc != 0:
        raise SystemExit(f"kvtop record exited {rc}: {rec.stderr()}")
    return trace


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.witness_runs", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, metavar="DIR", help="keep the traces here (default: a temp folder)")
    ap.add_argument("--only", default="storm,prefill,mixed")
    args = ap.parse_args(argv)
    only = set(args.only.split(","))
    out = Path(args.out or tempfile.mkdtemp(prefix="kvtop-witness-"))
    out.mkdir(parents=True, exist_ok=True)
    py, model = servers.setup_vllm()
    traces: list[str] = []
    plans = [("storm", {}, [("storm", witness_workloads.storm), ("mixed", witness_workloads.mixed)]),
             ("prefill", witness_workloads.PREFILL_SERVER, [("prefill", witness_workloads.prefill_heavy)])]
    for label, kw, runs in plans:
        runs = [(n, d) for n, d in runs if n in only]
        if not runs:
            continue
        wfile = out / f"witness-{label}.jsonl"
        srv = servers.vllm_server(py, model, witness=wfile, **kw)  # type: ignore[arg-type]
        try:
            srv.start(timeout=600)
            for name, drive in runs:
                t0 = time.monotonic()
                traces.append(str(record(srv, wfile, out / f"{name}.jsonl", drive)))
                print(f"[witness] {name}: recorded in {time.monotonic() - t0:.0f} s", flush=True)
        finally:
            srv.stop()
    rows = matrix(traces)
    print(render(rows))
    (out / "matrix.json").write_text(json.dumps(rows, indent=1))
    print(f"traces and matrix.json in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
