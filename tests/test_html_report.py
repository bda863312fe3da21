"""`kvtop analyze TRACE --html FILE`: a self-contained page with the verdict, the causes, the
history charts and the per-request timelines, checked by structure and in a real headless Chromium."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
from array import array
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from kvtop.cli import main
from kvtop.model.analysis import AnalysisReport, RequestRow, SpikeView
from kvtop.picture import Picture, StreamSpan
from kvtop.snapshot import HistoryWindow, Samples
from kvtop.views.html import CAUSE_STYLE, MAX_TIMELINES, render_html
from testkit.png import decode


class _Tags(HTMLParser):
    """Every start tag with its attributes, and the page's text."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def _parse(page: str) -> _Tags:
    p = _Tags()
    p.feed(page)
    return p


@pytest.fixture(scope="module")
def storm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A simulated preemption storm (34 requests, 17 preemption spikes), its HTML page and its JSON report."""
    d = tmp_path_factory.mktemp("html")
    trace = d / "storm.jsonl"
    assert main(["simulate", "--preset", "preemption-storm", "--seed", "1", "--duration", "40", "-o", str(trace)]) == 0
    out = d / "report.html"
    assert main(["analyze", str(trace), "--html", str(out), "--format", "json"]) == 0
    return trace, out.read_text(encoding="utf-8")


def _json_report(trace: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    capsys.readouterr()
    assert main(["analyze", str(trace), "--format", "json"]) == 0
    rep: dict[str, object] = json.loads(capsys.readouterr().out)
    return rep


def test_page_shows_the_same_verdict_causes_and_requests_as_the_json(storm, capsys) -> None:
    trace, page = storm
    rep = _json_report(trace, capsys)
    verdict = rep["verdict"]
    assert isinstance(verdict, dict)
    p = _parse(page)
    text = " ".join(p.text)
    # the verdict's action as the headline, and the numbers it used with their sources
    assert verdict["action"] == "admission"
    assert re.search(r'<span class="action">ADMISSION</span>', page)
    assert "confidence 0.99" in text
    for flag in verdict["settings"]:
        assert flag["flag"] in text
    assert "preempted_peak" in text and "3 sequences" in text
    # the cause table: 17 preemption spikes, 100 %
    causes = rep["causes"]
    assert causes["preemption"]["count"] == 17 == rep["spikes_total"]
    row = re.search(r'<tr data-cause="preemption">(.*?)</tr>', page)
    assert row is not None and ">17<" in row.group(1) and "100.0%" in row.group(1)
    # one timeline per request that streamed (34 < the bound), each spike drawn on its request's row
    rows = [a for t, a in p.tags if t == "g" and a.get("class") == "timeline"]
    assert len(rows) == sum(1 for r in rep["requests"] if r["tokens"]) == 34
    assert {a["data-request"] for a in rows} == {r["request_id"] for r in rep["requests"]}
    spiked = {s["request_id"] for s in rep["spikes"]}
    for rid in spiked:
        seg = page.split(f'data-request="{rid}"', 1)[1].split("</g>", 1)[0]
        assert seg.count('data-cause="preemption"') == sum(1 for s in rep["spikes"] if s["request_id"] == rid)
    # the history charts, drawn from the trace's engine scrapes
    ids = {a.get("id") for t, a in p.tags if t == "svg"}
    assert {"chart-kv", "chart-queue", "chart-preempt", "chart-gaps", "timelines"} <= ids
    kv = page.split('id="chart-kv"', 1)[1].split("</svg>", 1)[0]
    assert kv.count("<polyline") >= 1 and "no engine scrapes" not in kv


def test_causes_have_a_legend_with_distinct_colours_and_shapes(storm) -> None:
    _, page = storm
    legend = page.split('id="legend"', 1)[1].split("</div>", 1)[0]
    for cause, st in CAUSE_STYLE.items():
        assert f'data-cause="{cause}"' in legend and st.label in legend and st.colour in legend
    assert len({s.colour for s in CAUSE_STYLE.values()}) == len(CAUSE_STYLE)
    assert len({s.shape for s in CAUSE_STYLE.values()}) == len(CAUSE_STYLE)  # told apart without colour
    # the legend's glyph elements differ by cause, not only by fill
    elems = {c: re.search(rf'<(polygon|rect|circle|path)[^>]*data-cause="{c}"', legend).group(1)  # type: ignore[union-attr]
             for c in CAUSE_STYLE}
    assert elems["preemption"] == "polygon" and elems["prefill_interference"] == "rect" and elems["unknown"] == "circle"


def test_page_loads_nothing_from_anywhere(storm) -> None:
    _, page = storm
    p = _parse(page)
    assert not [t for t, _ in p.tags if t in ("script", "link", "img", "iframe", "object", "embed")]
    for _, attrs in p.tags:
        for k in ("src", "href", "srcset", "xlink:href", "action"):
            assert k not in attrs
    assert "url(" not in page and "@import" not in page
    assert not re.search(r"https?://", page)


def _picture(n: int) -> Picture:
    """A picture of ``n`` requests over 100 s: request i streams from i to i + 5 s; every third
    one has a gap of (i / 100) s with a rotating cause."""
    causes = list(CAUSE_STYLE)
    spans, rows, spikes = [], [], []
    for i in range(n):
        rid = f"req-{i:03d}"
        spans.append(StreamSpan(rid, float(i), i + 0.2, i + 5.0, i + 5.0, "finish", 100))
        gap = i / 100 if i % 3 == 0 else 0.01
        if i % 3 == 0:
            spikes.append(SpikeView(rid, i + 1.0, i + 1.0 + gap, gap, causes[i % 4], None, 0.8))
        rows.append(RequestRow(rid, 1 if i % 3 == 0 else 0, 0, gap, 100))
    rep = AnalysisReport(itl_target_s=0.005, gaps=n * 99, spikes=tuple(spikes), spikes_total=len(spikes),
                         requests=tuple(rows))
    kv = Samples(array("d", [float(t) for t in range(101)]), array("d", [t / 100 for t in range(101)]))
    hist = HistoryWindow(engines={("http://e:8000", "0"): {"kv_usage": kv}})
    return Picture("t.jsonl", rep, hist, tuple(spans), 0.0, 100.0)


def test_timelines_are_bounded_and_keep_the_worst_requests() -> None:
    page = render_html(_picture(120))
    rows = re.findall(r'<g class="timeline" data-request="([^"]+)"', page)
    assert len(rows) == MAX_TIMELINES
    # the 40 spiked requests (every third of 120) with the longest gaps, in arrival order
    assert rows == [f"req-{i:03d}" for i in range(0, 120, 3)]
    assert f"{MAX_TIMELINES} of 120 requests shown" in page
    # and the engine's URL is a label, never a link
    assert "href" not in page


def test_a_trace_without_engine_scrapes_says_so() -> None:
    pic = _picture(3)
    page = render_html(Picture(pic.source, pic.report, HistoryWindow(), pic.streams, 0.0, 10.0))
    assert "What this analysis could not see" in page
    assert "no engine scrapes: the KV usage, queue and preemption charts are empty" in page
    assert "no engine scrapes in this trace (no KV usage to draw)" in page


def test_html_errors_are_one_line_exit_2(storm, tmp_path, capsys) -> None:
    trace, _ = storm
    capsys.readouterr()
    assert main(["analyze", str(trace), "--html", str(tmp_path / "no" / "such" / "dir.html")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvtop: error: cannot write")
    assert main(["analyze", "--prometheus", "http://127.0.0.1:9", "--html", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--html" in err[0]


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it: "
                                             "apt-get install --no-install-recommends chromium)")
def test_chromium_renders_the_page(storm, tmp_path) -> None:
    """A real headless Chromium draws the page offline: the screenshot holds the cause colour, the
    chart lines and text, not a blank or an error page (2,400 px tall: the storm's verdict, with its
    KV-capacity reasons, fills the first 2,000)."""
    _, page = storm
    html = tmp_path / "report.html"
    html.write_text(page, encoding="utf-8")
    png = tmp_path / "shot.png"
    with tempfile.TemporaryDirectory() as profile:
        r = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                            "--disable-component-update", "--disable-sync", "--no-first-run",
                            f"--user-data-dir={profile}", f"--screenshot={png}", "--window-size=1280,2400",
                            html.as_uri()], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    data = png.read_bytes()
    assert len(data) > 50_000
    img = decode(data)
    assert img.shape[:2] == (2400, 1280)
    rgb = img[:, :, :3].reshape(-1, 3)
    colours = np.unique(rgb, axis=0)
    assert len(colours) > 500  # text antialiasing, charts and glyphs, not a flat page
    white = (rgb == 255).all(axis=1).mean()
    assert 0.3 < white < 0.95

    def pixels(hex_colour: str) -> int:
        c = [int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)]
        return int((rgb == c).all(axis=1).sum())

    assert pixels(CAUSE_STYLE["preemption"].colour) > 200  # the preemption spikes' blocks and glyphs
    assert pixels("#1F4E79") > 300  # the engine's KV usage, queue and preemption lines
