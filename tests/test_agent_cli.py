"""`kvtop agent` as a user runs it: against `kvtop sim-server`, with probes and a trace directory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict

import httpx
import pytest
from conftest import REPO, run_kvtop, wait_for_line
from page_server import PageServer
from prometheus_client.parser import text_string_to_metric_families
from vllm_pages import vllm_page

from kvtop.model.trace import TraceReader
from kvtop.model.trace_rotate import segments
from testkit.privileges import can_capture


def _spawn(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1",
           "XDG_CONFIG_HOME": str(REPO / ".cache" / "no-config")}  # a user's config must not leak in
    return subprocess.Popen([sys.executable, "-m", "kvtop", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


@pytest.mark.slow
def test_agent_serves_metrics_and_leaves_replayable_segments(tmp_path):
    sim = _spawn("sim-server", "--preset", "healthy", "--port", "0", "--duration", "60")
    agent = None
    try:
        sim_url = wait_for_line(sim.stdout, r"at (http://127\.0\.0\.1:\d+)").group(1)
        agent = _spawn("agent", "--url", sim_url, "--listen", "127.0.0.1:0", "--probe", "4", "--no-gpu",
                       "--interval", "0.5", "--trace-dir", str(tmp_path / "traces"), "--trace-max-age", "3s")
        url = wait_for_line(agent.stderr, r"metrics (http://[\d.:]+)/metrics").group(1)
        deadline = time.monotonic() + 30
        while True:
            r = httpx.get(url + "/metrics", timeout=5)
            fams = {f.name: f for f in text_string_to_metric_families(r.text)}
            streams = sum(s.value for s in fams["kvtop_streams_observed"].samples if s.name.endswith("_total"))
            if streams >= 10 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
        assert streams >= 10
        engine = sim_url.split("//")[1]
        up = {s.labels["engine"]: s.value for s in fams["kvtop_engine_up"].samples}
        assert up == {engine: 1.0}
        by: dict[str, float] = defaultdict(float)
        for s in fams["kvtop_stream_inter_token_gap_seconds"].samples:
            if s.name.endswith("_count"):
                by[s.labels["engine"]] += s.value
        assert by[engine] > 50  # the probes' tokens
        rep = httpx.get(url + "/report", timeout=5).json()
        assert rep["engine"] == engine and set(rep["spikes_by_cause"]) >= {"preemption", "slow_decode"}
        assert httpx.get(url + "/healthz", timeout=5).text == "ok\n"
        # at least one age rotation (3 s), done while running: wait for its compressed segment
        deadline = time.monotonic() + 30  # bounds a hang only
        while not segments(tmp_path / "traces") and time.monotonic() < deadline:
            time.sleep(0.5)
        assert segments(tmp_path / "traces")
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(30) == 0
        segs = segments(tmp_path / "traces")
        assert len(segs) >= 2 and not list((tmp_path / "traces").glob("*.jsonl"))
        kinds: dict[str, int] = defaultdict(int)
        for p in segs:
            for d in TraceReader(p).dicts():
                kinds[d["kind"]] += 1
        assert kinds["engine"] >= 4 and kinds["request"] > 50
        done = run_kvtop("analyze", str(segs[-1]), "--format", "json")
        assert done.returncode == 0 and json.loads(done.stdout)["records"] > 0
    finally:
        for proc in (agent, sim):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def test_the_agent_keeps_credentials_in_the_url_out_of_metrics_report_and_trace(tmp_path):
    """An engine URL with user:password: the request series, /report and the trace header name the
    engine as ``***@host:port``, the label the engine series use, so both join in Prometheus."""
    sim = _spawn("sim-server", "--preset", "healthy", "--port", "0", "--duration", "60")
    agent = None
    try:
        sim_url = wait_for_line(sim.stdout, r"at (http://127\.0\.0\.1:\d+)").group(1)
        secret = sim_url.replace("http://", "http://ops:hunter2@")
        agent = _spawn("agent", "--url", secret, "--listen", "127.0.0.1:0", "--probe", "2", "--no-gpu",
                       "--interval", "0.5", "--trace-dir", str(tmp_path / "traces"))
        url = wait_for_line(agent.stderr, r"metrics (http://[\d.:]+)/metrics").group(1)
        deadline = time.monotonic() + 30
        while True:
            text = httpx.get(url + "/metrics", timeout=5).text
            fams = {f.name: f for f in text_string_to_metric_families(text)}
            gaps = [s for s in fams["kvtop_stream_inter_token_gap_seconds"].samples if s.name.endswith("_count")]
            if sum(s.value for s in gaps) > 10 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        report = httpx.get(url + "/report", timeout=5).text
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(30) == 0
        shown = "***@" + sim_url.split("//")[1]
        assert "hunter2" not in text + report
        assert {s.labels["engine"] for s in fams["kvtop_engine_up"].samples} == {shown}
        assert {s.labels["engine"] for s in gaps} == {shown} and sum(s.value for s in gaps) > 10
        assert json.loads(report)["engine"] == shown
        segs = segments(tmp_path / "traces")
        assert segs and all("hunter2" not in json.dumps(d) for p in segs for d in TraceReader(p).dicts())
        head = TraceReader(segs[0]).header
        assert head["urls"] == ["http://" + shown] and head["engine"]["url"] == "http://" + shown
        assert head["engine"]["adapter"] == "vllm"  # the live analysis judged by it; analyze does too
    finally:
        for proc in (agent, sim):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def test_a_malformed_request_to_the_metrics_port_is_one_line_that_quotes_none_of_it():
    # aiohttp answers 400 and logged a traceback whose message quoted the header's bytes (a bearer
    # token, a cookie); the proxy's port already said one line
    import socket

    sim = _spawn("sim-server", "--preset", "healthy", "--port", "0", "--duration", "60")
    agent = None
    try:
        sim_url = wait_for_line(sim.stdout, r"at (http://127\.0\.0\.1:\d+)").group(1)
        agent = _spawn("agent", "--url", sim_url, "--listen", "127.0.0.1:0", "--no-gpu", "--interval", "0.5")
        url = wait_for_line(agent.stderr, r"metrics (http://[\d.:]+)/metrics").group(1)
        port = int(url.rsplit(":", 1)[1])
        for raw in (b"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-SECRET-" + b"z" * 9000 + b"\r\n\r\n",
                    b"POST /metrics HTTP/1.1\r\nHost: x\r\nCookie: session=SECRET\r\nContent-Length: abc\r\n\r\n"):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
                c.sendall(raw)
                assert b" 400 " in c.recv(100).split(b"\r\n")[0]
        assert httpx.get(url + "/healthz", timeout=5).status_code == 200
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(30) == 0
        err = agent.stderr.read()
        assert "SECRET" not in err and "Traceback" not in err, err
        assert err.count("refused a malformed request") == 2, err
    finally:
        for proc in (agent, sim):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.parametrize("args", [
    ("agent",),
    ("agent", "--url", "http://127.0.0.1:8000", "--listen", "127.0.0.1:notaport"),
    ("agent", "--url", "ftp://x"),
    ("agent", "--url", "http://127.0.0.1:8000", "--interval", "0"),
    ("agent", "--url", "http://127.0.0.1:8000", "--trace-max-size", "lots"),
    ("agent", "--url", "http://127.0.0.1:8000", "--trace-max-age", "0"),
    ("agent", "--url", "http://127.0.0.1:8000", "--probe", "1000"),
    ("agent", "--url", "http://127.0.0.1:8000", "--adapter", "nosuch"),
])
def test_bad_input_exits_2_with_one_line(args, tmp_path):
    r = run_kvtop(*args, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr


def test_a_trace_dir_that_is_a_file_and_a_busy_port_are_one_line_errors(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    r = run_kvtop("agent", "--url", "http://127.0.0.1:9", "--trace-dir", str(f), timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == f"kvtop: error: --trace-dir {f} is not a directory"
    import socket

    with socket.socket() as s, PageServer() as engine:
        engine.route("/metrics", vllm_page(running=1))
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = run_kvtop("agent", "--url", engine.url, "--listen", f"127.0.0.1:{port}", "--no-gpu",
                      "--duration", "5", timeout=60)
    assert r.returncode == 1, r.stderr  # the port is taken: the run fails (1), the command line was fine
    # the agent logs (info) the engine it found, then the one error line
    last = r.stderr.splitlines()[-1]
    assert last.startswith(f"kvtop: error: cannot listen on 127.0.0.1:{port}") and r.stderr.count("kvtop: error:") == 1


@pytest.mark.slow
@pytest.mark.skipif(not can_capture(), reason="no packet capture here (needs root or CAP_NET_RAW)")
def test_agent_counts_captured_and_proxied_streams_once_each():
    sim = _spawn("sim-server", "--seed", "1", "--port", "0", "--duration", "60")
    agent = None
    try:
        sim_url = wait_for_line(sim.stdout, r"at (http://127\.0\.0\.1:\d+)").group(1)
        agent = _spawn("agent", "--url", sim_url, "--listen", "127.0.0.1:0", "--proxy-listen", "127.0.0.1:0",
                       "--capture", "--no-gpu", "--no-host", "--interval", "0.5")
        m = wait_for_line(agent.stderr, r"metrics (http://[\d.:]+)/metrics.*proxy (http://[\d.:]+).*capture port \d+")
        url, proxy = m.group(1), m.group(2)
        time.sleep(0.5)
        body = {"model": "m", "prompt": "hello", "stream": True, "max_tokens": 12,
                "kvtop": {"prompt_tokens": 50, "output_tokens": 12}}
        for base, n in ((proxy, 3), (sim_url, 2)):
            for _ in range(n):
                r = httpx.post(base + "/v1/completions", json=body, timeout=30)
                assert r.status_code == 200
        deadline = time.monotonic() + 20
        while True:
            fams = {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=5).text)}
            seen = {s.labels["observer"]: s.value for s in fams["kvtop_streams_observed"].samples
                    if s.name.endswith("_total")}
            if seen == {"proxy": 3.0, "capture": 2.0} or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert seen == {"proxy": 3.0, "capture": 2.0}
    finally:
        for proc in (agent, sim):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def test_an_engine_that_does_not_answer_ends_the_agent_at_once_with_exit_1():
    import socket

    with socket.socket() as s:  # a real closed loopback port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = run_kvtop("agent", "--url", f"http://127.0.0.1:{port}", "--listen", "127.0.0.1:0", "--no-gpu", "--no-host",
                  timeout=60)  # no --duration: without the check it would serve zeros until killed
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvtop: error: could not read the engine at http://127.0.0.1:{port}")
    # --wait-for-engine retries for that long first, then fails the same way
    r = run_kvtop("agent", "--url", f"http://127.0.0.1:{port}", "--listen", "127.0.0.1:0", "--no-gpu", "--no-host",
                  "--interval", "0.2", "--wait-for-engine", "1s", timeout=60)
    assert r.returncode == 1 and "could not read the engine" in r.stderr, r.stderr
