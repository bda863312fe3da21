"""Probe: canary streams at a bounded rate, recorded like proxied requests (issue 4)."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Callable

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


async def _run_until(probe: Probe, done: Callable[[], bool], deadline_s: float = 30.0) -> None:
    """Run the probe until ``done()`` (``deadline_s`` bounds a hang only), then stop it."""
    stop = asyncio.Event()
    task = asyncio.create_task(probe.run(stop))
    end = time.monotonic() + deadline_s
    while not done() and time.monotonic() < end:
        await asyncio.sleep(0.02)
    stop.set()
    await asyncio.wait_for(task, 30)


async def test_probe_streams_are_recorded_at_the_configured_rate(upstream):
    rec = Recorder()
    probe = Probe(upstream.url, 4.0, rec, time.monotonic, max_tokens=8)

    def arrivals() -> list:
        return [r for r in rec.records if r.event == "arrive"]

    t0 = time.monotonic()
    await _run_until(probe, lambda: len(arrivals()) >= 6
                     and sum(r.event == "finish" for r in rec.records) >= 4)
    ran = time.monotonic() - t0
    arrives = arrivals()
    # a depth-one bucket at 4/s: its ticks are at least a quarter second apart, never more than 4 a
    # second plus the one it starts with. A start is stamped when its task first runs, before the
    # next tick can fire (one event loop), so starts i and j are at least (j - i - 1) ticks apart
    # however late a busy machine ran either of them
    assert 6 <= len(arrives) <= 4 * ran + 1
    starts = [r.t for r in arrives]
    assert all(starts[j] - starts[i] >= (j - i - 1) * 0.25 - 1e-3
               for i in range(len(starts)) for j in range(i + 1, len(starts)))
    assert all(r.cls == "probe" and r.source == "probe" and r.id.startswith("probe-") for r in arrives)
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
    await _run_until(probe, lambda: probe.skipped >= 8)
    arrives = [r for r in rec.records if r.event == "arrive"]
    assert probe.skipped >= 8
    assert len(arrives) == 2  # eight ticks came and went while two probes were stuck: none started
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
