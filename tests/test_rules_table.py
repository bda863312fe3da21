"""docs/rules.md shows the rules table that the rules' data generates (kvtop/analysis/attribution/rules.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvtop.analysis.attribution.rules import markdown

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "rules.md"
BEGIN, END = "<!-- rules-table:begin -->", "<!-- rules-table:end -->"
REGENERATE = "run `python -m kvtop.analysis.attribution --markdown` and paste its output"


def test_docs_rules_table_is_the_generated_one():
    assert DOC.is_file(), f"{DOC} is missing: {REGENERATE} between {BEGIN} and {END}"
    text = DOC.read_text(encoding="utf-8")
    assert text.count(BEGIN) == 1 and text.count(END) == 1, f"{DOC} needs one {BEGIN} ... {END} pair"
    shown = text.split(BEGIN, 1)[1].split(END, 1)[0]
    assert shown.strip() == markdown().strip(), f"{DOC}'s rules table differs from the rules' data: {REGENERATE}"


def test_the_generator_prints_one_row_per_rule_in_order():
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "kvtop.analysis.attribution", "--markdown"],
                       capture_output=True, text=True, check=True, env=env)
    out = p.stdout
    assert out == markdown() and p.stderr == ""
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| order")]
    assert [r.split(" | ")[0] for r in rows] == [f"| {i}" for i in range(1, 22)]
    # the engine's own log first: where a witness covers the stall, nothing is inferred
    assert rows[0].startswith("| 1 | `witness` | as logged (`witness`, `witness-ambiguous`) | any stall |")
    assert rows[0].endswith("| 1.000 (read, not inferred) |")
    assert rows[1].startswith("| 2 | `reported` | preemption (`reported`) | any stall |")
    assert [r.split(" | ")[1] for r in rows[2:5]] == ["`host`", "`delivery-continued`", "`delivery`"]
    # then the engine's own gauges putting the stream in the queue: before any inferred cause
    assert rows[5].split(" | ")[1:3] == ["`queued`", "preemption (`queued`)"]
    assert rows[-1].endswith("| `unknown/shared` 0.350 |")


def test_every_threshold_in_the_rules_table_is_a_number_not_its_expression():
    # a text part that lost its f prefix shows "{_pct(prefill.PACE_NEAR)}" where "95 %" belongs
    assert "{" not in markdown() and "}" not in markdown()
