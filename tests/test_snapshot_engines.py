"""End to end: `kvtop snapshot` against a loopback server replaying each engine's captured page
(llama.cpp also serves its captured /slots) reports the fields each adapter fills."""

from __future__ import annotations

import json

import pytest
from conftest import fixture_text, run_kvtop
from replay_server import PROM, replay_server

SGLANG = fixture_text("sglang-v0.4.3-docs-production-metrics.prom")


def _sglang_later(k: int) -> str:
    """The SGLang page after k x 1000 more ITL observations, all in the (0.05, 0.075] bucket."""
    out = []
    for line in SGLANG.splitlines():
        if line.startswith("sglang:time_per_output_token_seconds_"):
            name, value = line.rsplit(" ", 1)
            le = name.split('le="')[1].split('"')[0] if 'le="' in name else None
            if le is None and name.startswith("sglang:time_per_output_token_seconds_sum"):
                value = repr(float(value) + k * 1000 * 0.07)
            elif le is None or le == "+Inf" or float(le) >= 0.075:
                value = repr(float(value) + k * 1000)
            line = f"{name} {value}"
        out.append(line)
    return "\n".join(out) + "\n"


ROUTES = {
    # moves on every scrape, so any two scrapes in the window see new observations
    "/sglang/metrics": ([_sglang_later(k) for k in range(40)], PROM),
    "/tgi/metrics": (fixture_text("tgi-v3.3-SYNTH.prom"), PROM),
    # hand-written /info body (TGI's router Info fields model_id, version)
    "/tgi/info": (json.dumps({"model_id": "bigscience/bloom-560m", "version": "3.3.7"}), "application/json"),
    "/llamacpp/metrics": (fixture_text("llamacpp-b9014-cassette-metrics-idle.prom"), PROM),
    "/llamacpp/slots": (fixture_text("llamacpp-b9014-cassette-slots-idle.json"), "application/json"),
    "/triton/metrics": (fixture_text("triton-trtllm-backend-readme-example.prom"), PROM),
}


@pytest.fixture(scope="module")
def server():
    with replay_server(ROUTES) as srv:
        yield srv


@pytest.fixture(scope="module")
def engines(server):
    base, hits = server
    urls = [f"{base}/{e}/metrics" for e in ("sglang", "tgi", "llamacpp", "triton")]
    args = ["snapshot", "--duration", "1.5", "--interval", "0.3", "--format", "json", "--no-gpu", "--no-host"]
    for u in urls:
        args += ["--url", u]
    r = run_kvtop(*args, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    by = {e["adapter"]: e for e in out["engines"]}
    assert set(by) == {"sglang", "tgi", "llamacpp", "triton"}, out["engines"]
    return by, hits


def test_sglang_fields(engines):
    e = engines[0]["sglang"]
    assert e["up"] is True and e["preempts"] is True
    assert (e["running"], e["waiting"], e["kv_usage"]) == (162, 2826, 0.28)
    assert e["model"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert e["kv_capacity_tokens"] == 442354  # estimated: 123859 / 0.28
    assert e["preemptions_total"] is None
    # new per-token ITL observations, all in (0.05, 0.075]: the window's median is in there
    assert 0.05 < e["itl_p50_s"] <= 0.075
    assert e["ttft_p50_s"] is None  # TTFT did not move in the window


def test_tgi_fields(engines):
    e = engines[0]["tgi"]
    assert e["up"] is True and e["preempts"] is False
    assert (e["running"], e["waiting"], e["kv_capacity_tokens"]) == (8, 3, 180000)
    assert e["model"] == "bigscience/bloom-560m"  # from /info
    assert e["kv_usage"] is None and e["preemptions_total"] is None


def test_llamacpp_fields_and_slots(engines):
    e, hits = engines[0]["llamacpp"], engines[1]
    assert e["up"] is True and e["preempts"] is False
    assert (e["running"], e["waiting"]) == (0, 0)
    assert hits.get("/llamacpp/slots", 0) >= 1
    assert e["kv_capacity_tokens"] == 256 and e["kv_usage"] == 0.0  # from /slots
    assert e["preemptions_total"] is None and e["block_size"] is None


def test_triton_fields(engines):
    e = engines[0]["triton"]
    assert e["up"] is True
    assert (e["running"], e["waiting"], e["kv_usage"]) == (0, 1, 0.4875)
    assert (e["kv_capacity_tokens"], e["block_size"]) == (6239 * 64, 64)
    assert e["model"] == "tensorrt_llm"


def test_llamacpp_kv_usage_it_cannot_tell_is_na_with_both_readings_said():
    # four busy slots of 2,048 tokens: one unified cache of 2,048 or four of 2,048 (the real
    # llama-server's /slots is the same for both, tests/integration/test_real_llamacpp.py)
    slot = {"n_ctx": 2048, "speculative": False, "is_processing": True, "n_prompt_tokens": 400,
            "next_token": [{"has_next_token": True, "n_decoded": 40}]}
    routes = {"/metrics": ROUTES["/llamacpp/metrics"],
              "/slots": (json.dumps([dict(slot, id=i) for i in range(4)]), "application/json")}
    with replay_server(routes) as (url, _):
        r = run_kvtop("snapshot", "--url", url, "--no-gpu", "--no-host", "--duration", "0.3", "--interval", "0.1",
                      "--format", "json", timeout=60)
        text = run_kvtop("snapshot", "--url", url, "--no-gpu", "--no-host", "--duration", "0.3", "--interval",
                         "0.1", timeout=60)
    assert r.returncode == 0 and text.returncode == 0, r.stderr + text.stderr
    [e] = json.loads(r.stdout)["engines"]
    assert e["kv_usage"] is None and e["kv_capacity_tokens"] is None
    [note] = e["warnings"]
    assert "share one KV cache of 2048 tokens" in note and "78% if shared, 20% if split" in note
    assert "warning: llama-server does not say whether its 4 slots share one KV cache" in text.stdout
