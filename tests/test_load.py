"""`kvtop load`: the plan a trace gives, and the command as a user runs it against the simulated server."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

import jsonschema
from conftest import REPO, run_kvtop

from kvtop.load.client import prompt_ids
from kvtop.load.plan import plan_from_records
from kvtop.model.trace import TraceReader
from kvtop.sim.server import SimServer
from kvtop.sim.workload import load_preset

SCHEMA = json.loads((REPO / "kvtop" / "schemas" / "trace.schema.json").read_text())


def _req(t: float, rid: str, event: str, **kw: Any) -> dict[str, Any]:
    return {"kind": "request", "t": t, "id": rid, "event": event, **kw}


def _stream(rid: str, t0: float, n: int, every: float = 0.02, **arrive: Any) -> list[dict[str, Any]]:
    out = [_req(t0, rid, "arrive", **arrive)]
    out += [_req(t0 + 0.1 + i * every, rid, "first_token" if i == 0 else "token", n=1) for i in range(n)]
    return out


def _source_records() -> list[dict[str, Any]]:
    recs: list[dict[str, Any]] = []
    # finished: 30 tokens of a 200-token prompt
    recs += _stream("fin", 10.0, 30, prompt_tokens=200, **{"class": "chat"})
    recs.append(_req(10.8, "fin", "finish", completion_tokens=30, finish_reason="length"))
    # the client hung up after 5 tokens
    recs += _stream("cut", 10.5, 5, prompt_tokens=120)
    recs.append(_req(10.8, "cut", "cancel"))
    # the client gave up after waiting 1.9 s for its first token
    recs.append(_req(11.0, "gaveup", "arrive", prompt_tokens=90))
    recs.append(_req(12.9, "gaveup", "cancel"))
    # cut off by kvtop stopping: not a client cancel
    recs += _stream("stopped", 11.2, 3, prompt_tokens=50, **{"class": "chat"})
    recs.append(_req(11.4, "stopped", "cancel", error="proxy_stopped"))
    # a slow reader: 10 tokens at 20 ms, then 0.5 s of silence ended by one 12-token chunk
    recs += _stream("slow", 11.5, 10, prompt_tokens=64)
    recs.append(_req(11.5 + 0.1 + 9 * 0.02 + 0.5, "slow", "token", n=12))
    recs.append(_req(12.5, "slow", "finish", completion_tokens=22))
    # a text prompt: its length comes from the usage block on finish
    recs += _stream("text", 12.0, 4)
    recs.append(_req(12.3, "text", "finish", completion_tokens=4, prompt_tokens=77))
    # no prompt length anywhere, and kvtop's own canary: both left out
    recs += _stream("nolen", 12.1, 2)
    recs.append(_req(12.2, "nolen", "finish"))
    recs += _stream("probe-1", 12.2, 2, prompt_tokens=8, source="probe")
    recs.sort(key=lambda d: d["t"])
    return recs


def test_plan_reproduces_lengths_cancels_and_readers():
    plan = plan_from_records(_source_records(), "src.jsonl")
    by = {r.id: r for r in plan.requests}
    assert [r.id for r in plan.requests] == ["fin", "cut", "gaveup", "stopped", "slow", "text"]
    assert plan.skipped_no_prompt == 1 and plan.skipped_probe == 1
    assert by["fin"].t == 0.0 and by["cut"].t == 0.5 and by["text"].t == 2.0
    assert (by["fin"].prompt_tokens, by["fin"].max_tokens, by["fin"].cls) == (200, 30, "chat")
    assert by["fin"].cancel_after_tokens is None and by["fin"].cancel_after_s is None
    assert by["cut"].cancel_after_tokens == 5
    assert by["gaveup"].cancel_after_tokens is None and abs(by["gaveup"].cancel_after_s - 1.9) < 1e-9
    # kvtop's own stop was no client's cancel: replayed to the median output of its class's finished requests
    assert by["stopped"].cancel_after_tokens is None and by["stopped"].cancel_after_s is None
    assert by["stopped"].max_tokens == 30
    # a cancelled stream must outlast its cancel point: 2k + 16 tokens, or its class's median when longer
    assert by["gaveup"].max_tokens == 16 and by["cut"].max_tokens == 26
    assert by["text"].prompt_tokens == 77
    (k, pause), = by["slow"].pauses
    assert k == 10 and abs(pause - 0.5) < 1e-6
    fast = plan.scaled(4.0)
    f = {r.id: r for r in fast.requests}
    assert f["text"].t == 0.5 and abs(f["gaveup"].cancel_after_s - 0.475) < 1e-9
    assert abs(f["slow"].pauses[0][1] - 0.125) < 1e-6
    assert [r.id for r in plan.limited(2).requests] == ["fin", "cut"]


def test_prompt_ids_have_the_length_and_share_only_the_group_prefix():
    plan = plan_from_records(_source_records(), "src.jsonl")
    a, b = plan.requests[0], plan.requests[1]
    ia, ib = prompt_ids(a, 1), prompt_ids(b, 1)
    assert len(ia) == 200 and len(ib) == 120 and ia[:4] != ib[:4]
    assert prompt_ids(a, 1) == ia  # the same seed sends the same prompt
    a.prefix_id = b.prefix_id = "sys"
    a.prefix_tokens = b.prefix_tokens = 40
    pa, pb = prompt_ids(a, 1), prompt_ids(b, 1)
    assert pa[:40] == pb[:40] and pa[40:44] != pb[40:44] and len(pa) == 200
    # what a cold prefix cache can serve of the plan: b's 40 shared tokens of the six requests' 601
    assert plan.shared_share() == 40 / 601
    a.prefix_tokens = 200  # a prefix as long as the prompt is no shared prefix: nothing to repeat
    assert prompt_ids(a, 1) == ia and plan.shared_share() == 0.0


def _write(path: Path, recs: list[dict[str, Any]]) -> None:
    head = {"kind": "header", "format": "kvtop-trace", "version": 1, "started_at": "2026-01-01T00:00:00.000Z",
            "host": "h", "engine": {}, "kv": {}}
    path.write_text("\n".join(json.dumps(r) for r in [head, *recs]) + "\n")


async def _kvtop(*args: str) -> asyncio.subprocess.Process:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["XDG_CONFIG_HOME"] = str(REPO / ".cache" / "no-config")
    return await asyncio.create_subprocess_exec(sys.executable, "-m", "kvtop", *args, env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)


def _requests(path: Path) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for d in TraceReader(path).dicts():
        if d["kind"] == "request":
            out.setdefault(d["id"], []).append(d)
    return out


async def test_load_replays_a_trace_on_the_simulated_server(tmp_path: Path):
    src, out = tmp_path / "src.jsonl", tmp_path / "out.jsonl"
    _write(src, _source_records())
    # real time: a token every few milliseconds, as an engine streams them (the proxy sees a hang-up
    # only at its next write, so a much faster stream would overshoot the cancel point)
    async with SimServer(load_preset("healthy"), speed=1.0) as srv:
        proc = await _kvtop("load", "--from", str(src), "--url", srv.url, "-o", str(out), "--rate-scale", "2",
                            "--no-gpu", "--no-host", "--interval", "0.5")
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    assert b"sent 6/6" in err and b"1 request(s) left out" in err
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    for d in lines:
        jsonschema.validate(d, SCHEMA)
    head = lines[0]
    assert head["recorder"] == "kvtop load"
    assert head["load"]["source"] == str(src) and head["load"]["target"] == srv.url
    assert head["load"]["rate_scale"] == 2.0 and head["load"]["requests_planned"] == 6
    assert head["load"]["requests_left_out"] == 1  # "nolen": no prompt length anywhere, said in the header too
    reqs = _requests(out)
    assert sorted(reqs) == ["cut", "fin", "gaveup", "slow", "stopped", "text"]
    arrive = {rid: evs[0] for rid, evs in reqs.items()}
    assert {rid: a["prompt_tokens"] for rid, a in arrive.items()} == {
        "fin": 200, "cut": 120, "gaveup": 90, "stopped": 50, "slow": 64, "text": 77}
    assert arrive["fin"]["class"] == "chat"
    # inter-arrival times are the recorded ones halved (--rate-scale 2): 1.0 s and 0.25 s, not 2.0 and 0.5
    assert abs((arrive["text"]["t"] - arrive["fin"]["t"]) - 1.0) < 0.1
    assert abs((arrive["cut"]["t"] - arrive["fin"]["t"]) - 0.25) < 0.1
    ends = {rid: evs[-1] for rid, evs in reqs.items()}
    assert ends["fin"]["event"] == "finish" and ends["fin"]["completion_tokens"] == 30
    assert ends["slow"]["event"] == "finish" and ends["slow"]["completion_tokens"] == 22
    assert ends["stopped"]["event"] == "finish" and ends["stopped"]["completion_tokens"] == 30
    # the cancel after 5 tokens happened after 5 tokens
    assert ends["cut"]["event"] == "cancel"
    got = sum(d.get("n") or 1 for d in reqs["cut"] if d["event"] in ("first_token", "token"))
    assert 5 <= got <= 8, got  # a few more may be on their way when the client hangs up
    # the healthy engine answers well within 0.95 s (1.9 s halved), so the client that gave up waiting does not
    assert ends["gaveup"]["event"] == "finish"
    # what the engine's prefix cache served, from its own counters scraped before the first request and
    # after the last: the simulator caches only the prefixes a request declares, so none of the replay's
    # 601 prompt tokens, and no hint about --seed
    served = re.search(rb"prefix cache served (\d+)% of the ([\d,]+) prompt tokens it was asked for\n", err)
    assert served is not None, err.decode()
    assert served[1] == b"0" and served[2] == b"601"
    assert b"--seed" not in err


async def test_load_workload_is_bounded_and_ctrl_c_leaves_a_valid_trace(tmp_path: Path):
    out = tmp_path / "out.jsonl"
    async with SimServer(load_preset("preemption-storm"), speed=2.0) as srv:
        proc = await _kvtop("load", "--preset", "preemption-storm", "--url", srv.url, "-o", str(out),
                            "--duration", "30", "--no-gpu", "--no-host")
        assert proc.stderr is not None
        first = await asyncio.wait_for(proc.stderr.readline(), 60)
        assert b"Ctrl-C to stop" in first, first  # sending from now on
        await asyncio.sleep(3.0)
        proc.send_signal(signal.SIGINT)
        _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err.decode()
    assert b"Traceback" not in err
    lines = [json.loads(x) for x in out.read_text().splitlines()]  # every line whole
    assert lines[0]["load"]["source"] == "preemption-storm" and lines[0]["load"]["source_kind"] == "workload"
    reqs = _requests(out)
    assert reqs, "some requests were sent in 3 s"
    # every stream is closed: finished, or cut off by the stop (recorded as kvtop's own stop)
    for evs in reqs.values():
        assert evs[-1]["event"] in ("finish", "cancel", "error")
    assert any(evs[-1].get("error") == "proxy_stopped" for evs in reqs.values())


async def test_load_duration_cuts_streams_off_without_calling_them_errors(tmp_path: Path):
    # the storm's long streams are still going when --duration ends the run: they were cut off by the
    # run's end, and the run is a success (exit 0), not "every request failed"
    out = tmp_path / "out.jsonl"
    async with SimServer(load_preset("preemption-storm"), speed=2.0) as srv:
        proc = await _kvtop("load", "--preset", "preemption-storm", "--url", srv.url, "-o", str(out),
                            "--duration", "3", "--no-gpu", "--no-host")
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    summary = re.search(rb"sent (\d+)/\d+, .*errors (\d+).*cut off by the stop (\d+)", err)
    assert summary is not None, err.decode()
    assert int(summary[1]) > 0 and summary[2] == b"0" and int(summary[3]) > 0, err.decode()
    assert b"every request failed" not in err and b"Traceback" not in err


async def test_load_max_requests(tmp_path: Path):
    src, out = tmp_path / "src.jsonl", tmp_path / "out.jsonl"
    _write(src, _source_records())
    async with SimServer(load_preset("healthy"), speed=10.0) as srv:
        proc = await _kvtop("load", "--from", str(src), "--url", srv.url, "-o", str(out), "--max-requests", "2",
                            "--rate-scale", "5", "--no-gpu", "--no-host")
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    assert sorted(_requests(out)) == ["cut", "fin"]


def test_load_bad_input_is_one_line(tmp_path: Path):
    src = tmp_path / "src.jsonl"
    _write(src, _source_records())
    empty = tmp_path / "empty.jsonl"
    _write(empty, [])
    for args, msg in (
        (["--from", str(src), "--url", "http://10.1.2.3:8000", "-o", str(tmp_path / "o.jsonl")], "--allow-remote"),
        (["--from", str(tmp_path / "missing.jsonl"), "--url", "http://127.0.0.1:9", "-o", str(tmp_path / "o.jsonl")],
         "missing.jsonl"),
        (["--from", str(empty), "--url", "http://127.0.0.1:9", "-o", str(tmp_path / "o.jsonl")], "no request"),
        (["--from", str(src), "--url", "http://127.0.0.1:9", "-o", str(empty)], "already exists"),
        # not even --force lets the new run overwrite the recording it replays
        (["--from", str(src), "--url", "http://127.0.0.1:9", "-o", str(src)], "the trace being replayed"),
        (["--from", str(src), "--url", "http://127.0.0.1:9", "-o", str(src), "--force"], "the trace being replayed"),
        (["--from", str(src), "--url", "http://127.0.0.1:9", "-o", str(tmp_path / "o.jsonl"), "--rate-scale", "0"],
         "--rate-scale"),
        (["--preset", "nope", "--url", "http://127.0.0.1:9", "-o", str(tmp_path / "o.jsonl")], "unknown preset"),
    ):
        r = run_kvtop("load", *args, "--no-gpu", "--no-host")
        assert r.returncode == 2, (args, r.stderr)
        assert msg in r.stderr and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_load_unreachable_engine_exits_1(tmp_path: Path):
    src = tmp_path / "src.jsonl"
    _write(src, _source_records())
    r = run_kvtop("load", "--from", str(src), "--url", "http://127.0.0.1:9", "-o", str(tmp_path / "o.jsonl"),
                  "--no-gpu", "--no-host", "--timeout", "0.5")
    assert r.returncode == 1 and "Traceback" not in r.stderr and "could not read the engine" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


async def test_load_every_request_refused_exits_1(tmp_path: Path):
    src, out = tmp_path / "src.jsonl", tmp_path / "o.jsonl"
    # prompts longer than the engine's max_model_len (8,192 on the healthy preset): refused with a 400 each
    _write(src, [r if r["event"] != "arrive" else {**r, "prompt_tokens": 9000}
                 for r in _source_records() if r["id"] in ("fin", "cut")])
    async with SimServer(load_preset("healthy"), speed=10.0) as srv:
        proc = await _kvtop("load", "--from", str(src), "--url", srv.url, "-o", str(out), "--rate-scale", "10",
                            "--no-gpu", "--no-host")
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 1 and b"every request failed" in err and b"Traceback" not in err
    errors = [d for d in TraceReader(out).dicts() if d.get("event") == "error"]
    assert [e["status"] for e in errors] == [400, 400]


def test_the_prefix_cache_line_sums_engines_and_survives_a_restart():
    from kvtop.commands.load import _PrefixCounters
    from kvtop.model.records import EngineRecord

    cache = _PrefixCounters()
    assert cache.line() is None  # an engine without the counters: no line
    for t, url, hits, queries in ((0.0, "a", 1000, 1000), (0.0, "b", 400, 500), (5.0, "a", 1500, 1600),
                                  (5.0, "b", 100, 150),  # b restarted: its counters began again from zero
                                  (9.0, "a", 1900, 2000), (9.0, "b", 300, 350)):
        cache(EngineRecord(t, "vllm", url=url, prefix_hits_total=hits, prefix_queries_total=queries))
    # a: 900 of 1,000 tokens; b since its restart: 300 of 350
    assert cache.line() == (
        "the engine's prefix cache served 89% of the 1,350 prompt tokens it was asked for (a repeat of a run with "
        "the same --seed on this engine finds its prompts cached: give each replay its own --seed to measure its "
        "prefills)")
    # a plan whose own shared prefixes repeat 80% of its prompt tokens: 89% served is the plan, no hint
    planned = _PrefixCounters(0.8)
    planned.firsts, planned.lasts = cache.firsts, cache.lasts
    assert planned.line() == ("the engine's prefix cache served 89% of the 1,350 prompt tokens it was asked for; "
                              "the plan's shared prefixes repeat 80%")


async def _serve_streams(handler: Any) -> tuple[Any, str]:
    from aiohttp import web

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def test_the_client_counts_outcomes_as_the_trace_does_and_says_when_it_fell_behind():
    # an error event inside a 200 stream (vLLM's way of reporting an engine failure) was counted as
    # finished; and a client capped at its open streams stopped sending on schedule without a word
    import aiohttp
    from aiohttp import web

    from kvtop.load.client import LoadClient, schedule_line
    from kvtop.load.plan import LoadRequest, Plan

    async def handler(request: web.Request) -> web.StreamResponse:
        rid = request.headers["X-Request-Id"]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if rid.startswith("err"):
            await resp.write(b'data: {"error": {"type": "InternalServerError", "code": 500}}\n\n')
        else:
            await asyncio.sleep(0.3)
            await resp.write(b'data: {"choices": [{"index": 0, "text": " a", "finish_reason": null}]}\n\n')
            await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    runner, url = await _serve_streams(handler)
    try:
        reqs = [LoadRequest("err-1", 0.0, 8, 4)] + [LoadRequest(f"ok-{i}", 0.01 * i, 8, 4) for i in range(1, 9)]
        client = LoadClient(url, Plan(reqs, "t", "workload"), model="m", max_concurrency=2)
        async with aiohttp.ClientSession() as s:
            await client.run(s, asyncio.Event())
        st = client.stats
        assert (st.finished, st.errors, st.error_kinds) == (8, 1, {"InternalServerError": 1})
        assert st.capped >= 5 and st.late_max_s > 0.2
        line = schedule_line(st, client.plan, 2)
        assert line is not None and "behind schedule" in line and "2 open at once" in line
        # a client that keeps up says nothing
        on_time = LoadClient(url, Plan(reqs[:2], "t", "workload"), model="m")
        async with aiohttp.ClientSession() as s:
            await on_time.run(s, asyncio.Event())
        assert schedule_line(on_time.stats, on_time.plan, 4096) is None
    finally:
        await runner.cleanup()


async def test_the_simulated_server_shares_the_prefixes_kvtop_load_sends():
    # the shared-prefix preset through `kvtop load`: the server's prefix cache served 0 % where the
    # plan's prefixes repeat 86 % (it learned groups only from the request's "kvtop" field)
    import aiohttp

    from kvtop.load.client import LoadClient
    from kvtop.load.plan import plan_from_workload

    wl = load_preset("shared-prefix")
    plan = plan_from_workload(wl, 1, 8.0)
    async with SimServer(wl, speed=8.0) as srv, aiohttp.ClientSession() as s:
        client = LoadClient(srv.url, plan, model=wl.engine.model)
        await client.run(s, asyncio.Event())
        async with s.get(srv.url + "/metrics") as r:
            page = await r.text()
    hits = sum(float(line.split()[-1]) for line in page.splitlines()
               if line.startswith("vllm:prefix_cache_hits_total"))
    queries = sum(float(line.split()[-1]) for line in page.splitlines()
                  if line.startswith("vllm:prefix_cache_queries_total"))
    assert client.stats.finished > 5 and queries > 0 and hits / queries > 0.5, (hits, queries)
