"""A spike's judgement does not depend on the path that makes it, nor on when it is made.

`kvtop analyze`'s fast path judges spikes at the end of a whole block of records (these traces are one
block: seconds of later traffic), its streaming path and the live console a settle time after each
spike's end. On real vLLM traces the fast path used to read figures that later traffic had moved (the
usual prompt tokens per scrape pulled to zero by a run's idle tail, a prefill rate measured from
requests that finished later, prompt lengths told by later finish records): 13 of 602 spikes of the
prefill source run differed at 100 ms. Each spike now reads what was known by its cut-offs
(``kvtop.analysis.asof``).
"""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import pytest

from kvtop.analysis.asof import History, RunningMedian
from kvtop.analysis.gaps import LogHistogram
from kvtop.analysis.live import LiveAnalyzer
from kvtop.analysis.scan import analyze_trace
from kvtop.model.records import from_dict

LOOP = Path(__file__).parent / "fixtures" / "loop"  # real vLLM 0.32 runs (SOURCES.md there)
TRACES = ("vllm-prefill-source", "vllm-prefill-before", "vllm-storm-before")


def _key(spikes) -> dict[tuple[str, float], tuple[str, str | None, float]]:
    return {(s.request_id, round(s.t_end, 6)): (s.cause, s.rule, s.confidence) for s in spikes}


def _live(path: Path, target: float):
    """The console's analysis, fed line by line, asked for its report every half second of trace."""
    live = LiveAnalyzer(itl_target_s=target, adapter="vllm", keep_spikes=100_000)
    last = -math.inf
    for line in path.read_text().splitlines():
        d = json.loads(line)
        if d.get("kind") == "header":
            continue
        rec = from_dict(d)
        if rec is not None:
            live.feed(rec)
        if d["t"] - last > 0.5:
            live.report(d["t"])
            last = d["t"]
    return live.report(math.inf)


@pytest.mark.parametrize("target", [0.100, 0.020])
@pytest.mark.parametrize("name", TRACES)
def test_every_path_judges_every_spike_alike(name: str, target: float, tmp_path: Path) -> None:
    path = tmp_path / f"{name}.jsonl"
    path.write_bytes(gzip.decompress((LOOP / f"{name}.jsonl.gz").read_bytes()))
    fast = _key(analyze_trace(str(path), itl_target_s=target, fast=True).spikes)
    streaming = _key(analyze_trace(str(path), itl_target_s=target, fast=False).spikes)
    live = _key(_live(path, target).spikes)
    assert len(fast) >= 20  # spikes enough to judge, of more than one cause
    assert len({c for c, _, _ in fast.values()}) >= 2
    differ = sorted(k for k in fast.keys() | streaming.keys() if fast.get(k) != streaming.get(k))
    assert not differ, [(k, fast.get(k), streaming.get(k)) for k in differ[:5]]
    assert live == streaming


def test_a_running_figure_is_read_as_of_a_time():
    """The median of a growing sample, refreshed as it grows by a step (or 1 %), each value stamped with
    the trace time of the sample that moved it; stamps never go back (a line a little out of order)."""
    m = RunningMedian(LogHistogram(lo=1.0, bins=1000), min_n=5, step=4)
    for i, v in enumerate([100.0] * 5 + [400.0] * 10):
        m.add(v, t=10.0 + i)
    assert m.at(13.9) is None  # five samples first
    assert m.at(14.0) == pytest.approx(100.0, rel=0.02)  # the fifth, at t=14
    assert m.at(19.0) == pytest.approx(100.0, rel=0.02)  # refreshed at the tenth sample: 100 x5, 400 x5
    assert m.at(24.0) == pytest.approx(400.0, rel=0.02)  # and at the fifteenth
    assert m.latest() == m.at(math.inf)
    h = History()
    h.record(5.0, 1.0)
    h.record(4.0, 2.0)  # told later, of an earlier time: in force from 5.0 on, not before
    assert (h.at(4.5), h.at(5.0)) == (None, 2.0)
    h.record(6.0, 3.0)
    h.prune(before=7.0)
    assert (h.at(6.5), h.at(100.0)) == (3.0, 3.0)


def test_a_runs_first_prompts_do_not_stand_as_its_median_gap():
    """Eight streams whose first gaps waited on the other prompts' prefills (180 ms), then decode at
    16 ms a token, at a 100 ms target. The run's median (every 8th gap) follows the decode steps
    within a few samples: a stall in the run's first seconds is judged at a loose target, as it is.
    It used to stay the first sampled gap for 64 samples (the first 500 gaps, two seconds here), which
    made a 100 ms target look tight (under 3x that median) and gave such stalls the tight bases."""
    from kvtop.analysis.attribution.thresholds import TIGHT_TARGET_REL
    from kvtop.analysis.gaps import GapTracker

    gt = GapTracker(itl_target_s=0.1)
    streams = [f"r{i}" for i in range(8)]
    for i, rid in enumerate(streams):
        gt.token(rid, 0.3 + 0.001 * i)
        gt.token(rid, 0.48 + 0.001 * i)  # the first gap: 180 ms behind the other prompts
    t = 0.5
    for _ in range(30):  # 240 decode gaps, 30 samples: 0.98 s in all
        t += 0.016
        for i, rid in enumerate(streams):
            gt.token(rid, t + 0.0001 * i)
    assert gt.median_gap(0.49) == pytest.approx(0.18, rel=0.02)  # one sample: the first prompts' wait
    early = gt.median_gap(0.8)
    assert early is not None and early == pytest.approx(0.016, rel=0.02)
    assert 0.1 >= TIGHT_TARGET_REL * early  # 100 ms is over 6 decode steps: not tight


def _coarse_trace(path: Path, interval_s: float | None) -> None:
    """Eight streams at 20 ms a token; r3 silent from 2 s to 4 s (preempted, resumed); the engine scraped
    every 15 s, the counter stepping at the first scrape after the resume (vLLM counts at resume)."""
    from tests.test_attribution import stream_records

    head: dict[str, object] = {"kind": "header", "format": "kvtop-trace", "version": 1,
                               "started_at": "2026-12-02T00:00:00Z", "engine": {"adapter": "vllm"}}
    if interval_s is not None:
        head["interval_s"] = interval_s
    recs = stream_records(dur=50.0, silent={"r3": (2.0, 4.0)})
    for k, t in enumerate((0.5, 15.5, 30.5, 45.5)):
        recs.append({"kind": "engine", "t": t, "adapter": "vllm", "url": "http://x", "engine": "0", "kv_usage": 0.97,
                     "running": 8, "waiting": 0, "preemptions_total": float(k >= 1), "prompt_tokens_total": 4000.0})
    recs.sort(key=lambda d: d["t"])
    path.write_text("\n".join(json.dumps(d) for d in [head, *recs]) + "\n")


def test_the_first_stall_of_a_coarsely_scraped_trace_waits_for_the_recorders_scrape_period(tmp_path: Path) -> None:
    """Before two scrapes are read, the usual scrape interval is the recorder's own (the header's
    ``interval_s``): a stall in the first interval waits for the scrape that shows its counter step."""
    p = tmp_path / "coarse.jsonl"
    _coarse_trace(p, 15.0)
    fast, streaming = (analyze_trace(str(p), itl_target_s=0.1, fast=f).spikes for f in (True, False))
    assert _key(fast) == _key(streaming)
    (r3,) = [s for s in fast if s.request_id == "r3"]
    assert r3.cause == "preemption" and r3.rule == "counter", r3.evidence
    # without it, 1 s is assumed: the stall is judged long before the counter's scrape, on both paths
    # alike, on the KV gauge alone (`unread`: no scrape after it yet), at a confidence that says so
    _coarse_trace(p, None)
    fast, streaming = (analyze_trace(str(p), itl_target_s=0.1, fast=f).spikes for f in (True, False))
    assert _key(fast) == _key(streaming)
    (r3,) = [s for s in fast if s.request_id == "r3"]
    assert r3.rule == "unread" and r3.confidence < 0.9
