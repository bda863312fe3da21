"""Probe: canary streams at a bounded rate, recorded like proxied requests (issue 4)."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest
from test_proxy import SCRIPTS, Recorder, ScriptedUpstream

from kvtop.sources.probe import Probe


@pytest.fixture
async def upstream():
    u = ScriptedUpstream()
    await u.start()
    yield u
    await u.stop()


async def _run_for(probe: Probe, seconds: float) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(probe.run(stop))
    await asyncio.sleep(seconds)
    stop.set()
    await asyncio.wait_for(task, 5)


async def test_probe_streams_are_recorded_at_the_configured_rate(upstream):
    rec = Recorder()
    probe = Probe(upstream.url, 4.0, rec, time.monotonic, max_tokens=8)
    t0 = time.monotonic()
    await _run_for(probe, 1.6)
    arrives = [r for r in rec.records if r.event == "arrive"]
    # depth-one bucket at 4/s over 1.6 s: at most 4 * 1.6 + 1 starts
    assert 5 <= len(arrives) <= 7
    starts = [r.t for r in arrives]
    assert all(b - a >= 0.24 for a, b in zip(starts, starts[1:], strict=False))
    assert all(r.cls == "probe" and r.source == "probe" and r.id.startswith("probe-") for r in arrives)
    assert starts[0] - t0 < 0.2
    # model discovered from /v1/models; bounded max_tokens; streaming
    body = json.loads(next(iter(upstream.bodies.values())))
    assert body["model"] == "m" and body["max_tokens"] == 8 and body["stream"] is True
    # a probe that ran to the end has the scripted steady timeline: 8 tokens then finish
    done = [r.id for r in rec.records if r.event == "finish"]
    assert len(done) >= 4
    for rid in done:
        evs = [r for r in rec.of(rid)]
        toks = [r for r in evs if r.event in ("first_token", "token")]
        assert len(toks) == len([1 for _, _, k in SCRIPTS["steady"] if k])
        assert evs[-1].finish_reason == "length"
        # the X-Request-Id the probe sent is the id it recorded (joins engine-side evidence)
        assert rid in upstream.t0
    # stopping mid-stream records the cut-off probes as cancelled, never leaves them open
    ended = {r.id for r in rec.records if r.event in ("finish", "cancel", "error")}
    assert ended == {r.id for r in arrives}


async def test_probe_never_piles_onto_a_stalled_engine(upstream):
    upstream.default_script = "endless"
    rec = Recorder()
    probe = Probe(upstream.url, 20.0, rec, time.monotonic, max_in_flight=2)
    await _run_for(probe, 0.6)
    arrives = [r for r in rec.records if r.event == "arrive"]
    assert len(arrives) == 2
    assert probe.skipped >= 8
    assert sorted(r.error for r in rec.records if r.event == "cancel") == ["probe_stopped"] * 2


async def test_probe_waits_quietly_while_engine_is_down():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rec = Recorder()
    probe = Probe(f"http://127.0.0.1:{port}", 10.0, rec, time.monotonic)
    await _run_for(probe, 0.5)
    assert rec.records == [] and probe.started == 0


async def test_probe_with_given_model_records_errors(upstream):
    rec = Recorder()
    upstream.default_script = "error500"
    probe = Probe(upstream.url, 5.0, rec, time.monotonic, model="given")
    await _run_for(probe, 0.3)
    assert json.loads(next(iter(upstream.bodies.values())))["model"] == "given"
    errs = [r for r in rec.records if r.event == "error"]
    assert errs and all(r.status == 500 and r.error == "http_500" for r in errs)
