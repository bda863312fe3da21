"""--otlp-endpoint: one span per request, a stall event per spike, OTel GenAI attribute names,
received by a real OTLP/HTTP endpoint that decodes the body with opentelemetry-proto."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import REPO, wait_for_line

pytest.importorskip("opentelemetry.proto", reason="the otlp extra (opentelemetry-proto) is not installed")

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: E402
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span  # noqa: E402

from kvtop.analysis.analyzer import Analyzer  # noqa: E402
from kvtop.cli import main  # noqa: E402
from kvtop.model.trace import TraceReader  # noqa: E402
from kvtop.otlp import LiveExport  # noqa: E402

ALLOWED_SPAN_KEYS = {"kvtop.request.id", "kvtop.request.tokens", "gen_ai.usage.output_tokens", "kvtop.stalls",
                     "gen_ai.request.model", "kvtop.engine.adapter", "gen_ai.usage.input_tokens",
                     "kvtop.time_to_first_chunk_s", "kvtop.request.ended_by", "kvtop.max_gap_s",
                     "kvtop.stalls_dropped", "server.address", "server.port"}


class Receiver:
    """An OTLP/HTTP traces endpoint: POST /v1/traces, protobuf body, decoded as the collector does."""

    def __init__(self) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        self.content_types: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the http.server API
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                outer.requests.append(req)
                outer.content_types.append(self.headers["Content-Type"])
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def spans(self) -> list[Span]:
        return [s for r in self.requests for rs in r.resource_spans for ss in rs.scope_spans for s in ss.spans]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def storm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    trace = tmp_path_factory.mktemp("otlp") / "storm.jsonl"
    assert main(["simulate", "--preset", "preemption-storm", "--seed", "1", "--duration", "40", "-o", str(trace)]) == 0
    return trace


def _attrs(kvs) -> dict[str, object]:  # noqa: ANN001
    out: dict[str, object] = {}
    for kv in kvs:
        v = kv.value
        out[kv.key] = getattr(v, v.WhichOneof("value"))
    return out


def test_analyze_exports_one_span_per_request_with_its_stalls(storm, receiver, capsys) -> None:
    capsys.readouterr()
    assert main(["analyze", str(storm), "--format", "json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert main(["analyze", str(storm), "--format", "json", "--otlp-endpoint", receiver.url]) == 0
    err = capsys.readouterr().err
    assert f"to {receiver.url}/v1/traces" in err
    assert receiver.content_types and set(receiver.content_types) == {"application/x-protobuf"}
    res = _attrs(receiver.requests[0].resource_spans[0].resource.attributes)
    assert res["service.name"] == "kvtop"
    spans = receiver.spans()
    by_id = {_attrs(s.attributes)["kvtop.request.id"]: s for s in spans}
    # every request of the report is a span, each its own trace
    assert set(by_id) == {r["request_id"] for r in rep["requests"]}
    assert len({s.trace_id for s in spans}) == len(spans)
    # every spike is a stall event on its request's span, with its cause, rule and confidence
    events = [(rid, e) for rid, s in by_id.items() for e in s.events]
    assert len(events) == rep["spikes_total"] == 17
    for sp in rep["spikes"]:
        evs = [_attrs(e.attributes) for rid, e in events if rid == sp["request_id"]]
        match = [a for a in evs if a["kvtop.stall.gap_s"] == pytest.approx(sp["gap_s"])]
        assert len(match) == 1
        a = match[0]
        assert a["kvtop.stall.cause"] == sp["cause"] == "preemption"
        assert a["kvtop.stall.confidence"] == pytest.approx(sp["confidence"])
        assert a["kvtop.stall.rule"] == sp["rule"]
    # GenAI names, the run's wall clock, and nothing beyond the listed keys
    header = TraceReader(str(storm)).header
    t0 = datetime.fromisoformat(header["started_at"].replace("Z", "+00:00")).timestamp()
    worst = max(rep["requests"], key=lambda r: r["max_gap_s"])
    s = by_id[worst["request_id"]]
    a = _attrs(s.attributes)
    assert a["gen_ai.request.model"] == "sim-llama-3.1-8b"
    assert a["gen_ai.usage.output_tokens"] == worst["tokens"]
    assert a["kvtop.max_gap_s"] == pytest.approx(worst["max_gap_s"])
    assert s.kind == Span.SPAN_KIND_CLIENT
    assert t0 <= s.start_time_unix_nano / 1e9 <= t0 + 41 and s.end_time_unix_nano > s.start_time_unix_nano
    stall_t = min(e.time_unix_nano for e in s.events) / 1e9
    first = min(x["t_start"] for x in rep["spikes"] if x["request_id"] == worst["request_id"])
    assert stall_t == pytest.approx(t0 + first, abs=1e-3)
    for span in spans:
        assert set(_attrs(span.attributes)) <= ALLOWED_SPAN_KEYS


def test_an_unreachable_receiver_is_a_runtime_failure(storm, capsys) -> None:
    capsys.readouterr()
    assert main(["analyze", str(storm), "--otlp-endpoint", "http://127.0.0.1:9/v1/traces"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "OTLP export to http://127.0.0.1:9/v1/traces failed" in err[0]


@pytest.mark.parametrize("url", ["ftp://127.0.0.1:4318", "127.0.0.1:4318", "http://"])
def test_a_bad_endpoint_is_a_usage_error(storm, capsys, url: str) -> None:
    capsys.readouterr()
    assert main(["analyze", str(storm), "--otlp-endpoint", url]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--otlp-endpoint" in err[0]
    assert main(["agent", "--url", "http://127.0.0.1:9", "--otlp-endpoint", url]) == 2


def test_live_export_sends_each_request_once_it_has_ended_and_settled(storm, receiver) -> None:
    """The agent's path: a live analysis fed record by record, ticked once a second."""
    an = Analyzer(itl_target_s=0.1)
    live = LiveExport(receiver.url + "/v1/traces", clock0_unix=1_700_000_000.0)
    reader = TraceReader(str(storm))
    an.set_header(reader.header)
    next_tick = 1.0
    ended_at: dict[str, float] = {}
    for d in reader.dicts():
        t = d.get("t")
        if isinstance(t, (int, float)) and t >= next_tick:
            an.tick(t)
            live.tick(an, t, "m", "vllm")
            next_tick = t + 1.0
        an.feed_dict(d)
        if d.get("kind") == "request" and d.get("event") in ("finish", "cancel", "error"):
            ended_at.setdefault(d["id"], t)
    an.finish()
    live.tick(an, an.now + 60.0, "m", "vllm")  # after the run: everything ended has settled
    live.close()
    spans = receiver.spans()
    ids = [_attrs(s.attributes)["kvtop.request.id"] for s in spans]
    assert len(ids) == len(set(ids)) == len(ended_at)  # each ended request once
    # every stall of those requests (sim-15 is still streaming when the trace ends: no span yet)
    assert an.n_spikes == 17
    assert sum(len(s.events) for s in spans) == sum(1 for sp in an.spikes if sp.request_id in ended_at) == 13
    assert live.sender.sent >= 2 and live.sender.failures == 0  # spans went out during the run, not only at its end
    for s in spans:
        a = _attrs(s.attributes)
        assert s.end_time_unix_nano == pytest.approx((1_700_000_000.0 + ended_at[a["kvtop.request.id"]]) * 1e9, abs=2e3)


def test_live_export_never_waits_for_the_receiver(storm, receiver) -> None:
    """The post runs on the sender's thread: a receiver that holds the request does not hold the tick."""
    held = threading.Event()
    release = threading.Event()
    handler = receiver.server.RequestHandlerClass
    original = handler.do_POST

    def slow(self) -> None:  # noqa: ANN001
        held.set()
        release.wait(30)
        original(self)

    handler.do_POST = slow
    live = LiveExport(receiver.url + "/v1/traces", clock0_unix=0.0)
    an = Analyzer(itl_target_s=0.1)
    for d in TraceReader(str(storm)).dicts():
        an.feed_dict(d)
    an.finish()
    live.tick(an, an.now + 60.0, None, None)  # returns while the receiver holds the request
    assert held.wait(30)
    assert live.sender.sent == 0 and not receiver.requests
    release.set()
    live.close()
    assert live.sender.sent == 1 and len(receiver.spans()) == live.exported > 0


def test_a_dead_receiver_is_one_warning(storm, capsys) -> None:
    live = LiveExport("http://127.0.0.1:9/v1/traces", clock0_unix=0.0)
    an = Analyzer(itl_target_s=0.1)
    for d in TraceReader(str(storm)).dicts():
        an.feed_dict(d)
    an.finish()
    live.tick(an, an.now + 60.0, None, None)
    live.close()
    assert live.sender.failures == 1 and live.sender.sent == 0
    assert capsys.readouterr().err.count("kvtop: warning: OTLP export to http://127.0.0.1:9/v1/traces failed") == 1


@pytest.mark.slow
def test_the_agent_exports_its_probe_streams_as_they_end(receiver) -> None:
    """`kvtop agent --probe --otlp-endpoint`: each probe stream arrives as a span while the agent runs."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1",
           "XDG_CONFIG_HOME": str(REPO / ".cache" / "no-config")}

    def spawn(*args: str) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-m", "kvtop", *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)

    started = time.time()
    sim = spawn("sim-server", "--preset", "healthy", "--port", "0", "--duration", "90")
    agent = None
    try:
        sim_url = wait_for_line(sim.stdout, r"at (http://127\.0\.0\.1:\d+)").group(1)
        agent = spawn("agent", "--url", sim_url, "--listen", "127.0.0.1:0", "--probe", "4", "--no-gpu",
                      "--interval", "0.5", "--otlp-endpoint", receiver.url)
        line = wait_for_line(agent.stderr, r"OTLP spans to (\S+)\)?")
        assert line.group(1).startswith(receiver.url + "/v1/traces")
        deadline = time.monotonic() + 60
        while len(receiver.spans()) < 5 and time.monotonic() < deadline:
            time.sleep(0.5)
        during = len(receiver.spans())
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(30) == 0
    finally:
        for proc in (agent, sim):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    assert during >= 5  # spans arrived while the agent ran, not only at its stop
    spans = receiver.spans()
    ids = [_attrs(s.attributes)["kvtop.request.id"] for s in spans]
    assert len(ids) == len(set(ids)) and all(str(i).startswith("probe-") for i in ids)
    ended = {str(_attrs(s.attributes)["kvtop.request.ended_by"]) for s in spans}
    assert "finish" in ended and ended <= {"finish", "cancel"}  # probes cut off at the stop: cancelled
    for s in spans:
        a = _attrs(s.attributes)
        assert a["gen_ai.usage.output_tokens"] > 0 or a["kvtop.request.ended_by"] == "cancel"
        assert started - 1 <= s.start_time_unix_nano / 1e9 <= s.end_time_unix_nano / 1e9 <= time.time() + 1


@pytest.mark.slow
def test_record_exports_spans_beside_its_trace(receiver, tmp_path) -> None:
    """`kvtop record --probe --otlp-endpoint`: the spans are the trace's finished requests."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1",
           "XDG_CONFIG_HOME": str(REPO / ".cache" / "no-config")}
    sim = subprocess.Popen([sys.executable, "-m", "kvtop", "sim-server", "--preset", "healthy", "--port", "0",
                            "--duration", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    trace = tmp_path / "t.jsonl"
    try:
        sim_url = wait_for_line(sim.stdout, r"at (http://127\.0\.0\.1:\d+)").group(1)
        r = subprocess.run([sys.executable, "-m", "kvtop", "record", "-o", str(trace), "--url", sim_url, "--probe", "4",
                            "--no-gpu", "--interval", "0.5", "--duration", "6", "--otlp-endpoint", receiver.url],
                           capture_output=True, text=True, env=env, timeout=120)
    finally:
        sim.kill()
        sim.wait()
    assert r.returncode == 0, r.stderr
    assert f"OTLP spans to {receiver.url}/v1/traces" in r.stderr
    # every request of the trace that ended (the probes still streaming at the stop end as cancelled)
    ended = {d["id"] for d in TraceReader(str(trace)).dicts() if d.get("event") in ("finish", "cancel", "error")}
    ids = [_attrs(s.attributes)["kvtop.request.id"] for s in receiver.spans()]
    assert len(ended) >= 5
    assert len(ids) == len(set(ids)) and set(ids) == ended


def test_an_agent_segment_is_timed_from_the_agents_start_not_the_segments() -> None:
    # an agent's third 10-minute segment opened 20 minutes into its run: its spans were shifted by
    # those 20 minutes (the segment's started_at stood in for the run's clock origin)
    from kvtop.otlp import clock0

    head = {"started_at": "2026-12-06T12:20:00.000Z", "agent_wall_t0": 1_796_559_600.5}
    assert clock0(head) == 1_796_559_600.5
    assert clock0({"started_at": "2026-12-06T12:20:00.000Z"}) == datetime.fromisoformat(
        "2026-12-06T12:20:00+00:00").timestamp()
    assert clock0({"clock_t0_unix": 5.0, "agent_wall_t0": 7.0}) == 5.0


def test_spans_say_which_host_pod_and_node_sent_them() -> None:
    import socket as _socket

    from kvtop.otlp import resource_attributes

    plain = resource_attributes(env={})
    assert plain["service.name"] == "kvtop" and plain["host.name"] == _socket.gethostname()
    pod = resource_attributes(env={"POD_NAME": "vllm-0", "POD_NAMESPACE": "serve", "NODE_NAME": "gpu-7",
                                   "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=prod,team=a%2Cb",
                                   "OTEL_SERVICE_NAME": "kvtop-sidecar"})
    assert (pod["k8s.pod.name"], pod["k8s.namespace.name"], pod["k8s.node.name"]) == ("vllm-0", "serve", "gpu-7")
    assert pod["deployment.environment"] == "prod" and pod["team"] == "a,b"
    assert pod["service.name"] == "kvtop-sidecar"


def test_a_receiver_that_asks_to_retry_gets_the_batch_again() -> None:
    # OTLP/HTTP: 429/502/503/504 are retryable, honouring Retry-After; the batch was dropped after one
    # warning line and the loss counted nowhere
    from kvtop.otlp import Sender

    answers = [503, 503, 200]
    seen: list[str] = []

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a) -> None:  # noqa: ANN002
            pass

        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            code = answers.pop(0) if answers else 400
            seen.append(str(code))
            self.send_response(code)
            if code == 503:
                self.send_header("Retry-After", "0")
            self.send_header("Content-Length", "0")
            self.end_headers()

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}/v1/traces"
        s = Sender(url, delays_s=(5.0, 5.0, 5.0))  # Retry-After: 0 is honoured, not the 5 s backoff
        s.submit(b"batch")
        t0 = time.monotonic()
        while s.sent + s.failures == 0 and time.monotonic() - t0 < 10:
            time.sleep(0.01)
        s.close(wait_s=10)
        assert (s.sent, s.retries, s.failures) == (1, 2, 0) and seen == ["503", "503", "200"]
        assert time.monotonic() - t0 < 4.0
        # a refusal that is not retryable is one try, and the run's end says what was lost
        s = Sender(url, delays_s=(0.01,))
        s.submit(b"batch")
        s.close(wait_s=10)
        assert (s.sent, s.retries, s.failures) == (0, 0, 1) and seen[-1] == "400"
        assert s.summary() == f"kvtop: warning: OTLP export to {url}: 0 batch(es) sent, 1 failed after retries, 0 dropped (queue full)"
    finally:
        srv.shutdown()
        srv.server_close()
