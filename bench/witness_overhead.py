"""What the witness costs vLLM per engine step, against the step itself.

The witness's work per step — reading each scheduled request's computed and prompt length before vLLM
advances them, counting the tokens each produced, one JSON line appended — is timed around vLLM's
scheduler hooks (a stand-in scheduler from testkit/fake_vllm.py whose own hooks do vLLM's minimal
bookkeeping, timed alone as the baseline) at batch sizes from 1 to 512. Printed: microseconds per step
with and without the witness, the difference, and that difference as a share of a decode step of
``--step-ms`` (default 10 ms: the tiny CPU model; a GPU decode step of a real model is 10-40 ms), or of
the median decode step read from a witness file (``--from FILE``).

    python -m bench.witness_overhead [--steps 3000] [--step-ms 10] [--from witness.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from testkit import fake_vllm as fake


def _run(batch: int, steps: int, witnessed: bool, path: str) -> float:
    """Seconds per step of schedule-hook + output-hook at ``batch`` decoding requests."""
    os.environ["KVTOP_WITNESS_FILE"] = path
    with fake.installed():
        from kvtop.witness.vllm import WitnessScheduler

        s = WitnessScheduler(vllm_config=fake.config(True)) if witnessed else fake.FakeAsyncScheduler()
        ids = [f"cmpl-{i:032x}-0-{i:08x}" for i in range(batch)]
        for rid in ids:
            s.requests[rid] = fake.request(rid, 300, computed=300)
        sched = dict.fromkeys(ids, 1)
        made = {"made": dict.fromkeys(ids, 1)}
        s.running = list(ids)
        t0 = time.perf_counter()
        for _ in range(steps):
            so = fake.scheduler_output(sched)
            s._update_after_schedule(so)
            s.update_from_output(so, made)
        dt = (time.perf_counter() - t0) / steps
        s.shutdown()
    return dt


def decode_step_from(path: str) -> float | None:
    durs = []
    with open(path) as f:
        for line in f:
            d = json.loads(line)
            r = d.get("r")
            if r and not any(q[2] or q[3] for q in r):
                durs.append(d["t1"] - d["t0"])
    return statistics.median(durs) if durs else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.witness_overhead", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--step-ms", type=float, default=10.0)
    ap.add_argument("--from", dest="src", default=None, metavar="FILE", help="a witness file: its median decode step")
    args = ap.parse_args(argv)
    step_s = args.step_ms / 1e3
    if args.src:
        got = decode_step_from(args.src)
        if got:
            step_s = got
    print(f"decode step for the share: {step_s * 1e3:.2f} ms" + (f" (median of {args.src})" if args.src else ""))
    print(f"{'batch':>6} {'vLLM hooks µs':>14} {'+ witness µs':>13} {'witness µs':>11} {'share of step':>14} {'bytes/step':>11}")
    with tempfile.TemporaryDirectory() as tmp:
        for batch in (1, 16, 64, 256, 512):
            n = max(200, args.steps // max(1, batch // 16))
            path = os.path.join(tmp, f"w{batch}.jsonl")
            base = min(_run(batch, n, False, path) for _ in range(3))
            wit = min(_run(batch, n, True, path) for _ in range(3))
            size = os.path.getsize(path) / (3 * n)
            extra = max(0.0, wit - base)
            print(f"{batch:>6} {base * 1e6:>14.1f} {wit * 1e6:>13.1f} {extra * 1e6:>11.1f} {extra / step_s:>13.2%} {size:>11.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
