"""Console layout (sparklines, bars, severities, the request timeline) and the per-request timeline
accessor, with hand-computed numbers. Number formats: test_units.py."""

from __future__ import annotations

from kvtop.core import TIMELINE_MAX_CHUNKS, Core
from kvtop.model.analysis import SpikeView
from kvtop.model.records import EngineRecord, RequestRecord
from kvtop.snapshot import RequestView
from kvtop.views.tui import fmt

GIB = 1 << 30


def test_spark_scales_to_link_capacity_not_to_the_data():
    # a steady quarter of the link reads as a low line; against its own max it would look full
    assert fmt.spark([15.75e9] * 4, 4, top=63e9) == "▂▂▂▂"
    assert fmt.spark([15.75e9] * 4, 4) == "████"
    # folding 8 samples into 2 columns keeps the burst (max per column)
    assert fmt.spark([0, 0, 0, 10, 0, 0, 0, 0], 2, top=10) == "█ "
    # any traffic at all gets at least the lowest block; none is blank
    assert fmt.spark([1.0, 0.0], 2, top=1e12) == "▁ "
    assert fmt.spark([], 3) == "   "


def test_memory_bar_columns():
    assert fmt.mem_bar(40 * GIB, 8 * GIB, 80 * GIB, 10) == (5, 1, 4)
    assert fmt.mem_bar(None, None, None, 6) == (0, 0, 6)


def test_severity_thresholds():
    assert [fmt.sev_kv(u) for u in (None, 0.8999, 0.90, 0.9799, 0.98)] == ["na", "ok", "warn", "warn", "crit"]
    assert [fmt.sev_preempt(r) for r in (0.0, 0.001, 0.99, 1.0)] == ["ok", "warn", "warn", "crit"]
    assert [fmt.sev_latency(v, 0.1) for v in (0.05, 0.081, 0.1, 0.101)] == ["ok", "warn", "warn", "crit"]
    assert fmt.sev_latency(0.2, None) == "na"


def test_timeline_columns_draw_gaps_to_scale():
    # tokens every 0.1 s for 1 s, a 2 s stall, tokens again to 4 s; 40 columns of 0.1 s
    toks = [(round(i * 0.1, 1), 1) for i in range(11)] + [(round(3.0 + i * 0.1, 1), 1) for i in range(10)]
    spike = SpikeView("a", t_start=1.0, t_end=3.0, gap_s=2.0, cause="preemption", confidence=0.9)
    cols = fmt.timeline_cols(toks, 0.0, 4.0, 40, [spike], [(2.5, "preemption", 1.0), (0.5, "prompt_burst", 9e4)])
    assert abs(cols.dt - 0.1) < 1e-12
    assert sum(cols.tokens) == 21
    assert cols.tokens[11:30] == [0] * 19  # 1.1 s .. 2.9 s: nothing arrived
    assert cols.spike[10:31] == ["preemption"] * 21 and cols.spike[9] is None and cols.spike[31] is None
    assert cols.spike_starts == [(10, spike)]
    assert cols.engine[25] == "P" and cols.engine[5] == "B"


def test_axis_ticks_are_round_seconds():
    assert fmt.nice_ticks(0, 40, 80, 12) == [(0, "0s"), (20, "10s"), (40, "20s"), (60, "30s"), (79, "40s")]


def test_request_timeline_is_bounded_and_overlays_engine_events():
    core = Core(itl_target_s=0.1)
    core.ingest(RequestRecord(t=0.0, id="r1", event="arrive"))
    core.ingest(RequestRecord(t=0.2, id="r1", event="first_token"))
    core.ingest(RequestRecord(t=0.3, id="r1", event="token", n=4))
    core.ingest(RequestRecord(t=0.4, id="r1", event="preempt"))
    core.ingest(RequestRecord(t=2.4, id="r1", event="resume"))
    core.ingest(RequestRecord(t=2.5, id="r1", event="token"))
    # engine: preemption counter 3 -> 3 -> 4; prompt tokens +100/s, +100/s, +5000/s, +100/s
    for t, pre, prompt in ((0.0, 3, 0), (1.0, 3, 100), (2.0, 4, 200), (3.0, 4, 5200), (4.0, 4, 5300)):
        core.ingest(EngineRecord(t=t, adapter="vllm", url="u", engine="0", preemptions_total=pre,
                                 prompt_tokens_total=prompt))
    tl = core.request_timeline("r1")
    assert tl is not None
    assert tl.tokens == ((0.2, 1), (0.3, 4), (2.5, 1))
    assert tl.marks == ((0.4, "preempt"), (2.4, "resume"))
    assert tl.engine_marks == ((2.0, "preemption", 1.0), (3.0, "prompt_burst", 5000.0))
    assert core.request_timeline("nope") is None
    for i in range(TIMELINE_MAX_CHUNKS + 10):
        core.ingest(RequestRecord(t=5.0 + i * 0.01, id="r1", event="token"))
    tl = core.request_timeline("r1")
    assert tl is not None and len(tl.tokens) == TIMELINE_MAX_CHUNKS


def test_detail_without_analysis_marks_gaps_over_target_as_unattributed():
    from kvtop.views.tui import render

    core = Core(itl_target_s=0.1)
    core.ingest(RequestRecord(t=0.0, id="r1", event="arrive"))
    for t in (0.1, 0.15, 0.2, 0.9, 0.95):
        core.ingest(RequestRecord(t=t, id="r1", event="token"))
    snap = core.snapshot()
    text = render.detail(snap.requests[0], core.request_timeline("r1"), [], 0.1, snap.t, 80)
    assert "not attributed yet" in text
    assert "gap 700ms" in text and "×7.0 target" in text


def _detail_of_one_stall(tokens: int, at: int, stall_s: float, width: int) -> str:
    """The detail screen's text for one request streaming every 20 ms but one stall before token ``at``."""
    from kvtop.views.tui import render

    core = Core(itl_target_s=0.1)
    core.ingest(RequestRecord(t=0.0, id="r1", event="arrive"))
    t = 0.0
    for i in range(tokens):
        t += stall_s if i == at else 0.02
        core.ingest(RequestRecord(t=t, id="r1", event="token"))
    snap = core.snapshot()
    return render.detail(snap.requests[0], core.request_timeline("r1"), [], 0.1, snap.t, width)


def test_a_long_requests_detail_says_its_first_tokens_are_not_drawn():
    # 1,531 tokens: the timeline keeps the last 1,024 chunks, and the screen showed an empty stretch
    # and "top = 92ms" under a header saying max gap 10.16 s
    text = _detail_of_one_stall(1531, 5, 10.0, 100)
    assert "keeps a request's last 1,024 chunks: its first 507 tokens" in text
    assert "max gap [$error]10.00s" in text


def test_the_detail_gap_chart_keeps_an_early_spike_in_view():
    """A 1.5 s stall at the 10th token of a 500-token stream: the chart drew the last 70 gaps, a flat
    row under the stall's scale. Now it draws the whole request, each column the largest gap of its
    run, so the stall's column reaches the top."""
    text = _detail_of_one_stall(500, 10, 1.5, 80)
    lines = text.splitlines()
    head = next(i for i, ln in enumerate(lines) if "gap per token" in ln)
    assert "499 gaps, each column the largest of" in lines[head] and "top = 1.50s" in lines[head]
    assert "█" in lines[head + 1]


def test_request_cells_flag_gaps_over_target():
    from kvtop.views.tui import render

    r = RequestView(id="a[b]", state="preempted", tokens=12, age_s=3.0, current_gap_s=0.25, max_gap_s=0.09,
                    spikes=2, preempt_spikes=1, last_cause="preemption")
    cells = render.request_cells(r, 0.1)
    assert cells[0] == "a\\[b]"  # ids are escaped, never read as markup
    assert cells[1] == "[$error]preempted[/]"
    assert cells[5] == "[$error]250ms[/]" and cells[6] == "[$warning]90ms[/]"
    assert cells[8] == "[$error]1[/]" and cells[9] == "[$error]preemption[/]"
