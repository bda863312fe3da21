"""The compare console (`kvtop tui --replay A --compare B`) on the real vLLM loop pair
(tests/fixtures/loop/SOURCES.md): figures A → B, compare's one line, the charts overlaid."""

from __future__ import annotations

import re
from array import array
from pathlib import Path

import pytest
from conftest import REPO, run_kvtop
from tui_support import screen_text

from kvtop.commands.tui import compare_input
from kvtop.snapshot import Samples
from kvtop.views.tui.compare import CompareApp, held

LOOP = REPO / "tests" / "fixtures" / "loop"
BEFORE, AFTER = LOOP / "vllm-storm-before.jsonl.gz", LOOP / "vllm-storm-after.jsonl.gz"


@pytest.fixture(scope="module")
def pair():
    return compare_input(BEFORE, AFTER, itl_target_s=0.1)


async def test_the_pair_side_by_side_at_80x24(pair):
    app = CompareApp(pair)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        await pilot.pause()
        text = screen_text(app)
        lines = text.splitlines()
        assert "A █ vllm-storm-before.jsonl.gz  B ━ vllm-storm-after.jsonl.gz" in lines[0]
        # kvtop compare's own figures, A → B, two to a line at 80 columns
        assert re.search(r"goodput +0/8 → 5/8 +│ completed +8/8 → 8/8", text), text
        assert re.search(r"p99 TTFT +249ms → 13\.34s", text) and re.search(r"preempt/request +2\.62 → 0\.625", text)
        assert re.search(r"p99 end-to-end +17\.96s → 16\.59s", text) and re.search(r"output tok/s +263 → 288", text)
        # its one line: a trade-off, and how to judge both
        assert "TRADE-OFF better on the ITL contract (goodput 0 -> 5 of 8" in text
        assert "set --ttft-target-ms to judge both" in text.replace("\n ", " ")
        # the charts: each run's peak in the title, A drawn as bars, B as a line, on one axis from 0 s
        itl = next(i for i, line in enumerate(lines) if line.lstrip().startswith("ITL p99"))
        assert "█ A max 41ms  ━ B max 23ms" in lines[itl]
        axis = next(i for i in range(itl, len(lines)) if "└" in lines[i])
        body = "\n".join(lines[itl + 1:axis + 1])
        assert re.search("[▁▂▃▄▅▆▇█]", body) and "━" in body and "└0s" in body, body
        assert max(len(line) for line in lines) <= 80 and len(lines) == 24
        await pilot.press("q")
    assert app.return_code == 0 and not app.is_running


async def test_a_ttft_contract_changes_the_line(tmp_path):
    app = CompareApp(compare_input(BEFORE, AFTER, itl_target_s=0.1, ttft_target_s=2.0))
    async with app.run_test(size=(120, 36)) as pilot:
        await pilot.pause()
        text = screen_text(app)
        assert "IMPROVED goodput 0 -> 1 of 8" in text and "TTFT 2.00s" in text, text
        assert re.search(r"goodput +0/8 → 1/8", text)


def test_held_fills_between_scrapes_not_across_a_silence():
    ring = Samples(array("d", [0.0, 1.0, 2.0, 12.0, 13.0]), array("d", [5.0, 7.0, 1.0, 3.0, 4.0]), origin=9)
    h = held(ring, points=130)
    assert h is not None and h.origin == 9
    cols = h.columns(0.0, 13.0, 26)  # half-second columns: without holding, every other one is empty
    assert cols[:4] == [5.0, 5.0, 7.0, 7.0] and cols[4] == 1.0
    assert cols[6:23] == [None] * 17  # the engine said nothing from 2 s to 12 s: nothing drawn
    assert cols[24] == 3.0 and cols[25] == 4.0
    long = Samples(array("d", range(700)), array("d", [1.0] * 700))
    assert held(long, points=600) is long


def test_compare_screen_snapshot_80x24(snap_compare, pair):
    assert snap_compare(CompareApp(pair), terminal_size=(80, 24))


def test_compare_screen_snapshot_120x36_low_colour(snap_compare, pair):
    assert snap_compare(CompareApp(pair, theme="kvtop-low"), terminal_size=(120, 36))


def test_compare_option_errors_are_one_line(tmp_path: Path):
    for args, msg in ((["tui", "--compare", str(AFTER)], "--compare B needs --replay A"),
                      (["tui", "--replay", str(BEFORE), "--compare", str(tmp_path / "nope.jsonl")], "trace file not found"),
                      (["tui", "--replay", str(BEFORE), "--ttft-target-ms", "2000"], "use it with --replay A --compare B"),
                      (["tui", "--replay", str(BEFORE), "--compare", str(AFTER), "--ttft-target-ms", "0"], "must be > 0"),
                      # no terminal (CI, a pipe): the headless command that gives the same answer
                      (["tui", "--replay", str(BEFORE), "--compare", str(AFTER)], "kvtop compare")):
        r = run_kvtop(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert msg in r.stderr and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_compare_notes_reach_the_result_line(pair):
    """What `kvtop compare` notes beside its outcome (one side served from the prefix cache) is in the
    console's result line too, after the contract; none when compare noted nothing."""
    from kvtop.views.tui.compare import result_text

    doc = dict(pair.figures)
    assert doc["notes"] == [] and "note:" not in result_text(doc)
    doc["notes"] = ["the engine's prefix cache served 97% of A's prompt tokens and 0% of B's"]
    line = result_text(doc)
    assert line.index("(contract: ") < line.index("note: the engine's prefix cache served 97% of A's"), line
