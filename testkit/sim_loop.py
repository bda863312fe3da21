"""The prescription loop on the simulated engine, as an operator runs it on a real one:

1. ``kvtop load --preset P`` against ``sim-server`` running P: the incident trace A;
2. ``kvtop advise --trace A --emit-flags``: the verdict's flags;
3. ``kvtop load --from A`` against P as it was (A0) and against P with those flags applied
   (B; ``kvtop.sim.flags`` maps vLLM flags to the simulated engine);
4. ``kvtop compare A0 B``: both replays carry the same plan, so offered load and mix match.

The server runs ``speed`` times faster than real time and every load scales its times by the same
factor, so the engine sees the preset's traffic in simulated time. Each kvtop step is a subprocess
(the CLI a user runs); the simulated server runs in this process.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtop.sim.flags import apply_engine_flags
from kvtop.sim.server import SimServer
from kvtop.sim.workload import Workload, load_preset

REPO = Path(__file__).resolve().parents[1]


@dataclass
class LoopResult:
    preset: str
    verdict: str
    flags: str
    compare: dict[str, Any]

    @property
    def outcome(self) -> str:
        return str(self.compare["outcome"])


async def _kvtop(*args: str, timeout: float = 300) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.setdefault("XDG_CONFIG_HOME", str(REPO / ".cache" / "no-config"))
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "kvtop", *args, env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"kvtop {args[0]} failed ({proc.returncode}): {err.decode().strip()[-400:]}")
    return out.decode()


async def _load(wl: Workload, speed: float, out: Path, *source: str) -> None:
    async with SimServer(wl, speed=speed) as srv:
        await _kvtop("load", *source, "--url", srv.url, "-o", str(out), "--rate-scale", f"{speed:g}",
                     "--interval", f"{1 / speed:g}", "--no-gpu", "--no-host")


async def run_loop(preset: str, tmp: Path, speed: float = 4.0, duration_s: float = 60.0) -> LoopResult:
    wl = load_preset(preset)
    a, a0, b = tmp / f"{preset}.A.jsonl", tmp / f"{preset}.A0.jsonl", tmp / f"{preset}.B.jsonl"
    await _load(wl, speed, a, "--preset", preset, "--duration", f"{duration_s / speed:g}")
    verdict = json.loads(await _kvtop("advise", "--trace", str(a), "--format", "json"))
    flags = (await _kvtop("advise", "--trace", str(a), "--emit-flags")).strip()
    await _load(wl, speed, a0, "--from", str(a))
    await _load(apply_engine_flags(wl, flags), speed, b, "--from", str(a))
    doc = json.loads(await _kvtop("compare", str(a0), str(b), "--format", "json"))
    return LoopResult(preset, str(verdict["action"]), flags, doc)
