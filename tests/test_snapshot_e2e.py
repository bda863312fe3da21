"""End to end: `kvtop snapshot` as a subprocess against a loopback server whose pages change."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from conftest import run_kvtop
from page_server import PageServer
from vllm_pages import vllm_page

SCHEMA = json.loads((Path(__file__).resolve().parents[1] / "kvtop" / "schemas" / "snapshot.schema.json").read_text())

N_PREEMPT = 6
M_GEN = 4200
P_PROMPT = 1500
# page 1: a busy engine mid-run; page 2: N preemptions, M generated and P prompt tokens later,
# plus 90 fast ITL samples in (0.01, 0.025] and 10 slow ones in (0.75, 1.0] (resumed requests).
PAGE1 = vllm_page(preemptions=11, prompt=50_000, generation=20_000, kv=0.91, running=8, waiting=0,
                  itl={"0.025": 500, "0.05": 20})
PAGE2 = vllm_page(preemptions=11 + N_PREEMPT, prompt=50_000 + P_PROMPT, generation=20_000 + M_GEN, kv=0.99,
                  running=10, waiting=4, itl={"0.025": 590, "0.05": 20, "1.0": 10})


def one_line_error(p, rc: int = 2) -> str:
    assert p.returncode == rc, (p.returncode, p.stdout, p.stderr)
    assert p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtop: error: "), p.stderr
    assert "Traceback" not in p.stderr
    return lines[0]


@pytest.fixture
def server():
    with PageServer() as s:
        yield s


def test_snapshot_json_field_by_field(server):
    route = server.route("/metrics", [PAGE1, PAGE2])
    p = run_kvtop("snapshot", "--url", server.url, "--duration", "1", "--interval", "0.5",
                  "--format", "json", "--no-gpu", timeout=60)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    jsonschema.validate(doc, SCHEMA)
    assert len(route.hits) >= 2
    elapsed = route.hits[-1] - route.hits[0]  # the server's view of first -> last scrape
    assert doc["kvtop_version"] == "0.1.0"
    assert doc["taken_at"].endswith("Z")
    # kvtop's window is its own stamps of the first and last scrape; the server saw them within a
    # round trip of those (generous: a busy machine slows the round trips, not the arithmetic)
    assert doc["window_s"] == pytest.approx(elapsed, abs=0.25)
    assert doc["gpu_status"] == "disabled (--no-gpu)" and doc["gpus"] == []
    assert isinstance(doc["host"], dict)
    (e,) = doc["engines"]
    assert e["url"] == server.url and e["adapter"] == "vllm" and e["up"] is True
    assert e["model"] == "tiny-llama" and e["engine"] == "0"
    assert e["kv_usage"] == 0.99 and e["running"] == 10 and e["waiting"] == 4
    assert e["preemptions_total"] == 11 + N_PREEMPT
    assert e["preemptions_per_s"] > 0
    # the rates are the counters' steps over that window
    window = doc["window_s"]
    assert e["preemptions_per_s"] == pytest.approx(N_PREEMPT / window, rel=0.01)
    assert e["generation_tokens_per_s"] == pytest.approx(M_GEN / window, rel=0.01)
    assert e["prompt_tokens_per_s"] == pytest.approx(P_PROMPT / window, rel=0.01)
    # ITL delta page1 -> page2: 90 in (0.01, 0.025], 10 in (0.75, 1.0]; nothing else moved.
    # p50: rank 50 -> 0.01 + 0.015 * 50 / 90; p99: rank 99 -> 0.75 + 0.25 * (99 - 90) / 10
    assert e["itl_p50_s"] == pytest.approx(0.01 + 0.015 * 50 / 90)
    assert e["itl_p99_s"] == pytest.approx(0.75 + 0.25 * 9 / 10)
    assert e["ttft_p50_s"] is None and e["ttft_p99_s"] is None  # no TTFT samples in the window
    assert e["kv_capacity_tokens"] == 1056 and e["block_size"] == 32  # cache_config_info, line 549
    for k in ("kv_usage", "running", "preemptions_per_s", "itl_p99_s", "kv_capacity_tokens"):
        assert not isinstance(e[k], str)


def test_snapshot_text_and_partial_failure(server):
    server.route("/metrics", [PAGE1, PAGE2])
    server.route("/broken/metrics", "<html>login</html>", content_type="text/html")
    p = run_kvtop("snapshot", "--url", server.url, "--url", server.url + "/broken", "--duration", "0.6",
                  "--interval", "0.3", "--format", "text", timeout=60)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert f"engine {server.url} [vllm, engine 0]  up  model tiny-llama" in out
    assert "KV cache 99.0% of 1,056 tokens (block 32)  running 10  waiting 4" in out
    assert f"preemptions {11 + N_PREEMPT} total" in out
    assert "ITL p50 18.3 ms p99 975.0 ms" in out  # 0.018333 s and 0.975 s as computed above
    assert "TTFT p50 n/a p99 n/a" in out
    assert f"engine {server.url}/broken [unknown]  DOWN: not a metrics endpoint" in out
    assert "GPU: n/a (" in out or "GPU 0 " in out


def test_snapshot_json_reports_gpu_status_and_down_engine(server):
    route = server.route("/metrics", PAGE1)
    p = run_kvtop("snapshot", "--url", server.url, "--url", "http://127.0.0.1:1", "--duration", "0.3",
                  "--interval", "0.3", "--format", "json", timeout=60)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    jsonschema.validate(doc, SCHEMA)
    assert isinstance(doc["gpu_status"], str) and doc["gpu_status"]
    if doc["gpu_status"] != "ok":
        assert doc["gpus"] == []
    up, down = doc["engines"]
    # a rate needs two scrapes: a busy machine may fit only one into 0.3 s, and then there is none
    assert up["up"] is True and up["preemptions_per_s"] == (0.0 if len(route.hits) >= 2 else None)
    assert down["up"] is False and down["url"] == "http://127.0.0.1:1" and "cannot connect" in down["error"]
    assert down["kv_usage"] is None and down["preemptions_per_s"] is None
    # and stderr says so, as docs/cli.md promises (it said nothing: only the JSON named it)
    said = [line for line in p.stderr.splitlines() if "warning" in line]
    assert len(said) == 1 and "engine http://127.0.0.1:1 does not answer: cannot connect" in said[0], p.stderr


def test_exit_1_unreachable_at_the_first_scrape():
    # an hour's --duration: the dead engine must end the run at the first scrape, not after it
    p = run_kvtop("snapshot", "--url", "http://127.0.0.1:1", "--duration", "1h", "--no-gpu", timeout=60)
    err = one_line_error(p, rc=1)
    assert "could not read the engine at http://127.0.0.1:1" in err and "cannot connect" in err


def test_exit_1_html_page(server):
    server.route("/metrics", "<!doctype html><html><body>Grafana</body></html>", content_type="text/html")
    p = run_kvtop("snapshot", "--url", server.url, "--duration", "1h", "--no-gpu", timeout=60)
    assert "not a metrics endpoint" in one_line_error(p, rc=1)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--format", "xml"], "invalid choice"),
        (["--duration", "abc"], "--duration must be a number of seconds"),
        (["--duration", "-1"], "--duration must be > 0"),
        (["--interval", "0"], "--interval must be between"),
        (["--url", "ftp://x"], "only http:// and https://"),
        (["--adapter", "nope"], "unknown adapter 'nope'"),
        (["--bogus"], "unrecognized arguments"),
    ],
)
def test_exit_2_bad_arguments(args, needle):
    p = run_kvtop("snapshot", "--url", "http://127.0.0.1:1", *args) if "--url" not in args else run_kvtop(
        "snapshot", *args)
    assert needle in one_line_error(p)


def test_duration_with_unit_suffix(server):
    server.route("/metrics", PAGE1)
    p = run_kvtop("snapshot", "--url", server.url, "--duration", "300ms", "--interval", "100ms",
                  "--format", "json", "--no-gpu", "--no-host", timeout=60)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert 0 < doc["window_s"] < 5 and doc["host"] == {}
    assert doc["engines"][0]["up"] is True
