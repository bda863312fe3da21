"""Request records name the engine that served them; each engine's stalls are judged on its own
scrapes and streams (issue 12, deliverable 3)."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from pathlib import Path

import pytest
from test_capture_tcp import SERVER, SSE_HEAD, Wire, capture, chunk, event, request
from test_proxy import Recorder, ScriptedUpstream, _post

from eval.scoring import score
from eval.truth import label_span, truth_intervals
from kvtop.analysis.analyzer import Analyzer
from kvtop.analysis.attribution.request_preemptions import RequestPreemptions
from kvtop.analysis.scan import analyze_trace
from kvtop.model.analysis import AnalysisReport
from kvtop.model.engine_id import engine_address
from kvtop.model.records import RequestRecord, from_dict, to_dict
from kvtop.model.trace import TraceReader
from kvtop.sim import simulate as sim
from kvtop.sim import workload as W
from kvtop.sources.probe import Probe
from kvtop.sources.proxy.pool import make_proxy


def test_engine_address_reads_urls_and_host_port_alike():
    # a proxy's upstream, a scrape URL and a captured server address of one engine agree
    assert engine_address("http://localhost:8000") == engine_address("127.0.0.1:8000/metrics") == "127.0.0.1:8000"
    assert engine_address("http://user:secret@Engine-A:8000/v1?x=1") == "engine-a:8000"
    assert engine_address("https://gpu-3.internal") == "gpu-3.internal:443"
    assert engine_address("http://gpu-3.internal") == "gpu-3.internal:80"
    assert engine_address("[::1]:8000") == "127.0.0.1:8000"
    assert engine_address("[fd00::5]:9000") == "[fd00::5]:9000"
    assert engine_address("engine-a:8000") != engine_address("engine-a:8001")
    assert engine_address(None) is None and engine_address("  ") is None


def test_engine_field_round_trips_and_old_records_load_without_it():
    rec = RequestRecord(1.0, "r1", "arrive", source="proxy", engine="http://127.0.0.1:8000")
    d = to_dict(rec)
    assert d["engine"] == "http://127.0.0.1:8000"
    assert from_dict(d) == rec
    old = {"kind": "request", "t": 1.0, "id": "r1", "event": "arrive", "source": "proxy"}
    back = from_dict(old)
    assert isinstance(back, RequestRecord) and back.engine is None
    assert "engine" not in to_dict(RequestRecord(1.0, "r1", "token", n=1))  # token lines stay short


async def test_proxy_and_probe_name_their_upstream_on_arrive():
    up = ScriptedUpstream()
    await up.start()
    try:
        rec = Recorder()
        proxy = make_proxy(up.url, rec, time.monotonic, workers=1)
        await proxy.start()
        try:
            st, hd, _ = await _post(proxy.url, "/v1/completions", {"model": "m", "prompt": "x", "stream": True,
                                                                   "script": "steady"})
            assert st == 200
            await proxy.flush_records()
        finally:
            await proxy.stop()
        (arrive,) = [r for r in rec.of(hd["X-Request-Id"]) if r.event == "arrive"]
        assert arrive.engine == up.url.rstrip("/")
        assert engine_address(arrive.engine) == engine_address(up.url + "/metrics")
        assert all(r.engine is None for r in rec.records if r.event != "arrive")

        prec = Recorder()
        probe = Probe(up.url, 4.0, prec, time.monotonic, max_tokens=4)
        stop = asyncio.Event()
        task = asyncio.create_task(probe.run(stop))
        deadline = time.monotonic() + 30  # bounds a hang only
        while not any(r.event == "arrive" for r in prec.records) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        stop.set()
        await asyncio.wait_for(task, 30)
        arrives = [r for r in prec.records if r.event == "arrive"]
        assert arrives and all(r.engine == up.url.rstrip("/") for r in arrives)
    finally:
        await up.stop()


def test_capture_names_the_server_address_it_saw():
    r, out = capture()
    w = Wire(r)
    w.send(request(), 1.0)
    w.reply(SSE_HEAD + chunk(event()), 1.5)
    arrive = out[0]
    assert arrive.event == "arrive"
    host = ".".join(str(b) for b in SERVER)
    assert arrive.engine == f"{host}:{r.port}"


# ---- two engines in one trace ------------------------------------------------------------------

A_URL, B_URL = "http://engine-a:8000", "http://engine-b:8000"


def _merge(parts: list[tuple[str, str, str]], out: Path, named: bool) -> None:
    """Two simulated runs as one trace of two engines: ids prefixed, engine records on their own
    URL, and (``named``) each arrive naming its engine."""
    recs = []
    header = None
    for tag, url, path in parts:
        rd = TraceReader(path)
        header = header or rd.header
        for d in rd.dicts():
            kind = d.get("kind")
            if kind == "request":
                d["id"] = tag + str(d["id"])
                if named and d.get("event") == "arrive":
                    d["engine"] = url
            elif kind == "truth":
                if d.get("request_id"):
                    d["request_id"] = tag + d["request_id"]
                data = d.get("data") or {}
                if "affected" in data:
                    data["affected"] = [tag + a for a in data["affected"]]
            elif kind == "engine":
                d["url"] = url
            recs.append(d)
    recs.sort(key=lambda d: d["t"])
    with open(out, "w") as f:
        f.write(json.dumps(header) + "\n")
        for d in recs:
            f.write(json.dumps(d, separators=(",", ":")) + "\n")


@pytest.fixture(scope="module")
def two_engines(tmp_path_factory):
    """Engine A in a preemption storm, engine B with prefill stalls and no preemption at all."""
    d = tmp_path_factory.mktemp("two")
    a, b = str(d / "a.jsonl"), str(d / "b.jsonl")
    sim.simulate_to_trace(W.load_preset("preemption-storm"), 1, 110.0, a)
    sim.simulate_to_trace(W.load_preset("prefill-interference"), 1, 110.0, b)
    out = {}
    for named in (True, False):
        p = d / f"merged-{'named' if named else 'stripped'}.jsonl"
        _merge([("a-", A_URL, a), ("b-", B_URL, b)], p, named)
        out[named] = str(p)
    return a, b, out


def _by_engine(path: str, fast: bool = True) -> tuple[AnalysisReport, Counter]:
    rep = analyze_trace(path, fast=fast)
    truth = truth_intervals(path)
    c: Counter = Counter()
    for s in rep.spikes:
        c[(s.request_id[:1], s.cause, label_span(s.request_id, s.t_start, s.t_end, truth))] += 1
    return rep, c


def test_each_engine_is_judged_on_its_own_evidence(two_engines):
    a, b, merged = two_engines
    rep, c = _by_engine(merged[True])
    a_pre = sum(n for (e, cause, _), n in c.items() if e == "a" and cause == "preemption")
    a_true = sum(n for (e, _, t), n in c.items() if e == "a" and t == "preemption")
    a_hit = c[("a", "preemption", "preemption")]
    assert a_true >= 40, "engine A should storm"
    assert a_hit == a_pre and a_hit >= 0.95 * a_true  # A's preemption stalls found and attributed
    b_spikes = sum(n for (e, _, _), n in c.items() if e == "b")
    assert b_spikes >= 100  # B has stalls of its own ...
    assert sum(n for (e, cause, _), n in c.items() if e == "b" and cause == "preemption") == 0  # ... none preemption
    # the same answers as each engine analysed on its own
    for path, tag in ((a, "a"), (b, "b")):
        _, alone = _by_engine(path)
        mine = Counter({(cause, t): n for (e, cause, t), n in c.items() if e == tag})
        assert mine == Counter({(cause, t): n for (_, cause, t), n in alone.items()})
    # the streaming path agrees with the fast path
    _, slow = _by_engine(merged[True], fast=False)
    assert slow == c


def test_without_engine_names_the_engines_mask_each_other(two_engines):
    """What the field buys: the same records without ``engine`` mix A's counter steps and B's
    flowing streams into each other's evidence."""
    _, _, merged = two_engines
    _, named = _by_engine(merged[True])
    _, stripped = _by_engine(merged[False])

    def wrong(c: Counter) -> int:
        return sum(n for (_, cause, t), n in c.items() if cause != t)

    b_called_pre = sum(n for (e, cause, _), n in stripped.items() if e == "b" and cause == "preemption")
    a_missed = sum(n for (e, cause, t), n in stripped.items() if e == "a" and t == "preemption" and cause != t)
    assert b_called_pre >= 1  # B's prefill stalls claim A's counter steps
    assert a_missed >= 1  # A's stalls lose their evidence among B's
    assert wrong(named) < wrong(stripped)
    assert score_pre(merged[True])["precision"] > score_pre(merged[False])["precision"]


def score_pre(path: str) -> dict:
    return score(analyze_trace(path), path)["preemption"]


def test_request_preemptions_pin_per_engine():
    """vLLM's per-request preemption histogram, two engines: an interval of engine A with one
    finish pins that request although B's requests finish in the same interval."""
    rp = RequestPreemptions()
    ka, kb = ("http://engine-a:8000", "0"), ("http://engine-b:8000", "0")
    rp.scrape(ka, 1.0, 10, 4, "engine-a:8000")
    rp.scrape(kb, 1.0, 20, 0, "engine-b:8000")
    rp.finish(1.5, "a-1", "engine-a:8000")
    rp.finish(1.6, "b-1", "engine-b:8000")
    rp.finish(1.7, "b-2", "engine-b:8000")
    rp.scrape(ka, 2.0, 11, 7, "engine-a:8000")
    rp.scrape(kb, 2.0, 22, 0, "engine-b:8000")
    assert rp.pinned == {"a-1": 3}
    assert rp.finished == 3 and rp.preemptions == 3


def test_unscraped_engine_gets_no_other_engines_counter():
    """With two engines scraped, a stream of a third (unscraped) engine claims nothing."""
    an = Analyzer(itl_target_s=0.1)
    an.set_header({"engine": {"adapter": "vllm"}})
    for t in (0.5, 1.5, 2.5, 3.5, 4.5):
        for url, pre in ((A_URL, 0 if t < 3 else 5), (B_URL, 0)):
            an.feed_dict({"kind": "engine", "t": t, "adapter": "vllm", "url": url, "engine": "0", "kv_usage": 0.99,
                          "running": 4, "waiting": 2, "preemptions_total": pre})
    assert an.timeline_for("engine-c:8000").has_counter is False
    assert an.timeline_for("engine-a:8000") is an.timelines["engine-a:8000"]
    assert an.timeline_for(None) is an.timeline


def test_trace_writer_keeps_every_request_field(tmp_path):
    """The writer's fast request encoding (also the proxy workers' pipe) writes what ``to_dict``
    writes: the engine on arrive, the engine's times and ``incomplete`` on finish."""
    from kvtop.model.trace import TraceWriter, _request_dict, make_header

    recs = [RequestRecord(1.0, "r1", "arrive", source="proxy", engine="http://127.0.0.1:8000"),
            RequestRecord(1.5, "r1", "first_token", n=1),
            RequestRecord(2.0, "r1", "finish", completion_tokens=1, incomplete=True, engine_queue_s=0.25,
                          engine_ttft_s=0.5, engine_decode_s=0.0)]
    for r in recs:
        assert _request_dict(r) == to_dict(r)
    p = tmp_path / "t.jsonl"
    with TraceWriter(p, make_header()) as w:
        for r in recs:
            w.write(r)
    assert list(TraceReader(str(p)).records()) == recs


def test_one_engine_named_two_ways_keeps_its_evidence():
    """Streams name the engine by a DNS name, the scrapes by IP: with one engine scraped and one
    named, the stream's stall still claims the counter step (as without names)."""
    from test_attribution import engine_records, run, stream_records

    recs = stream_records(silent={"r3": (4.0, 6.0)}) + engine_records(
        kv=0.97, pre_steps=(6.5,), run_drop=((4.4, 6.1),), wait_rise=((4.4, 6.1),))
    for d in recs:
        if d.get("event") == "arrive":
            d["engine"] = "http://gpu-box.internal:8000"
    an = run(recs)
    (g,) = list(an.spikes)
    assert g.request_id == "r3" and g.cause == "preemption"
    # a second scraped engine that is not the stream's: now the names must match, and they do not
    an2 = run(recs + [{**d, "url": "http://other:9000", "preemptions_total": 0.0} for d in recs if d["kind"] == "engine"])
    (g2,) = list(an2.spikes)
    assert g2.cause != "preemption"


def test_live_path_judges_two_engines_like_the_batch_path(two_engines):
    """The console's path (record by record, attributed as evidence settles) gives each engine the
    answers the batch analysis gives."""
    from kvtop.analysis.live import LiveAnalyzer

    _, _, merged = two_engines
    rd = TraceReader(merged[True])
    live = LiveAnalyzer(itl_target_s=rd.header["sim"]["itl_target_s"], adapter="vllm", keep_spikes=10_000,
                        horizon_s=600.0)
    for rec in rd.records():
        live.feed(rec)
    live.an.finish()
    got = Counter((g.request_id[:1], g.cause) for g in live.an.spikes)
    _, batch = _by_engine(merged[True])
    want: Counter = Counter()
    for (e, cause, _), n in batch.items():
        want[(e, cause)] += n
    assert got == want
    assert got[("b", "preemption")] == 0 and got[("a", "preemption")] >= 40
