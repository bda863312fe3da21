"""20 concurrent streams through the recording proxy in front of the simulated engine: one timeline
per request, matching the simulator's own record of when it produced each token (its truth)."""

from __future__ import annotations

import asyncio
import time

import aiohttp
from test_proxy import Recorder

from kvtop.model.records import RequestRecord, TruthRecord
from kvtop.sim.server import SimServer
from kvtop.sim.workload import load_preset
from kvtop.sources.proxy import RecordingProxy

STREAMS = 20
OUTPUT = 60
PROMPT = 1100  # 20 x (1100 + 60) tokens do not fit the preset's ~22.9K-token KV cache: preemptions


async def test_twenty_streams_match_the_simulation(tmp_path):
    wl = load_preset("preemption-storm")
    sim_recs: list = []
    sim = SimServer(wl, speed=1.0, seed=7, record=sim_recs.append)
    await sim.start()
    rec = Recorder()
    proxy = RecordingProxy(sim.url, rec, time.monotonic)
    await proxy.start()
    got_at: dict[str, list[float]] = {f"sim-{i}": [] for i in range(STREAMS)}
    try:
        async with aiohttp.ClientSession() as s:
            async def one(i: int) -> bytes:
                rid = f"sim-{i}"
                body = {"model": wl.engine.model, "prompt": "hello", "stream": True, "max_tokens": OUTPUT,
                        "stream_options": {"include_usage": True},
                        "kvtop": {"request_id": rid, "prompt_tokens": PROMPT, "output_tokens": OUTPUT}}
                async with s.post(proxy.url + "/v1/completions", json=body, headers={"X-Request-Id": rid}) as r:
                    assert r.status == 200
                    data = b""
                    async for piece in r.content.iter_any():
                        now = time.monotonic()
                        data += piece
                        # one " tok" event per token: when the client had each of them
                        events = data.split(b"\n\n")[:-1]
                        got_at[rid] += [now] * (sum(b' tok"' in e for e in events) - len(got_at[rid]))
                    return data
            bodies = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(STREAMS))), 60)
    finally:
        await proxy.stop()
        await sim.stop()
    assert all(b.endswith(b"data: [DONE]\n\n") for b in bodies)

    ids = {f"sim-{i}" for i in range(STREAMS)}
    assert {r.id for r in rec.records} == ids  # one timeline per request, nothing else
    sim_req = [r for r in sim_recs if isinstance(r, RequestRecord)]
    preempted = {r.request_id for r in sim_recs if isinstance(r, TruthRecord) and r.event == "preempt"}
    assert preempted, "the scenario should preempt someone"
    for rid in sorted(ids):
        mine = rec.of(rid)
        truth = [r for r in sim_req if r.id == rid]
        toks = [r for r in mine if r.event in ("first_token", "token")]
        assert [r.event for r in mine] == ["arrive", "first_token"] + ["token"] * (len(toks) - 1) + ["finish"]
        assert sum(r.n for r in toks) == OUTPUT
        assert mine[-1].finish_reason == [r for r in truth if r.event == "finish"][0].finish_reason
        assert mine[-1].completion_tokens == OUTPUT
        # per-token times (chunks that came in one read share that read's time)
        got = [r.t for r in toks for _ in range(r.n)]
        want = [sim.wall_of(r.t) for r in truth if r.event in ("first_token", "token")]
        received = got_at[rid]
        assert len(got) == len(want) == len(received) == OUTPUT
        # each token stamped after the simulator produced it (clock rounding aside) and before the
        # client had it: an order that holds however busy the machine is (the lag itself is a
        # figure: bench/proxy_overhead.py)
        for g, w, c in zip(got, want, received, strict=True):
            assert w - 0.002 < g <= c, (rid, w, g, c)
    # a preempted request's stall stands out in the proxy's timeline as in the simulator's
    for rid in preempted & ids:
        got = [r.t for r in rec.of(rid) if r.event in ("first_token", "token") for _ in range(r.n)]
        want = [sim.wall_of(r.t) for r in sim_req if r.id == rid and r.event in ("first_token", "token")]
        wgaps = [b - a for a, b in zip(want, want[1:], strict=False)]
        ggaps = [b - a for a, b in zip(got, got[1:], strict=False)]
        i = wgaps.index(max(wgaps))
        assert wgaps[i] > 3 * sorted(wgaps)[len(wgaps) // 2]  # the stall stands out ...
        assert ggaps[i] > 3 * sorted(ggaps)[len(ggaps) // 2]  # ... and the proxy saw it where it was
