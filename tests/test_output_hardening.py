"""Every JSON kvtop prints is finite by construction and no NaN reaches a traceback or a "nan ms"
(issue 14 items 3 and 6)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import REPO, run_kvtop
from replay_server import PROM, replay_server
from vllm_pages import vllm_page

from kvtop.model.records import EngineRecord, Histogram
from kvtop.model.trace import TraceWriter, make_header

SCENARIOS = REPO / "tests" / "scenarios"


def _strict(text: str):
    """json.loads that refuses NaN/Infinity, as jq and most parsers do."""
    def no(name):
        raise AssertionError(f"{name} in output")
    return json.loads(text, parse_constant=no)


def _nan_itl(page: str) -> str:
    return re.sub(r"^(vllm:inter_token_latency_seconds_(?:bucket|count)\{[^}]*\}) \S+$", r"\1 NaN", page, flags=re.M)


def test_snapshot_with_nan_itl_histogram_reports_without_traceback():
    pages = [vllm_page(generation=100, itl={"0.025": 10}), _nan_itl(vllm_page(generation=300, itl={"0.025": 20}))]
    with replay_server({"/metrics": (pages, PROM)}) as (base, _):
        for fmt in ("json", "text"):
            r = run_kvtop("snapshot", "--url", base, "--duration", "0.6", "--interval", "0.2", "--format", fmt,
                          "--no-gpu", "--no-host")
            assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
            if fmt == "json":
                (e,) = _strict(r.stdout)["engines"]
                assert e["up"] is True and e["generation_tokens_per_s"] is not None
            else:
                assert "nan" not in r.stdout.lower()


def _engine_only_trace(path: Path) -> Path:
    """A trace with engine scrapes only (the histogram-delta fallback), the ITL histogram NaN midway."""
    with TraceWriter(path, make_header(engine={"adapter": "vllm"})) as w:
        cum = 0.0
        for i in range(30):
            cum += 50 + (i % 7) * 20
            h = Histogram([(0.025, cum * 0.9), (0.5, cum * 0.97), (float("inf"), cum)], cum, cum * 0.03)
            if i == 15:
                h = Histogram([(0.025, float("nan")), (0.5, float("nan")), (float("inf"), float("nan"))],
                              float("nan"), float("nan"))
            w.write(EngineRecord(t=float(i), adapter="vllm", url="http://e:8000", engine="0", kv_usage=0.99,
                                 preemptions_total=float(i // 3), prompt_tokens_total=1000.0 * i,
                                 generation_tokens_total=cum, running=8, itl=h))
    return path


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_analyze_with_nan_histogram_is_finite(tmp_path, fmt):
    r = run_kvtop("analyze", str(_engine_only_trace(tmp_path / "t.jsonl")), "--format", fmt)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    if fmt == "json":
        _strict(r.stdout)
    assert not re.search(r"\bnan\b|\binf\b", r.stdout, re.I)


@pytest.mark.parametrize("value", ["NaN", "Infinity", "1e400", "1e300", "1000000000000000000000000000000"])
def test_scenario_with_non_finite_number_is_refused(tmp_path, value):
    text = (SCENARIOS / "S1.json").read_text()
    bad = re.sub(r'"tokens_per_s": [0-9.e]+', f'"tokens_per_s": {value}', text, count=1)
    assert bad != text
    p = tmp_path / "s.json"
    p.write_text(bad)
    r = run_kvtop("advise", "--scenario", str(p), "--format", "json")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert "tokens_per_s" in r.stderr or value in r.stderr


def test_advise_json_is_strict_json_for_every_shipped_scenario():
    for s in sorted(SCENARIOS.glob("*.json")):
        r = run_kvtop("advise", "--scenario", str(s), "--format", "json")
        assert r.returncode == 0, r.stderr
        _strict(r.stdout)


def test_scenario_with_unknown_kv_dtype_is_a_one_line_error(tmp_path):
    doc = json.loads((SCENARIOS / "S1.json").read_text())
    doc["kv_dtype"] = "fp7"
    p = tmp_path / "s.json"
    p.write_text(json.dumps(doc))
    r = run_kvtop("advise", "--scenario", str(p))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "fp7" in r.stderr, r.stderr
