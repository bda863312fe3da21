"""The simulated engine over HTTP (issue 3, tests 6 and 7): OpenAI streaming, /metrics, disconnects."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict

import aiohttp
import pytest

from kvtop.model.records import RequestRecord
from kvtop.plugin import detect_adapter, load_adapter
from kvtop.sim.loadgen import run_load
from kvtop.sim.server import SimServer
from kvtop.sim.simulate import Simulation
from kvtop.sim.workload import load_preset, parse_workload
from kvtop.sources.prom import parse_page

SMALL = {
    "name": "small",
    "engine": {"bytes_per_token": 131072, "block_size": 16, "kv_cache_bytes": 8e9, "max_num_seqs": 64,
               "max_num_batched_tokens": 1024, "max_model_len": 4096, "itl_target_s": 0.1},
    "classes": [{"name": "interactive", "rate_per_s": 4,
                 "prompt": {"median": 200, "sigma": 0.3, "max": 800},
                 "output": {"median": 50, "sigma": 0.3, "min": 10, "max": 120}}],
}


def _times(recs, events=("first_token", "token")) -> dict[str, list[float]]:
    out: dict[str, list[float]] = defaultdict(list)
    for r in recs:
        if isinstance(r, RequestRecord) and r.event in events:
            out[r.id].append(r.t)
    return out


async def test_streamed_token_timing_follows_the_simulated_timeline_at_speed_1():
    wl = parse_workload(SMALL)
    server_recs: list = []
    client_recs: list = []
    async with SimServer(wl, speed=1.0, record=server_recs.append) as srv:
        res = await run_load(srv.url, wl, 2.5, seed=3, on_record=client_recs.append, clock=srv.sim_now)
    assert res.sent >= 5 and res.errors == 0
    sim, cli = _times(server_recs), _times(client_recs)
    diffs = []
    for rid, ts in cli.items():
        assert len(ts) <= len(sim[rid])
        diffs += [c - s for s, c in zip(sim[rid], ts, strict=False)]
    assert len(diffs) > 200
    # the client sees each token when the engine's simulated step ends, never before it (how soon
    # after is a figure that depends on how busy the machine is: bench/sim_http_timing.py)
    assert min(diffs) > -0.002
    # ... in the order the engine produced them, each request's tokens to its end
    finished = {r.id for r in client_recs if isinstance(r, RequestRecord) and r.event == "finish"}
    assert finished
    for rid in finished:
        assert len(cli[rid]) == len(sim[rid]) and cli[rid] == sorted(cli[rid])


async def test_disconnect_becomes_a_cancel_inside_the_engine():
    wl = parse_workload(SMALL)
    recs: list = []
    async with SimServer(wl, speed=1.0, record=recs.append) as srv, aiohttp.ClientSession() as s:
        body = {"model": "x", "prompt": "a b c d", "max_tokens": 2000, "stream": True, "ignore_eos": True}
        resp = await s.post(f"{srv.url}/v1/completions", json=body)
        got = 0
        async for line in resp.content:
            if line.startswith(b"data: {"):
                got += 1
                if got == 5:
                    break
        resp.close()  # hang up mid-stream
        deadline = asyncio.get_running_loop().time() + 30  # bounds a hang only
        while not srv.engine.stats.finished["abort"] and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        assert srv.engine.stats.finished["abort"] == 1
        assert srv.engine.num_running == 0 and not srv.engine.seqs
        assert srv.engine.kv_usage == 0.0  # its blocks went back to the pool
        async with s.get(f"{srv.url}/metrics") as r:
            page = await r.text()
    rec = load_adapter("vllm")().parse(page, 0.0)[0]
    assert rec.requests_aborted_total == 1 and rec.running == 0
    cancels = [r for r in recs if isinstance(r, RequestRecord) and r.event == "cancel"]
    assert len(cancels) == 1 and 5 <= cancels[0].completion_tokens < 2000
    assert 4 == next(r.prompt_tokens for r in recs if isinstance(r, RequestRecord) and r.event == "arrive")


async def test_openai_shapes_and_metrics_page_read_by_the_vllm_adapter():
    wl = load_preset("healthy")
    async with SimServer(wl, speed=20.0) as srv, aiohttp.ClientSession() as s:
        async with s.get(f"{srv.url}/health") as r:
            assert r.status == 200
        async with s.get(f"{srv.url}/v1/models") as r:
            assert (await r.json())["data"][0]["id"] == "sim-llama-3.1-8b"
        # non-streaming completion: exactly max_tokens with ignore_eos, usage counts the words
        async with s.post(f"{srv.url}/v1/completions",
                          json={"prompt": "one two three four five", "max_tokens": 7, "ignore_eos": True}) as r:
            out = await r.json()
        assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}
        assert out["choices"][0]["finish_reason"] == "length" and out["choices"][0]["text"].count("tok") == 7
        # streaming chat with usage in the final chunk, then [DONE]
        body = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 5, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        async with s.post(f"{srv.url}/v1/chat/completions", json=body) as r:
            assert r.headers["Content-Type"].startswith("text/event-stream")
            events = [ln.strip()[6:] async for ln in r.content if ln.startswith(b"data: ")]
        assert events[-1] == b"[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")) == 5
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        async with s.post(f"{srv.url}/v1/completions", data=b"{nope") as r:
            assert r.status == 400
        async with s.post(f"{srv.url}/v1/completions", json={"prompt": "", "max_tokens": 3}) as r:
            assert r.status == 400
        too_long = {"prompt": "x", "max_tokens": 3, "stream": True, "kvtop": {"prompt_tokens": 9000}}
        async with s.post(f"{srv.url}/v1/completions", json=too_long) as r:  # max_model_len 8192
            assert r.status == 400 and "max_model_len" in (await r.json())["error"]["message"]
        async with s.get(f"{srv.url}/metrics") as r:
            page = await r.text()
    names = {ln.split("{")[0].split(" ")[0] for ln in page.splitlines() if ln and not ln.startswith("#")}
    assert detect_adapter(names).name == "vllm"
    rec = load_adapter("vllm")().parse(page, 1.0)[0]
    assert rec.engine == "0" and rec.model == "sim-llama-3.1-8b"
    assert rec.kv_capacity_tokens == 152576 and rec.block_size == 16
    assert rec.generation_tokens_total == 12 and rec.prompt_tokens_total == 5 + 2
    assert rec.requests_finished_total == 2 and rec.preemptions_total == 0
    # 12 tokens from 2 requests: 10 inter-token samples, 2 TTFT samples, vLLM's buckets
    pg = parse_page(page)
    itl, ttft = pg.histogram("vllm:inter_token_latency_seconds"), pg.histogram("vllm:time_to_first_token_seconds")
    assert itl.count == 10 and ttft.count == 2
    assert [le for le, _ in itl.buckets][:5] == [0.01, 0.025, 0.05, 0.075, 0.1] and len(itl.buckets) == 20
    assert len(ttft.buckets) == 23
    assert 'vllm:iteration_tokens_total_bucket{engine="0",le="16384.0"' in page
    it = pg.histogram("vllm:iteration_tokens_total")
    assert it.sum == 12 + 5 + 2  # generated tokens + the two prompts (counted when their prefill finished)
    assert pg.value("vllm:num_requests_waiting_by_reason", {"reason": "capacity"}) == 0


async def test_server_and_simulate_produce_the_same_timeline_for_the_same_seed():
    wl = parse_workload(SMALL)
    server_recs: list = []
    async with SimServer(wl, speed=1.0, record=server_recs.append) as srv:
        await run_load(srv.url, wl, 3.0, seed=5, clock=srv.sim_now)
    sim_recs: list = []
    Simulation(wl, 5, 10.0, sim_recs.append, scrape_interval_s=None,
               requests=iter(list(wl.requests(5, 3.0)))).run()

    def per_request(recs):
        out = {}
        arrive = {r.id: r.t for r in recs if isinstance(r, RequestRecord) and r.event == "arrive"}
        first = {r.id: r.t for r in recs if isinstance(r, RequestRecord) and r.event == "first_token"}
        for r in recs:
            if isinstance(r, RequestRecord) and r.event == "finish":
                out[r.id] = (first[r.id] - arrive[r.id], r.t - arrive[r.id], r.completion_tokens, r.finish_reason)
        return out

    a, b = per_request(server_recs), per_request(sim_recs)
    common = sorted(set(a) & set(b))
    assert len(common) >= 6

    def arrivals(recs):
        return {r.id: r.t for r in recs if isinstance(r, RequestRecord) and r.event == "arrive"}

    # how late HTTP delivered requests against their scheduled arrival: a busy machine delays them,
    # and a request that joins a batch later moves its neighbours by as much
    late = max(abs(arrivals(server_recs)[rid] - arrivals(sim_recs)[rid]) for rid in common)
    for rid in common:
        ttft_a, e2e_a, n_a, why_a = a[rid]
        ttft_b, e2e_b, n_b, why_b = b[rid]
        assert (n_a, why_a) == (n_b, why_b)
        # arrival jitter can move a request by one engine step (~10 ms) plus timer slack
        assert ttft_a == pytest.approx(ttft_b, abs=0.04 + 2 * late)
        assert e2e_a == pytest.approx(e2e_b, abs=0.06 + 2 * late)


async def test_impatient_load_generator_clients_become_cancels_in_the_server():
    wl = parse_workload({
        "name": "impatient",
        "engine": {"bytes_per_token": 131072, "block_size": 16, "kv_cache_bytes": 8e9, "max_num_seqs": 16,
                   "max_num_batched_tokens": 16384, "chunked_prefill": False, "max_model_len": 16384},
        # 12K-token prompts: an unchunked prefill step takes ~0.6 s, far beyond a 0.2 s patience
        "classes": [{"name": "rag", "arrival_times_s": [0.0, 0.1, 0.2], "patience_s": 0.2,
                     "prompt": {"median": 12000}, "output": {"median": 50}}]})
    server_recs: list = []
    client_recs: list = []
    async with SimServer(wl, speed=1.0, record=server_recs.append) as srv:
        res = await run_load(srv.url, wl, 1.5, seed=1, on_record=client_recs.append, clock=srv.sim_now)
        deadline = asyncio.get_running_loop().time() + 30  # bounds a hang only
        while asyncio.get_running_loop().time() < deadline:
            if srv.engine.stats.finished["abort"] == 3:
                break
            await asyncio.sleep(0.02)
        stats = srv.engine.stats
    assert res.sent == 3 and res.cancelled == 3 and res.finished == 0
    assert stats.finished["abort"] == 3 and stats.finished["stop"] + stats.finished["length"] == 0
    server_cancels = {r.id: r.t for r in server_recs if isinstance(r, RequestRecord) and r.event == "cancel"}
    arrive = {r.id: r.t for r in client_recs if isinstance(r, RequestRecord) and r.event == "arrive"}
    assert set(server_cancels) == set(arrive)
    for rid, t in server_cancels.items():  # the hang-up reaches the engine after the client's patience
        assert t - arrive[rid] > 0.15


async def test_a_request_refused_for_its_body_leaves_nothing_running_in_the_engine():
    # stream_options "x" was a 500 after the engine had taken the request: it kept generating, KV
    # filled and the running gauge rose for requests no client waited for
    wl = load_preset("healthy")
    async with SimServer(wl, speed=20.0) as srv, aiohttp.ClientSession() as s:
        bad = [("/v1/completions", {"prompt": "a", "max_tokens": 3000, "ignore_eos": True, "stream": True,
                                    "stream_options": "x"}),
               ("/v1/completions", {"prompt": "a b", "max_tokens": 0}),
               ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"text": 5}]}]})]
        for path, body in bad:
            async with s.post(srv.url + path, json=body) as r:
                assert r.status == 400, (body, r.status, await r.text())
        await asyncio.sleep(0.5)
        assert not srv.engine.seqs and srv.engine.num_running == 0
