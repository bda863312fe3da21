"""The typed analysis report (kvtop.model.analysis) against the JSON it stands for.

Reports come from simulated traces (a preemption storm, prefill interference, a healthy run) and
from the same traces with every request record removed (the aggregate basis). What is checked:
the JSON the commands print reads back into the same typed report and writes out byte for byte
again, a Snapshot holding the report validates against the documented schema, and the typed
fields say what the JSON says.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import jsonschema
import pytest

from kvtop import __version__
from kvtop.analysis.live import LiveAnalyzer
from kvtop.analysis.report import render_report_text
from kvtop.analysis.scan import analyze_trace
from kvtop.core import Core
from kvtop.model.analysis import AnalysisReport, Decision, Number, SpikeView, Verdict
from kvtop.model.records import from_dict
from kvtop.model.sanitize import output_json
from kvtop.model.trace import TraceReader
from kvtop.sim import simulate as sim
from kvtop.sim import workload

SCHEMA = json.loads((Path(__file__).resolve().parents[1] / "kvtop" / "schemas" / "snapshot.schema.json").read_text())
CASES = [("preemption-storm", 40.0), ("prefill-interference", 30.0), ("healthy", 20.0)]


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("reports")
    out = {}
    for preset, dur in CASES:
        p = d / f"{preset}.jsonl"
        sim.simulate_to_trace(workload.load_preset(preset), 1, dur, str(p))
        out[preset] = p
        agg = d / f"{preset}-aggregate.jsonl"
        lines = p.read_text().splitlines(keepends=True)
        agg.write_text("".join(line for line in lines if json.loads(line).get("kind") != "request"))
        out[preset + "-aggregate"] = agg
    return out


@pytest.mark.parametrize("name", [c[0] for c in CASES] + [c[0] + "-aggregate" for c in CASES])
def test_printed_json_reads_back_into_the_same_report(traces, name, kvtop_cli):
    r = kvtop_cli("analyze", str(traces[name]), "--format", "json")
    assert r.returncode == 0, r.stderr
    rep = AnalysisReport.from_dict(json.loads(r.stdout))
    # the typed report writes out exactly what `kvtop analyze` printed
    assert json.dumps(rep.to_json(__version__), indent=1, allow_nan=False) + "\n" == r.stdout
    # and the command's report is the one the library builds, its floats rounded for output
    built = analyze_trace(str(traces[name])).finite()
    assert rep == AnalysisReport.from_dict(output_json(built.to_dict()))
    assert rep.basis == ("aggregate" if name.endswith("-aggregate") else "requests")
    # text rendered from the typed report is what `kvtop analyze` prints
    text = kvtop_cli("analyze", str(traces[name])).stdout
    assert text == render_report_text(built) + "\n"


def test_typed_fields_say_what_the_json_says(traces):
    rep = analyze_trace(str(traces["preemption-storm"]))
    d = rep.to_dict()
    assert rep.spikes_total == d["spikes_total"] > 0 and d["spikes_listed"] == len(rep.spikes)
    assert rep.causes["preemption"].count == d["causes"]["preemption"]["count"] > 0
    assert [(s.request_id, s.cause, s.gap_s) for s in rep.spikes] == \
        [(s["request_id"], s["cause"], s["gap_s"]) for s in d["spikes"]]
    assert all(isinstance(s, SpikeView) and s.evidence for s in rep.spikes)
    v = rep.verdict
    assert v is not None and v.action == d["verdict"]["action"] != "insufficient_data"
    # the gates that decided are typed, and the JSON keeps them as a number of the verdict
    assert v.decided_by and all(isinstance(g, Decision) for g in v.decided_by)
    assert [g.gate for g in v.decided_by] == [g["gate"] for g in d["verdict"]["numbers"]["decided_by"]["value"]]
    assert v.value("itl_target") == pytest.approx(0.1) == d["verdict"]["numbers"]["itl_target"]["value"]
    assert v.value("no_such_number") is None


def test_live_snapshot_carries_the_typed_report_and_validates(traces):
    core = Core(analysis=LiveAnalyzer(itl_target_s=0.1, adapter="vllm"))
    reader = TraceReader(str(traces["preemption-storm"]))
    for d in reader.dicts():
        rec = from_dict(d)
        if rec is not None:
            core.ingest(rec)
    reader.close()
    snap = core.snapshot(core.now + 30)  # every spike's evidence window has passed
    assert isinstance(snap.analysis, AnalysisReport)
    assert snap.analysis.pending_spikes == 0 and snap.analysis.spikes_total > 0
    doc = snap.to_json()
    jsonschema.validate(doc, SCHEMA)
    assert doc["analysis"] == output_json(snap.analysis.to_dict())
    assert doc["analysis"]["pending_spikes"] == 0  # the live report says how many still wait
    assert "pending_spikes" not in analyze_trace(str(traces["preemption-storm"])).to_dict()  # a batch one does not


def test_unknown_numbers_stay_in_the_report_and_are_null_in_json():
    verdict = Verdict("no_action", numbers={"decode_step": Number(math.nan, "s", "measured")})
    rep = AnalysisReport(median_gap_s=math.inf, verdict=verdict)
    assert math.isinf(rep.median_gap_s)
    clean = rep.finite()
    assert clean.median_gap_s is None and clean.verdict is not None and clean.verdict.value("decode_step") is None
    assert json.loads(json.dumps(clean.to_dict(), allow_nan=False))["verdict"]["numbers"]["decode_step"] == \
        {"value": None, "unit": "s", "source": "measured"}
