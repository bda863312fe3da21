"""What a new user trying kvtop noticed (issue 25): each test is one of those findings, with the
numbers the user saw."""

from __future__ import annotations

import pytest

from kvtop.core import Core
from kvtop.model.records import EngineRecord

URL = "http://engine:8000"


def _bursts(core: Core) -> list[tuple[str, str]]:
    return [(e.severity, e.message) for e in core.snapshot().events if e.kind == "preemption_burst"]


@pytest.mark.parametrize("step", [0.99, 1.0, 1.01])
def test_one_preemption_is_a_warning_however_the_scrape_interval_fell(step):
    core = Core()
    core.ingest(EngineRecord(t=10.0, url=URL, adapter="vllm", preemptions_total=0.0))
    core.ingest(EngineRecord(t=10.0 + step, url=URL, adapter="vllm", preemptions_total=1.0))
    ((sev, msg),) = _bursts(core)
    assert sev == "warning"
    assert msg == f"{URL}: 1 preemption(s) in {step:.1f}s"


def test_ten_preemptions_in_ten_seconds_is_an_error_one_a_second_or_all_at_once():
    steady = Core()
    for t in range(12):
        steady.ingest(EngineRecord(t=float(t), url=URL, adapter="vllm", preemptions_total=float(t)))
    sev = [s for s, _ in _bursts(steady)]
    # the 10th preemption inside 10 s tips it (1/s sustained); before that each one is a warning
    assert sev[:9] == ["warning"] * 9 and sev[9:] == ["error"] * 2
    burst = Core()
    burst.ingest(EngineRecord(t=0.0, url=URL, adapter="vllm", preemptions_total=0.0))
    burst.ingest(EngineRecord(t=30.0, url=URL, adapter="vllm", preemptions_total=10.0))  # a 30 s scrape
    assert [s for s, _ in _bursts(burst)] == ["error"]


@pytest.mark.parametrize(("cancel_prob", "named"), [(0.0, False), (None, False), (0.25, True)])
def test_the_advisor_names_cancellations_only_when_preempted_requests_were_cancelled(cancel_prob, named):
    from kvtop.model.analysis import AnalysisReport, Number, Verdict
    from kvtop.snapshot import Snapshot
    from kvtop.views.tui.render import advisor

    nums = {"preemptions_per_completed": Number(1.4, "", "measured")}
    if cancel_prob is not None:
        nums["cancel_prob"] = Number(cancel_prob, "", "measured")
    snap = Snapshot(kvtop_version="0", taken_at="2026-01-01T00:00:00Z", t=60.0, window_s=60.0, gpu_status="ok",
                    analysis=AnalysisReport(verdict=Verdict("admission", confidence=0.9, numbers=nums)))
    text = advisor(snap, 120)
    would = text.split("what would change the verdict")[1].splitlines()[1]
    assert ("fewer cancellations of preempted requests (25% now)" in would) is named
    assert "fewer preemptions per request" in would
