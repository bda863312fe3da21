"""The prescription loop on the simulator, for every preset whose verdict is not no_action.

    python -m bench.sim_loop                      # every such preset, 60 simulated s at x4
    python -m bench.sim_loop --preset prefill-interference --speed 2

For each preset (testkit/sim_loop.py): its traffic on sim-server -> trace A; `kvtop advise --trace A
--emit-flags`; `kvtop load --from A` against the preset as it was (A0) and with the flags applied
(B); `kvtop compare A0 B`. Prints the verdict, the flags, the outcome and the figures it rests on
(goodput, p99 ITL and TTFT, preemptions per completed request, time over target); exit 1 when a
prescription does not come out improved.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

from testkit.sim_loop import run_loop

PRESETS = ("preemption-storm", "cancel-heavy", "prefill-interference", "slow-decode", "swap-vs-recompute")


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v * 1e3:.0f} ms"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", action="append", help=f"preset(s) (default: {', '.join(PRESETS)})")
    ap.add_argument("--speed", type=float, default=4.0, help="simulated seconds per wall second")
    ap.add_argument("--duration", type=float, default=60.0, help="simulated seconds of the preset's traffic")
    args = ap.parse_args()
    failed = 0
    with tempfile.TemporaryDirectory() as td:
        for preset in args.preset or PRESETS:
            t0 = time.monotonic()
            r = asyncio.run(run_loop(preset, Path(td), speed=args.speed, duration_s=args.duration))
            if not r.flags:
                print(f"{preset}: verdict {r.verdict} with no flags: nothing to try (a longer run may "
                      f"measure what the verdict needs)  [{time.monotonic() - t0:.0f} s]")
                failed += 1
                continue
            a, b = r.compare["a"], r.compare["b"]
            print(f"{preset}: verdict {r.verdict}; flags: {r.flags or '(none)'}  [{time.monotonic() - t0:.0f} s]")
            print(f"  offered {a['offered']} / {b['offered']}, completed {a['completed']} -> {b['completed']}, "
                  f"goodput {a['goodput']} -> {b['goodput']}, p99 ITL {_ms(a['itl_p99_s'])} -> {_ms(b['itl_p99_s'])}, "
                  f"p99 TTFT {_ms(a['ttft_p99_s'])} -> {_ms(b['ttft_p99_s'])}, preemptions/completed "
                  f"{a['preemptions_per_completed']} -> {b['preemptions_per_completed']}, time over target "
                  f"{sum((a['over_target_s'] or {}).values()):.3g} s -> {sum((b['over_target_s'] or {}).values()):.3g} s")
            print(f"  end-to-end p99 {_ms(a['e2e_p99_s'])} -> {_ms(b['e2e_p99_s'])}, output tokens/s "
                  f"{a['output_tokens_per_s'] or 0:.0f} -> {b['output_tokens_per_s'] or 0:.0f}")
            print(f"  result: {r.compare['summary']}")
            failed += r.outcome != "improved"
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
