"""`ProxyPool(trace_prefix=...)`: each worker writes its own trace, and together they hold every
request once, on the same clock as the parent's (so they line up with its other records)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import aiohttp
from test_proxy import PROMPT_MARKER, ScriptedUpstream

from kvtop.model.trace import clock_origin_unix
from kvtop.sources.proxy import ProxyPool


async def test_per_worker_trace_files_hold_every_request_once(tmp_path: Path) -> None:
    upstream = ScriptedUpstream()
    await upstream.start()
    got: list = []
    t0 = time.monotonic()
    pool = ProxyPool(upstream.url, got.append, lambda: time.monotonic() - t0, workers=2,
                     trace_prefix=str(tmp_path / "t"))
    await pool.start()
    # the parent's run start, read as the workers read theirs: the wall clock may be slewed or stepped
    # against the monotonic one over the test's seconds (a CI run here saw 3.5 ms), so not at the end
    parent_origin = clock_origin_unix(lambda: time.monotonic() - t0)
    try:
        async with aiohttp.ClientSession() as s:
            for i in range(6):
                async with s.post(pool.url + "/v1/completions",
                                  json={"model": "m", "prompt": PROMPT_MARKER, "stream": True, "script": "chat"},
                                  headers={"X-Request-Id": f"w-{i}"}) as r:
                    assert r.status == 200
                    await r.read()
        await pool.flush_records()
    finally:
        await pool.stop()
        await upstream.stop()
    assert got == []  # nothing crossed the pipe
    files = sorted(tmp_path.glob("t.*.jsonl"))
    assert [f.name for f in files] == ["t.0.jsonl", "t.1.jsonl"]
    recs, origins = [], []
    for f in files:
        lines = [json.loads(x) for x in f.read_text().splitlines()]
        origins.append(lines[0]["clock_t0_unix"])
        recs += lines[1:]
        assert PROMPT_MARKER not in f.read_text()
    arrives = sorted(d["id"] for d in recs if d["event"] == "arrive")
    assert arrives == [f"w-{i}" for i in range(6)]
    assert sorted(d["id"] for d in recs if d["event"] == "finish") == arrives
    # one clock: both workers' origins are the parent's run start
    assert abs(origins[0] - origins[1]) < 1e-3
    assert abs(origins[0] - parent_origin) < 1e-3
