"""Regenerate the console screenshots in screenshots/ (SVG) from a seeded simulated run.

    python scripts/make_screenshots.py          # rewrite screenshots/*.svg
    python scripts/make_screenshots.py --check  # exit 1 if any committed screenshot is stale

Every number on a picture is computed by kvtop: the simulated engine (`kvtop demo`'s
preemption-storm preset, seed 1) runs for RUN_S simulated seconds, its /metrics page is scraped
through the vLLM adapter once a second, and the records go through the real ``Core`` and the real
live analysis (``kvtop.analysis.live.LiveAnalyzer``) whose verdict the Advisor shows. The GPU and
host rows come from the same engine: a simulated GPU whose memory is the model's weights plus the
engine's preallocated KV pool and whose PCIe traffic is the engine's swap traffic, and a host whose
pinned memory is the engine's swap pool in use. With a fixed wall-clock stamp two runs produce
byte-identical files; tests/test_tui_screenshots.py runs the check and tests/test_tui_snapshots.py
compares the same scenes.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "screenshots"
FIXED_TAKEN_AT = "2026-01-01T00:00:00Z"
PRESET = "preemption-storm"
SEED = 1
RUN_S = 300.0
GIB = 1 << 30


@dataclass(frozen=True)
class Scene:
    name: str
    caption: str
    press: tuple[str, ...] = ()
    size: tuple[int, int] = (160, 45)
    theme: str | None = None


SCENES: tuple[Scene, ...] = (
    Scene("overview", "1 Overview: GPU, host and engine panels over history charts (KV, ITL with spikes by "
          "cause, preemptions/s, queue, TTFT, tokens/s, GPU memory and PCIe vs link, host pinned memory)"),
    Scene("requests", "2 Requests: live table, worst gap first", press=("2",)),
    Scene("detail", "3 Request detail: token timeline, spikes with cause, engine events", press=("2", "enter")),
    Scene("advisor", "4 Advisor: verdict, numbers, settings, what would change it", press=("4",)),
    Scene("events", "5 Events: preemption bursts, verdict changes", press=("5",)),
    Scene("help", "? Help: generated from the key bindings", press=("question_mark",)),
    Scene("overview-80x24", "80x24: panels collapse to one line each, charts below", size=(80, 24)),
    Scene("requests-80x24", "80x24 Requests: age, class and tokens give way to preempt and last cause",
          press=("2",), size=(80, 24)),
    Scene("overview-low", "--theme kvtop-low: the terminal's own 16 colours (SSH, tmux)", size=(120, 36),
          theme="kvtop-low"),
)


def simulated_core(preset: str = PRESET, seed: int = SEED, seconds: float = RUN_S) -> Any:
    """A ``Core`` fed by a seeded simulation of ``preset`` with the live analysis attached."""
    from kvtop.analysis.live import LiveAnalyzer
    from kvtop.core import Core
    from kvtop.model.records import EngineRecord, GpuRecord, HostRecord, Record
    from kvtop.sim.simulate import Simulation
    from kvtop.sim.workload import load_preset

    wl = load_preset(preset)
    e = wl.engine
    core = Core(window_s=60.0, itl_target_s=e.itl_target_s, source_label=f"demo {wl.name}",
                analysis=LiveAnalyzer(itl_target_s=e.itl_target_s, adapter="vllm", model=e.model,
                                      kv_bytes_per_token=e.bytes_per_token))
    # An 8B model in bf16 on an 80 GB card: weights + the KV pool the engine preallocates.
    weights = 16 * 10**9
    pool = e.num_gpu_blocks * e.block_bytes
    state: dict[str, Any] = {"prev": None}
    sim: Simulation | None = None

    def emit(rec: Record) -> None:
        core.ingest(rec)
        if isinstance(rec, EngineRecord) and sim is not None:
            off = sim.engine.stats.offload_bytes
            prev = state["prev"]
            dt = rec.t - prev[0] if prev else 0.0
            tx = (off["GPU_to_CPU"] - prev[1]) / dt if prev and dt > 0 else None
            rx = (off["CPU_to_GPU"] - prev[2]) / dt if prev and dt > 0 else None
            state["prev"] = (rec.t, off["GPU_to_CPU"], off["CPU_to_GPU"])
            core.ingest(GpuRecord(rec.t, 0, name="sim GPU (80 GB profile)", mem_used_bytes=weights + pool + GIB,
                                  mem_total_bytes=80 * GIB, pcie_tx_bytes_per_s=tx, pcie_rx_bytes_per_s=rx,
                                  pcie_source="simulated", pcie_link_gen=5, pcie_link_width=16,
                                  pcie_link_gen_max=5, pcie_link_width_max=16))
            swapped = int(sim.engine.host_used * e.block_bytes)  # KV blocks parked in host memory
            core.ingest(HostRecord(rec.t, mem_total_bytes=256 * GIB, mem_available_bytes=200 * GIB - swapped,
                                   pinned_bytes=swapped, pinned_signal="simulated swap pool"))

    sim = Simulation(wl, seed=seed, duration_s=seconds, emit=emit)
    sim.run()
    return core


_CORE: Any = None


def build_app(scene: Scene) -> Any:
    from kvtop.views.tui.app import KvtopApp

    global _CORE
    if _CORE is None:
        _CORE = simulated_core()
    # each scene gets its own copy: a console adds events to the core it shows
    # an hour-long interval: nothing re-renders between the keys and the capture
    return KvtopApp(copy.deepcopy(_CORE), title="kvtop demo: preemption-storm", theme=scene.theme, interval=3600,
                    taken_at=FIXED_TAKEN_AT)


async def render(scene: Scene) -> str:
    app = build_app(scene)
    # a tab switch animates its underline: captured mid-way, the same scene differed between runs
    # (the detail tab's bar, twice, in the full test suite)
    app.animation_level = "none"
    async with app.run_test(size=scene.size) as pilot:
        await pilot.pause()
        for key in scene.press:
            await pilot.press(key)
            await pilot.pause()
        await pilot.pause()
        return app.export_screenshot(title=f"kvtop — {scene.name}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 when stale")
    args = ap.parse_args(argv)
    stale = []
    OUT.mkdir(exist_ok=True)
    for sc in SCENES:
        svg = asyncio.run(render(sc))
        path = OUT / f"{sc.name}.svg"
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != svg:
                stale.append(path.name)
        else:
            path.write_text(svg, encoding="utf-8")
            print(f"wrote {path.relative_to(REPO)}")
    if stale:
        print("stale screenshots (run python scripts/make_screenshots.py): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
