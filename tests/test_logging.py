"""-v/-q/--log-level and --log-format json: what the agent tells a log pipeline, and when."""

from __future__ import annotations

import json
import threading
import time

from conftest import run_kvtop
from page_server import PageServer
from vllm_pages import vllm_page


def test_the_agent_logs_an_engine_going_down_and_coming_back_as_json_lines() -> None:
    with PageServer() as s:
        route = s.route("/metrics", vllm_page(running=2))

        def flap() -> None:
            while len(route.hits) < 3:  # the agent is up and scraping
                time.sleep(0.05)
            route.status = 500  # the engine fails for a while, then answers again
            time.sleep(1.5)
            route.status = 200

        t = threading.Thread(target=flap, daemon=True)
        t.start()
        r = run_kvtop("agent", "--url", s.url, "--listen", "127.0.0.1:0", "--no-gpu", "--no-host", "--interval", "0.2",
                      "--duration", "9", "--log-format", "json", timeout=90)
        t.join()
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stderr.splitlines()]  # every line is one JSON object
    events = [(d["level"], d.get("event")) for d in lines]
    assert events[0] == ("info", "engine_up") and lines[0]["model"] and lines[0]["url"] == s.url
    assert ("info", "started") in events and events[-1] == ("info", "stopped")
    down = next(d for d in lines if d.get("event") == "engine_down")
    assert down["level"] == "warning" and "HTTP 500" in down["error"] and down["url"] == s.url
    back = [d for d in lines if d.get("event") == "engine_up" and "down_s" in d]
    assert len(back) == 1 and 0.5 < back[0]["down_s"] < 8 and back[0]["failed_scrapes"] >= 1
    assert events.index(("warning", "engine_down")) < lines.index(back[0])
    assert all(d["time"].endswith("Z") and d["logger"] == "kvtop.agent" for d in lines)


def test_quiet_and_verbose_set_what_the_agent_says() -> None:
    with PageServer() as s:
        s.route("/metrics", vllm_page(running=2))
        args = ("agent", "--url", s.url, "--listen", "127.0.0.1:0", "--no-gpu", "--no-host", "--duration", "1")
        quiet = run_kvtop(*args, "-q", timeout=60)  # errors only: a healthy run says nothing
        text = run_kvtop(*args, timeout=60)  # the agent's default: info, as text
        warn_only = run_kvtop("--log-level", "warning", *args, timeout=60)
    assert quiet.returncode == text.returncode == warn_only.returncode == 0
    assert quiet.stderr == "" and warn_only.stderr == ""
    lines = text.stderr.splitlines()
    assert lines[0].startswith(f"kvtop agent: engine {s.url}: vllm, model ")
    assert any(line.startswith("kvtop agent: metrics http://127.0.0.1:") for line in lines)
    assert lines[-1].startswith("kvtop agent: stopped after ")


def test_errors_follow_the_log_format() -> None:
    r = run_kvtop("agent", "--url", "http://127.0.0.1:1", "--listen", "127.0.0.1:0", "--log-format", "json", timeout=60)
    assert r.returncode == 1
    doc = json.loads(r.stderr)
    assert doc["level"] == "error" and doc["message"].startswith("could not read the engine at http://127.0.0.1:1")


def test_record_says_when_its_engine_stops_answering_and_verbose_says_more(tmp_path) -> None:
    with PageServer() as s:
        route = s.route("/metrics", vllm_page(running=2))

        def fail_later() -> None:
            while len(route.hits) < 3:  # recording
                time.sleep(0.05)
            route.status = 503

        t = threading.Thread(target=fail_later, daemon=True)
        t.start()
        r = run_kvtop("record", "-o", str(tmp_path / "t.jsonl"), "--url", s.url, "--interval", "0.2", "--duration", "3",
                      "--no-gpu", "--no-host", "-v", timeout=60)
        t.join()
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    assert f"kvtop record: engine {s.url}: vllm, model " in r.stderr  # -v: info lines
    warned = [line for line in lines if line.startswith(f"kvtop record: warning: engine {s.url} does not answer")]
    assert len(warned) == 1 and "HTTP 503" in warned[0]
