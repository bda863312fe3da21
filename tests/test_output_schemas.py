"""The JSON kvtop prints for scripts carries its version and schema name, and validates against the
schema shipped in kvtop/schemas/: `analyze --format json`, `replay --format json` (a snapshot) and
the agent's GET /report, each produced from a seeded simulated run with the real analysis."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import httpx
import jsonschema
import pytest
from conftest import REPO, run_kvtop

from kvtop import __version__

SCHEMAS = REPO / "kvtop" / "schemas"


def _schema(name: str) -> dict:
    schema = json.loads((SCHEMAS / name).read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator.check_schema(schema)
    return schema


def _validate(doc: dict, name: str) -> None:
    jsonschema.Draft202012Validator(_schema(name)).validate(doc)


@pytest.fixture(scope="module")
def storm_trace(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("storm") / "storm.jsonl"
    r = run_kvtop("simulate", "--preset", "preemption-storm", "--seed", "1", "--duration", "40", "-o", str(out))
    assert r.returncode == 0, r.stderr
    return out


def _floats(doc: object) -> list[float]:
    if isinstance(doc, float):
        return [doc]
    if isinstance(doc, dict):
        return [x for v in doc.values() for x in _floats(v)]
    if isinstance(doc, list):
        return [x for v in doc for x in _floats(v)]
    return []


def test_analyze_json_is_versioned_typed_and_rounded(storm_trace):
    r = run_kvtop("analyze", str(storm_trace), "--format", "json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["kvtop_version"] == __version__ and doc["schema"] == "kvtop-analysis/1"
    _validate(doc, "analysis.schema.json")
    assert doc["verdict"]["action"] in ("admission", "recompute", "swap") and doc["spikes"]
    # no float noise: every number as printed has at most 12 significant digits
    digits = [len(re.sub(r"[^0-9]", "", repr(x).split("e")[0]).strip("0")) for x in _floats(doc)]
    assert digits and max(digits) <= 12
    # the analysis object is typed: a spike without its cause, or a verdict with an unknown action, fails
    broken = json.loads(r.stdout)
    del broken["spikes"][0]["cause"]
    with pytest.raises(jsonschema.ValidationError):
        _validate(broken, "analysis.schema.json")
    broken = json.loads(r.stdout)
    broken["verdict"]["action"] = "reboot"
    with pytest.raises(jsonschema.ValidationError):
        _validate(broken, "analysis.schema.json")


def test_replay_json_is_a_versioned_snapshot_whose_analysis_is_typed(storm_trace):
    r = run_kvtop("replay", str(storm_trace), "--headless", "--format", "json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["kvtop_version"] == __version__ and doc["schema"] == "kvtop-snapshot/1"
    _validate(doc, "snapshot.schema.json")
    assert doc["analysis"]["spikes"]
    doc["analysis"]["spikes"][0]["gap_s"] = "long"
    with pytest.raises(jsonschema.ValidationError):
        _validate(doc, "snapshot.schema.json")


def test_the_snapshot_and_fleet_schemas_carry_the_analysis_schema_unchanged():
    analysis = _schema("analysis.schema.json")
    for other in ("snapshot.schema.json", "fleet-analysis.schema.json"):
        defs = _schema(other)["$defs"]
        for name, definition in analysis["$defs"].items():
            assert defs[name] == definition, (other, name)


def test_the_fleet_analysis_is_versioned_and_valid(storm_trace, tmp_path):
    """`analyze --prometheus`'s JSON: each instance's report is the aggregate analysis (here of the
    storm without its request records, as Prometheus would hold it); tests/test_prometheus_real.py
    validates the command's output against a real Prometheus."""
    from kvtop.analysis.scan import analyze_trace
    from kvtop.sources.promfleet import AGENT_NOTE, FleetAnalysis, InstanceAnalysis

    agg = tmp_path / "aggregate.jsonl"
    agg.write_text("".join(line for line in storm_trace.read_text().splitlines(keepends=True)
                           if json.loads(line).get("kind") != "request"))
    rep = analyze_trace(str(agg)).finite()
    assert rep.basis == "aggregate"
    fleet = FleetAnalysis("http://127.0.0.1:9090", 1.0e9, 1.0e9 + 40, 1.0, AGENT_NOTE, (
        InstanceAnalysis("vllm", "10.0.0.7:8000", "vllm", 40, None, rep),
        InstanceAnalysis("vllm", "10.0.0.8:8000", None, 0, "no engine metrics", None)))
    doc = json.loads(json.dumps(fleet.to_json(__version__)))
    assert doc["kvtop_version"] == __version__ and doc["schema"] == "kvtop-fleet-analysis/1"
    _validate(doc, "fleet-analysis.schema.json")
    doc["instances"][0]["report"]["causes"]["preemption"]["share"] = 2.0
    with pytest.raises(jsonschema.ValidationError):
        _validate(doc, "fleet-analysis.schema.json")


def test_the_agent_report_is_versioned_and_valid(storm_trace):
    from kvtop.agent import Agent, AgentOptions
    from kvtop.model.trace import TraceReader
    from kvtop.pipeline import SourceOptions, make_core
    from kvtop.views.exporter import AgentMetrics

    core = make_core("agent", 0.1, adapter="vllm")
    reader = TraceReader(storm_trace)
    for rec in reader.records():
        core.ingest(rec)
    reader.close()
    opts = AgentOptions(sources=SourceOptions(urls=("http://127.0.0.1:8000",)), listen=("127.0.0.1", 0))
    agent = Agent(opts, core, runner=None, metrics=AgentMetrics("127.0.0.1:8000"))  # type: ignore[arg-type]

    async def fetch() -> dict:
        await agent.start_http()
        try:
            async with httpx.AsyncClient() as client:
                return (await client.get(f"{agent.url}/report", timeout=10)).json()
        finally:
            assert agent._app_runner is not None and agent._http is not None
            await agent._http.close()
            await agent._app_runner.cleanup()

    doc = asyncio.run(fetch())
    assert doc["kvtop_version"] == __version__ and doc["schema"] == "kvtop-agent-report/1"
    _validate(doc, "agent-report.schema.json")
    assert doc["spikes_by_cause"].get("preemption", 0) > 0 and doc["verdict"]["action"] is not None


def test_the_agent_report_says_nothing_of_a_down_engines_state(storm_trace):
    # /metrics drops a dead engine's gauges; /report showed its last KV usage, rate and ITL as now
    from kvtop.agent import Agent, AgentOptions
    from kvtop.model.records import EngineRecord
    from kvtop.model.trace import TraceReader
    from kvtop.pipeline import SourceOptions, make_core
    from kvtop.views.exporter import AgentMetrics

    core = make_core("agent", 0.1, adapter="vllm")
    reader = TraceReader(storm_trace)
    url = None
    for rec in reader.records():
        core.ingest(rec)
        if isinstance(rec, EngineRecord):
            url, t = rec.url, rec.t
    reader.close()
    opts = AgentOptions(sources=SourceOptions(urls=("http://127.0.0.1:8000",)), listen=("127.0.0.1", 0))
    agent = Agent(opts, core, runner=None, metrics=AgentMetrics("127.0.0.1:8000"))  # type: ignore[arg-type]
    (up,) = agent.report()["engines"]
    assert up["up"] and up["kv_usage"] is not None and up["itl_p99_s"] is not None
    core.ingest(EngineRecord(t=t + 1.0, adapter="vllm", url=url, up=False, warnings=["connection refused"]))
    (down,) = agent.report()["engines"]
    assert not down["up"] and down["kv_usage"] is None and down["preemptions_per_s"] is None
    assert down["itl_p99_s"] is None and down["preemptions_total"] == up["preemptions_total"]
    _validate(json.loads(json.dumps(agent.report())), "agent-report.schema.json")
