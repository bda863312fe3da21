"""The `--prometheus` read side without a real Prometheus: name normalisation through the real
adapters, the HTTP API client's one-line errors, a degraded row when one instance fails, and the
command line's exit 2. (tests/test_prometheus_real.py runs the same code against the real server.)"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest
from conftest import fixture_text, run_kvtop

from kvtop.core import Core
from kvtop.feeds.prometheus import PromFeed
from kvtop.plugin import load_adapter
from kvtop.sources.prom import parse_page
from kvtop.sources.promapi import PromClient, PromError
from kvtop.sources.promfleet import (
    PromFleet,
    canonical_name,
    exposition,
    parse_selector,
    parse_time,
)


def _samples(text: str) -> list[tuple[dict[str, str], float]]:
    page = parse_page(text)
    return [({**lb, "__name__": name}, v) for name, rows in page.samples.items() for lb, v in rows]


@pytest.mark.parametrize(("fixture", "adapter"), [
    ("sglang-v0.4.3-docs-production-metrics.prom", "sglang"),
    ("vllm-0.32.0-cpu-live-idle.prom", "vllm"),
    ("llamacpp-b9014-cassette-metrics-idle.prom", "llamacpp"),
])
def test_rewritten_names_read_back_exactly_like_the_engines_own_page(fixture, adapter):
    text = fixture_text(fixture)
    # what remote-write / relabelling leaves in Prometheus: "sglang:x" stored as "sglang_x",
    # plus the job/instance labels Prometheus adds to every series
    stored = [({**lb, "__name__": lb["__name__"].replace(":", "_"), "job": "j", "instance": "h:1"}, v)
              for lb, v in _samples(text)]
    assert all(":" not in lb["__name__"] for lb, _ in stored)
    cls = load_adapter(adapter)
    direct = cls().parse(text, 5.0)
    back = cls().parse(exposition(stored), 5.0)
    assert len(back) == len(direct)
    for a, b in zip(direct, back, strict=True):
        for f in ("kv_usage", "running", "waiting", "preemptions_total", "generation_tokens_total", "model"):
            assert getattr(a, f) == getattr(b, f), f
        assert (a.itl is None) == (b.itl is None)
        if a.itl is not None and b.itl is not None:
            assert a.itl.buckets == b.itl.buckets and a.itl.count == b.itl.count


def test_canonical_names():
    assert canonical_name("sglang_num_running_reqs") == "sglang:num_running_reqs"
    assert canonical_name("vllm:num_preemptions_total") == "vllm:num_preemptions_total"
    assert canonical_name("tgi_queue_size") == "tgi_queue_size"
    assert canonical_name("kvtop_engine_up") == "kvtop_engine_up"


def test_selector_and_time_parsing():
    assert parse_selector('{job="vllm"}') == 'job="vllm"'
    assert parse_selector('job="vllm",region=~"eu.*"') == 'job="vllm",region=~"eu.*"'
    with pytest.raises(ValueError):
        parse_selector("vllm")
    assert parse_time("now-1h", now=10_000.0) == 6400.0
    assert parse_time("2026-01-01T00:00:00Z") == 1767225600.0
    assert parse_time("1767225600") == 1767225600.0
    with pytest.raises(ValueError):
        parse_time("yesterday")


# -- a scripted HTTP server standing in for Prometheus's API -----------------------------------------
class _Api(BaseHTTPRequestHandler):
    routes: dict = {}

    def log_message(self, *a) -> None:  # noqa: ANN002
        pass

    def do_GET(self) -> None:  # noqa: N802
        q = parse_qs(urlsplit(self.path).query).get("query", [""])[0]
        for key, fn in self.routes.items():
            if key in q:
                status, body = fn(q)
                break
        else:
            status, body = 200, {"status": "success", "data": {"resultType": "vector", "result": []}}
        if status == "hang":
            time.sleep(3)
            return
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        try:
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass


@pytest.fixture
def api():
    routes: dict = {}
    handler = type("H", (_Api,), {"routes": routes})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", routes
    srv.shutdown()
    srv.server_close()


def _vec(rows):  # noqa: ANN001
    return 200, {"status": "success", "data": {"resultType": "vector",
                                                "result": [{"metric": m, "value": [time.time(), str(v)]} for m, v in rows]}}


def test_http_errors_are_one_line_messages(api):
    url, routes = api
    c = PromClient(url, timeout_s=1.0, max_bytes=1 << 20, max_series=5)
    routes["bad_syntax"] = lambda q: (400, {"status": "error", "errorType": "bad_data",
                                            "error": "1:10: parse error: unexpected identifier"})
    with pytest.raises(PromError, match=r"HTTP 400 .*parse error: unexpected identifier$"):
        c.query("bad_syntax(")
    routes["overloaded"] = lambda q: (503, b"Service Unavailable\n")
    with pytest.raises(PromError, match=r"HTTP 503"):
        c.query("overloaded")
    routes["slow"] = lambda q: ("hang", None)
    with pytest.raises(PromError, match=r"timed out after 1s"):
        c.query("slow")
    routes["huge"] = lambda q: (200, b'{"status":"success","data":{"resultType":"vector","result":[' + b" " * (2 << 20))
    with pytest.raises(PromError, match=r"larger than 1 MiB.*--selector"):
        c.query("huge")
    routes["many"] = lambda q: _vec([({"__name__": "x", "i": str(i)}, i) for i in range(6)])
    with pytest.raises(PromError, match=r"matched 6 series \(limit 5\)"):
        c.query("many")
    routes["html"] = lambda q: (200, b"<html>login</html>")
    with pytest.raises(PromError, match=r"is not a Prometheus API"):
        c.query("html")


def test_a_malformed_answer_is_a_degraded_row(api):
    url, routes = api
    routes["count by (job, instance)"] = lambda q: _vec([({"job": "vllm", "instance": "odd:8000"}, 30)])
    routes['instance="odd:8000"'] = lambda q: (200, {"status": "success", "data": {"resultType": "matrix", "result": [
        {"metric": {"__name__": "vllm:num_requests_running"}, "values": [["not a time", "1"]]}]}})
    core = Core()
    PromFeed(core, url, window_s=10, step_s=1).poll_once()
    [e] = core.snapshot().engines
    assert not e.up and (e.error or "").startswith("malformed Prometheus answer for ")


def test_unreachable_prometheus():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(PromError, match=r"cannot connect to Prometheus at http://127.0.0.1:\d+"):
        PromClient(f"127.0.0.1:{port}", timeout_s=1.0).query("up")


def _vllm_matrix(instance: str) -> tuple[int, dict]:
    text = fixture_text("vllm-0.32.0-cpu-live-idle.prom")
    now = time.time()
    result = []
    for lb, v in _samples(text):
        if not lb["__name__"].startswith("vllm:"):
            continue
        m = {**lb, "job": "vllm", "instance": instance}
        result.append({"metric": m, "values": [[now - 2, str(v)], [now - 1, str(v)]]})
    return 200, {"status": "success", "data": {"resultType": "matrix", "result": result}}


def test_one_failing_instance_is_a_degraded_row_not_a_crash(api):
    url, routes = api
    routes["count by (job, instance)"] = lambda q: _vec([({"job": "vllm", "instance": "good:8000"}, 30),
                                                        ({"job": "vllm", "instance": "bad:8000"}, 30)])
    routes['instance="good:8000"'] = lambda q: _vllm_matrix("good:8000")
    routes['instance="bad:8000"'] = lambda q: (500, {"status": "error", "error": "query timed out in expression evaluation"})
    core = Core()
    feed = PromFeed(core, url, window_s=10, step_s=1)
    feed.poll_once()
    snap = core.snapshot()
    by = {e.url: e for e in snap.engines}
    assert set(by) == {"good:8000", "bad:8000"}
    assert by["good:8000"].up and by["good:8000"].adapter == "vllm" and by["good:8000"].kv_usage is not None
    assert not by["bad:8000"].up
    err = by["bad:8000"].error or ""
    assert err.startswith("Prometheus HTTP 500") and "\n" not in err


def test_prometheus_going_away_marks_its_engines_down_with_one_event(api):
    url, routes = api
    routes["count by (job, instance)"] = lambda q: _vec([({"job": "vllm", "instance": "good:8000"}, 30)])
    routes['instance="good:8000"'] = lambda q: _vllm_matrix("good:8000")
    core = Core()
    feed = PromFeed(core, url, window_s=10, step_s=1)
    feed.poll_once()
    assert core.snapshot().engines[0].up
    routes["count by (job, instance)"] = lambda q: (503, b"down for maintenance")
    feed.poll_once()
    feed.poll_once()
    snap = core.snapshot()
    assert not snap.engines[0].up and "HTTP 503" in (snap.engines[0].error or "")
    assert sum(1 for e in snap.events if e.message.startswith("Prometheus: ")) == 1


def test_fleet_reads_agent_verdicts_and_spikes(api):
    url, routes = api
    # the mechanism's route first: "kvtop_verdict" is a prefix of its query
    routes["kvtop_verdict_mechanism{} == 1"] = lambda q: _vec([({"engine": "10.0.0.5:8000", "instance": "n1:9470",
                                                               "mechanism": "recompute"}, 1)])
    routes["kvtop_verdict{} == 1"] = lambda q: _vec([({"engine": "10.0.0.5:8000", "instance": "n1:9470",
                                                     "action": "admission"}, 1)])
    routes["kvtop_verdict_confidence"] = lambda q: _vec([({"engine": "10.0.0.5:8000", "instance": "n1:9470"}, 0.7)])
    routes["kvtop_token_gap_spikes_total"] = lambda q: _vec([
        ({"engine": "10.0.0.5:8000", "instance": "n1:9470", "cause": "preemption"}, 42),
        ({"engine": "10.0.0.5:8000", "instance": "n1:9470", "cause": "slow_decode"}, 3)])
    agents = PromFleet(PromClient(url)).poll_agents()
    a = agents[("10.0.0.5:8000", "n1:9470")]
    assert (a.action, a.mechanism, a.confidence, a.instance) == ("admission", "recompute", 0.7, "n1:9470")
    assert a.spikes == {"preemption": 42.0, "slow_decode": 3.0}


def test_command_line_bad_input_exits_2_with_one_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cases = [
        ("analyze", "--prometheus", "http://127.0.0.1:9", "--start", "yesterday"),
        ("analyze", "--prometheus", "http://127.0.0.1:9", "--start", "now-1h", "--end", "now-2h"),
        ("analyze", "--prometheus", "http://127.0.0.1:9", "--selector", "vllm"),
        ("analyze",),
        ("snapshot", "--prometheus", "http://127.0.0.1:9", "--url", "http://127.0.0.1:8000"),
    ]
    for args in cases:
        r = run_kvtop(*args, timeout=60)
        assert r.returncode == 2, (args, r.stderr)
        assert r.stderr.count("\n") == 1 and r.stderr.startswith("kvtop: error: "), (args, r.stderr)
        assert "Traceback" not in r.stderr
    # a Prometheus that does not answer (a closed loopback port) is a run failure: exit 1
    for args in (("snapshot", "--prometheus", f"http://127.0.0.1:{port}", "--timeout", "1"),
                 ("analyze", "--prometheus", f"http://127.0.0.1:{port}", "--timeout", "1")):
        r = run_kvtop(*args, timeout=60)
        assert r.returncode == 1, (args, r.stderr)
        assert r.stderr.count("\n") == 1 and f"127.0.0.1:{port}" in r.stderr, (args, r.stderr)


def test_snapshot_says_when_prometheus_scrapes_no_engine(api):
    url, routes = api
    r = run_kvtop("snapshot", "--prometheus", url, timeout=60)
    assert r.returncode == 1
    assert r.stderr.strip() == f"kvtop: error: Prometheus at {url} scrapes no engine (vLLM, SGLang, TGI, llama.cpp, Triton metric names)"


def test_prometheus_reads_send_the_token_from_token_file(tmp_path):
    """--token-file reaches the Prometheus API as a bearer token (it was once read only for /metrics
    scrapes), and the token itself is never printed."""
    seen: list[str | None] = []

    class Seeing(_Api):
        routes: dict = {}

        def do_GET(self) -> None:  # noqa: N802
            seen.append(self.headers.get("Authorization"))
            super().do_GET()

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Seeing)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    token = tmp_path / "token"
    token.write_text("s3cret-from-file\n")
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        r = run_kvtop("snapshot", "--prometheus", url, "--token-file", str(token), timeout=60)
    finally:
        srv.shutdown()
        srv.server_close()
    assert seen and all(a == "Bearer s3cret-from-file" for a in seen), seen
    assert r.returncode == 1  # this server scrapes no engine: a one-line answer
    assert "s3cret" not in r.stdout + r.stderr


def test_a_prometheus_whose_clock_runs_ahead_is_read_on_its_own_clock(api):
    # Prometheus 90 s ahead of this host: its samples were placed 90 s in the run's future (and the
    # range asked ended at this host's now, so the newest steps repeated the last sample)
    url, routes = api
    ahead = 90.0

    def matrix(q):  # noqa: ANN001, ANN202
        status, body = _vllm_matrix("a:8000")
        for r in body["data"]["result"]:
            r["values"] = [[t + ahead, v] for t, v in r["values"]]
        return status, body

    routes["up{}"] = lambda q: (200, {"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": {"job": "vllm", "instance": "a:8000"}, "value": [time.time() + ahead, "1"]}]}})
    routes["count by (job, instance)"] = lambda q: _vec([({"job": "vllm", "instance": "a:8000"}, 30)])
    routes['instance="a:8000"'] = matrix
    fleet = PromFleet(PromClient(url), window_s=10, step_s=1)
    recs = fleet.poll()
    assert recs and fleet.skew_s == pytest.approx(ahead, abs=2.0)
    now = fleet._clock()
    assert all(now - 3.0 <= r.t <= now + 0.5 for r in recs), (now, [r.t for r in recs])


def test_an_engine_prometheus_cannot_scrape_is_a_down_row_from_the_first_poll(api):
    # a target with up == 0 has no engine series now: it was missing from a fresh fleet view
    url, routes = api
    now = time.time()
    routes["up{}"] = lambda q: (200, {"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": {"job": "vllm", "instance": "a:8000"}, "value": [now, "1"]},
        {"metric": {"job": "vllm", "instance": "b:8000"}, "value": [now, "0"]},
        {"metric": {"job": "node", "instance": "n:9100"}, "value": [now, "0"]}]}})
    routes["last_over_time"] = lambda q: _vec([({"job": "vllm", "instance": "b:8000"}, 30)] if "b:8000" in q else [])
    routes["count by (job, instance)"] = lambda q: _vec([({"job": "vllm", "instance": "a:8000"}, 30)])
    routes['instance="a:8000"'] = lambda q: _vllm_matrix("a:8000")
    core = Core()
    PromFeed(core, url, window_s=10, step_s=1).poll_once()
    by = {e.url: e for e in core.snapshot().engines}
    assert set(by) == {"a:8000", "b:8000"}  # not the node exporter, which never had engine series
    assert by["a:8000"].up and not by["b:8000"].up
    assert "up == 0" in (by["b:8000"].error or "")
