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


async def _screen_80x24(core, press=(), feed=None, title="kvtop"):
    pytest.importorskip("textual")
    from tui_support import screen_text

    from kvtop.feeds.sample import FIXED_TAKEN_AT
    from kvtop.views.tui.app import KvtopApp

    app = KvtopApp(core, feed=feed, title=title, interval=3600, taken_at=FIXED_TAKEN_AT)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        for key in press:
            await pilot.press(key)
            await pilot.pause()
        await pilot.pause()
        return screen_text(app).splitlines()


async def test_at_80x24_no_gpu_is_one_line_and_header_and_chart_titles_are_whole():
    from kvtop.feeds.sample import sample

    s = sample(gpus=0, requests=30, seconds=120)
    s.core.set_gpu_status("none: the engine is simulated")
    lines = await _screen_80x24(s.core, title="kvtop demo: sample")
    assert sum("none: the engine is simulated" in ln for ln in lines) == 1  # no banner repeating it
    # the title, the state, the run clock and the wall clock; the counts went to make room
    assert lines[0].split() == ["kvtop", "demo:", "sample", "●", "live", "t=120s", "00:00:00Z"]
    gpu = next(i for i, ln in enumerate(lines) if "GPUs" in ln)
    assert lines[gpu].strip() == "GPUs none: the engine is simulated" and "host" in lines[gpu + 1]
    legend = next(ln for ln in lines if ln.startswith(" History"))
    assert legend.rstrip().endswith("P preemption F prefill S slow decode ? unknown")
    titles = next(ln for ln in lines if "KV cache usage" in ln)
    # two charts a row: the ITL chart's target shortened to its figure, not cut
    assert titles.rstrip().endswith("┈ 100ms") and "target" not in titles
    assert all(len(ln) <= 80 for ln in lines)


async def test_at_80x24_the_requests_table_keeps_preempt_and_last_cause():
    from kvtop.feeds.sample import sample

    s = sample(gpus=1, requests=30, seconds=120)
    lines = await _screen_80x24(s.core, press=("2",))
    head = next(ln for ln in lines if ln.lstrip().startswith("request"))
    # age and class go first (docs/console.md); the preemption columns stay, whole
    assert head.split()[:2] == ["request", "state"] and head.rstrip().endswith("preempt  last cause")
    assert "age" not in head.split() and "class" not in head.split() and "max gap ▼" in head
    worst = lines[lines.index(head) + 1]
    assert worst.split()[-1] in ("preemption", "prefill_interference", "slow_decode", "unknown", "-")


async def test_the_engine_card_and_the_preemption_chart_quote_the_same_rate():
    # 6 preemptions in the last minute, the last one alone in a 1 s scrape: per scrape that step is
    # 1.00/s, over the minute 0.10/s; the card and the chart title both quote the minute's
    core = Core()
    total = 0.0
    for t in range(0, 121):
        if t > 60 and t % 10 == 0:
            total += 1.0
        core.ingest(EngineRecord(t=float(t), url=URL, adapter="vllm", kv_usage=0.9, preemptions_total=total))
    assert core.snapshot().engines[0].preemptions_per_s == pytest.approx(0.1, abs=0.005)
    lines = await _screen_80x24(core)
    card = next(ln for ln in lines if "preempt " in ln)
    chart = next(ln for ln in lines if "preemptions/s" in ln)
    assert "preempt 0.10/s over 1m" in card and "preemptions/s  0.10/s over 1m" in chart
    assert "1.00/s" not in "\n".join(lines)


async def test_spike_markers_are_letters_that_read_without_colour(monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    pytest.importorskip("textual")
    from tui_support import screen_text

    from kvtop.feeds.sample import FIXED_TAKEN_AT, sample
    from kvtop.views.tui.app import KvtopApp
    from kvtop.views.tui.charts import Chart

    s = sample(gpus=0, requests=30, seconds=120)
    causes = {sp.cause for sp in s.core.snapshot().analysis.spikes}
    assert {"preemption", "prefill_interference"} <= causes
    app = KvtopApp(s.core, interval=3600, taken_at=FIXED_TAKEN_AT)
    async with app.run_test(size=(120, 36)) as pilot:
        await pilot.pause()
        assert app.no_color  # Textual drops the colours under NO_COLOR: the letters must carry it
        itl = next(c for c in app.query(Chart) if c.spec is not None and c.spec.key == "e0itl")
        axis = itl.render_line(itl.size.height - 1).text
        assert "P" in axis and "F" in axis
        assert "P preemption F prefill S slow decode ? unknown" in screen_text(app)


def _trace(path, seconds: float):
    from kvtop.model.trace import TraceWriter, make_header

    with TraceWriter(path, make_header(engine={"adapter": "vllm", "url": URL, "model": "m"})) as w:
        for i in range(int(seconds / 5) + 1):
            w.write(EngineRecord(i * 5.0, "vllm", url=URL, engine="0", model="m", kv_usage=0.5, running=1, waiting=0,
                                 preemptions_total=float(i // 4)))
    return path


@pytest.mark.parametrize(("seconds", "header"), [
    (30, "trace 30.0 s  rates over the last 30.0 s"),
    (600, "trace 600.0 s  rates over the last 60.0 s"),
])
def test_headless_replay_says_how_long_the_trace_is(tmp_path, seconds, header):
    from conftest import run_kvtop

    r = run_kvtop("replay", str(_trace(tmp_path / "t.jsonl", seconds)), "--headless")
    assert r.returncode == 0, r.stderr
    first = r.stdout.splitlines()[0]
    assert header in first and "window 60.0 s" not in first


def test_headless_replay_until_says_where_it_stopped(tmp_path):
    from conftest import run_kvtop

    r = run_kvtop("replay", str(_trace(tmp_path / "t.jsonl", 600)), "--headless", "--until", "45")
    assert r.returncode == 0, r.stderr
    assert "trace 600.0 s, replayed to 45.0 s  rates over the last 45.0 s" in r.stdout.splitlines()[0]


async def test_the_replay_title_stops_saying_live_at_the_end_of_the_trace(tmp_path):
    pytest.importorskip("textual")
    from tui_support import screen_text

    from kvtop.pipeline import replay_feed
    from kvtop.views.tui.app import KvtopApp

    feed = replay_feed(_trace(tmp_path / "t.jsonl", 30), speed=0.0)
    app = KvtopApp(feed.core, feed=feed, interval=0.05, taken_at="2026-01-01T00:00:00Z")
    async with app.run_test(size=(120, 30)) as pilot:
        for _ in range(100):
            await pilot.pause(0.05)
            if feed.done:
                break
        await pilot.pause(0.2)
        top = screen_text(app).splitlines()[0]
        assert feed.done and "■ end of trace" in top and "live" not in top
        await pilot.press("g")
        await pilot.press(*"10", "enter")
        await pilot.pause(0.2)
        assert "● live" in screen_text(app).splitlines()[0]  # back inside the trace


def _incident(core: Core, n: int = 33) -> None:
    """``n`` requests of 10 tokens at 20 ms, each ended by t=60; request k stalls k*0.1 s once."""
    from kvtop.model.records import RequestRecord

    for k in range(n):
        rid = f"r{k:02d}"
        t = float(k)
        core.ingest(RequestRecord(t, rid, "arrive"))
        core.ingest(RequestRecord(t + 0.1, rid, "first_token"))
        for i in range(1, 10):
            stall = k * 0.1 if i > 5 else 0.0  # before the 6th token
            core.ingest(RequestRecord(t + 0.1 + 0.02 * i + stall, rid, "token"))
        core.ingest(RequestRecord(t + 0.3 + k * 0.1, rid, "finish"))


def test_the_worst_stalls_stay_listed_after_they_end():
    from kvtop.core.requests import KEEP_WORST

    core = Core(itl_target_s=0.1, finished_keep_s=30.0)
    _incident(core)
    # two minutes on: every request ended more than finished_keep_s ago
    core.ingest(EngineRecord(t=150.0, url=URL, adapter="vllm", kv_usage=0.1))
    snap = core.snapshot()
    listed = sorted(snap.requests, key=lambda r: -(r.max_gap_s or 0))
    assert len(listed) == KEEP_WORST == 20 and all(r.kept and r.state == "finished" for r in listed)
    # the 20 largest stalls, r32 (3.2 s) down to r13 (1.3 s); none under the 0.1 s target
    assert [r.id for r in listed] == [f"r{k:02d}" for k in range(32, 12, -1)]
    assert listed[0].max_gap_s == pytest.approx(3.2 + 0.02)
    assert snap.finished_total == 33
    # the timeline is still there for the detail screen
    tl = core.request_timeline("r32")
    assert tl is not None and len(tl.tokens) == 10
    # an hour after they ended they go
    core.ingest(EngineRecord(t=60.0 + 3601.0, url=URL, adapter="vllm", kv_usage=0.1))
    assert core.snapshot().requests == ()


async def test_after_an_incident_the_requests_screen_lists_the_worst_stalls():
    core = Core(itl_target_s=0.1, finished_keep_s=30.0)
    _incident(core)
    core.ingest(EngineRecord(t=150.0, url=URL, adapter="vllm", kv_usage=0.1))
    lines = await _screen_80x24(core, press=("2",))
    status = next(ln for ln in lines if "requests" in ln and " of " in ln)
    # 80 columns: the note that explains the * outranks the sort and the keys
    assert status.split()[:13] == ["20", "of", "20", "requests", "*", "20", "ended,", "kept", "as", "the", "hour's",
                                   "worst", "stalls"]
    head = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("request"))
    assert lines[head + 1].split()[:2] == ["r32", "finished*"]


async def test_a_click_on_a_spike_marker_opens_the_worst_request_there():
    pytest.importorskip("textual")
    from tui_support import screen_text

    from kvtop.pipeline import make_core
    from kvtop.views.tui.app import KvtopApp
    from kvtop.views.tui.charts import GUTTER, Chart

    core = make_core("incident", 0.1)
    for t in range(0, 151, 1):  # the engine, scraped every second through the incident
        core.ingest(EngineRecord(t=float(t) - 0.5, url=URL, adapter="vllm", kv_usage=0.5, preemptions_total=0.0))
    _incident(core)
    core.ingest(EngineRecord(t=150.0, url=URL, adapter="vllm", kv_usage=0.5, preemptions_total=0.0))
    spikes = core.snapshot().analysis.spikes
    worst = max(spikes, key=lambda sp: sp.gap_s)
    assert worst.request_id == "r32"
    app = KvtopApp(core, interval=3600, taken_at="2026-01-01T00:00:00Z")
    async with app.run_test(size=(160, 45)) as pilot:
        await pilot.pause()
        itl = next(c for c in app.query(Chart) if c.spec is not None and c.spec.key == "e0itl")
        n = itl.size.width - GUTTER - 1
        x = GUTTER + int((worst.t_end - itl.t0) / ((itl.t1 - itl.t0) / n))
        assert itl.render_line(itl.size.height - 1).text[x] in "PFS?"  # a marker under the column
        await pilot.click(itl, offset=(x, itl.size.height - 1))
        await pilot.pause()
        assert app.view_name == "detail"
        text = screen_text(app)
        assert "r32" in text and "finished" in text and "tokens │" in text  # its timeline, two minutes after it ended
