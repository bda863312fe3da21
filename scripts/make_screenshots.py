"""Regenerate the console screenshots in screenshots/ (SVG) from fixed, seeded sample data.

    python scripts/make_screenshots.py          # rewrite screenshots/*.svg
    python scripts/make_screenshots.py --check  # exit 1 if any committed screenshot is stale

The data is ``kvtop.tui.sample`` at a fixed seed with a fixed wall-clock stamp, so two runs
produce byte-identical files; tests/test_tui_screenshots.py runs the check.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "screenshots"


@dataclass(frozen=True)
class Scene:
    name: str
    caption: str
    press: tuple[str, ...] = ()
    size: tuple[int, int] = (120, 36)
    theme: str | None = None
    gpus: int = 2
    engines: int = 1
    requests: int = 12
    extra: dict = field(default_factory=dict)


SCENES: tuple[Scene, ...] = (
    Scene("overview", "1 Overview: GPUs (memory, PCIe vs link capacity), host pinned memory, engines"),
    Scene("requests", "2 Requests: live table, worst gap first", press=("2",)),
    Scene("detail", "3 Request detail: token timeline, spikes with cause, engine events", press=("2", "enter")),
    Scene("advisor", "4 Advisor: verdict, numbers, settings, what would change it", press=("4",)),
    Scene("events", "5 Events: preemption bursts, link down-training, engine restarts", press=("5",)),
    Scene("help", "? Help: generated from the key bindings", press=("question_mark",)),
    Scene("overview-80x24", "80x24: panels collapse to one line each", size=(80, 24), gpus=4, engines=2),
    Scene("overview-low", "--theme kvtop-low: the terminal's own 16 colours (SSH, tmux)", theme="kvtop-low"),
)


def build_app(scene: Scene):
    from kvtop.tui.app import KvtopApp
    from kvtop.tui.sample import FIXED_TAKEN_AT, sample

    s = sample(gpus=scene.gpus, engines=scene.engines, requests=scene.requests, seconds=40, seed=7)
    # an hour-long interval: nothing re-renders between the keys and the capture
    return KvtopApp(s.core, title="kvtop", theme=scene.theme, interval=3600, taken_at=FIXED_TAKEN_AT)


async def render(scene: Scene) -> str:
    app = build_app(scene)
    async with app.run_test(size=scene.size) as pilot:
        await pilot.pause()
        for key in scene.press:
            await pilot.press(key)
            await pilot.pause()
        await pilot.pause()
        return app.export_screenshot(title=f"kvtop — {scene.name}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
