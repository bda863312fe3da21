"""Real vLLM workloads recorded with the witness, and kvtop's inference scored against it.

Starts the tiny-model vLLM (testkit/engines) with ``--scheduler-cls kvtop.witness.vllm.WitnessScheduler``,
records each workload of testkit/engines/witness_workloads.py through ``kvtop record --proxy-listen
--witness``, and prints the matrix of eval/witness_matrix.py (inference vs the engine's log, at 100 ms
and at 2.5x the median decode step). The engine's steps/s with and without the witness are in
bench/witness_overhead.py.

    python -m bench.witness_runs [--out DIR] [--only storm,prefill,mixed] [--round SEED ...] [--burn N]

``--round SEED`` records a round of variant workloads instead (``witness_workloads.round_of``: two
storms, a denser mixed load, the same with half its clients past kvtop's proxy, more long prompts);
docs/real-engines.md §7.1 scored rounds 21, 31, 41 and 51. ``--only`` then picks among the round's
workloads (``storm8x900,prefill``). ``--only shortprompts`` (also in a round) records
``witness_workloads.short_prompts``: a growing batch while chat-sized prompts arrive (§7.9).
``--burn N`` keeps N processes spinning on the CPU while the workloads run: an engine slowed by its
host, whose decode-only steps alone may miss the target (docs/real-engines.md §7.5).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

from eval.witness_matrix import matrix, render
from testkit.engines import servers, witness_workloads
from testkit.engines.kvtop_run import Recorder


def record(srv: servers.Server, wfile: Path, trace: Path, drive: witness_workloads.Drive) -> Path:
    with Recorder(trace, srv.url, extra=("--witness", str(wfile))) as rec:
        time.sleep(1.0)
        drive(rec.proxy_url, servers.VLLM_MODEL_NAME, srv.url)
        time.sleep(2.5)
        rc = rec.stop()
    if rc != 0:
        raise SystemExit(f"kvtop record exited {rc}: {rec.stderr()}")
    return trace


def _spin() -> None:
    with contextlib.suppress(OSError):  # ahead of the engine where allowed: a noisy neighbour, not a fair share
        os.nice(-10)
    while True:
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.witness_runs", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, metavar="DIR", help="keep the traces here (default: a temp folder)")
    ap.add_argument("--only", default=None, help="workloads to record (default: storm,prefill,mixed, or all of a round's)")
    ap.add_argument("--round", type=int, nargs="+", default=None, metavar="SEED",
                    help="record rounds of variant workloads with these seeds instead")
    ap.add_argument("--burn", type=int, default=0, metavar="N", help="N processes spinning on the CPU meanwhile")
    args = ap.parse_args(argv)
    only = set((args.only or "storm,prefill,mixed").split(","))
    out = Path(args.out or tempfile.mkdtemp(prefix="kvtop-witness-"))
    out.mkdir(parents=True, exist_ok=True)
    py, model = servers.setup_vllm()
    traces: list[str] = []
    plans: list[tuple[str, dict, list[tuple[str, witness_workloads.Drive]]]] = [
        ("storm", {}, [("storm", lambda u, m, _e: witness_workloads.storm(u, m)),
                       ("mixed", lambda u, m, _e: witness_workloads.mixed(u, m))]),
        ("shortprompts", witness_workloads.SHORT_PROMPTS_SERVER,
         [("shortprompts", lambda u, m, _e: witness_workloads.short_prompts(u, m))]),
        ("prefill", witness_workloads.PREFILL_SERVER,
         [("prefill", lambda u, m, _e: witness_workloads.prefill_heavy(u, m))])]
    if args.round:
        rounds = [witness_workloads.round_of(s) for s in args.round]
        plans = [("storm", {}, [r for small, _ in rounds for r in small]),
                 ("prefill", witness_workloads.PREFILL_SERVER, [r for _, pf in rounds for r in pf]),
                 ("shortprompts", witness_workloads.SHORT_PROMPTS_SERVER,
                  [(f"shortprompts-{s}", witness_workloads.short_prompts_of(s)) for s in args.round])]
        if args.only is None:
            only = {name.rsplit("-", 1)[0] for _, _, runs in plans for name, _ in runs}
    for label, kw, runs in plans:
        runs = [(n, d) for n, d in runs if n.rsplit("-", 1)[0] in only or n in only]
        if not runs:
            continue
        wfile = out / f"witness-{label}.jsonl"
        srv = servers.vllm_server(py, model, witness=wfile, **kw)
        burners: list[multiprocessing.Process] = []
        try:
            srv.start(timeout=600)
            burners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.burn)]
            for b in burners:
                b.start()
            for name, drive in runs:
                t0 = time.monotonic()
                traces.append(str(record(srv, wfile, out / f"{name}.jsonl", drive)))
                print(f"[witness] {name}: recorded in {time.monotonic() - t0:.0f} s", flush=True)
        finally:
            for b in burners:
                b.terminate()
            srv.stop()
    rows = matrix(traces)
    print(render(rows))
    (out / "matrix.json").write_text(json.dumps(rows, indent=1))
    print(f"traces and matrix.json in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
