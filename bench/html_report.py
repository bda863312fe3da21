"""What `kvtop analyze --html` costs beside a plain `kvtop analyze`, on a simulated incident.

Simulates a preemption storm (`kvtop simulate`, seeded), then times in this process, best of
``--repeat`` runs each:
  * analyze: ``analyze_trace`` (the report `kvtop analyze` prints);
  * picture: ``picture_trace`` (the same report plus the history series and stream spans, one pass);
  * render: ``render_html`` of that picture;
and prints seconds, the ratio (picture + render) / analyze, and the page's size.

    python -m bench.html_report [--duration 600] [--repeat 3]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from kvtop.analysis.scan import analyze_trace, picture_trace
from kvtop.cli import main as kvtop
from kvtop.views.html import render_html


def _best(fn, repeat: int) -> tuple[float, object]:  # noqa: ANN001
    best, out = float("inf"), None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=600.0, help="simulated seconds (default 600)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        trace = str(Path(d) / "storm.jsonl")
        assert kvtop(["simulate", "--preset", "preemption-storm", "--seed", "1", "--duration", str(args.duration),
                      "-o", trace]) == 0
        size = Path(trace).stat().st_size
        t_an, _ = _best(lambda: analyze_trace(trace), args.repeat)
        t_pic, pic = _best(lambda: picture_trace(trace), args.repeat)
        t_ren, page = _best(lambda: render_html(pic), args.repeat)  # type: ignore[arg-type]
    print(f"trace: {size / 1e6:.1f} MB, {args.duration:g} simulated s")
    print(f"analyze            {t_an:7.3f} s")
    print(f"picture (1 pass)   {t_pic:7.3f} s")
    print(f"render_html        {t_ren:7.3f} s   page {len(str(page)) / 1e3:.0f} kB")
    print(f"--html / plain     {(t_pic + t_ren) / t_an:7.2f} x")


if __name__ == "__main__":
    main()
