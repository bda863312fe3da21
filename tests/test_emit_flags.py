"""`kvtop advise --emit-flags`: the verdict's engine flags as one line a launcher can append."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from conftest import REPO


def test_emit_flags_from_a_trace_are_analyzes_settings(tmp_path: Path, kvtop_cli):
    trace = tmp_path / "t.jsonl"
    assert kvtop_cli("simulate", "--preset", "preemption-storm", "--seed", "1", "--duration", "20",
                     "-o", str(trace)).returncode == 0
    rep = json.loads(kvtop_cli("analyze", str(trace), "--format", "json").stdout)
    r = kvtop_cli("advise", "--trace", str(trace), "--emit-flags")
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.splitlines()) == 1
    words = shlex.split(r.stdout)
    pairs = dict(zip(words[::2], words[1::2], strict=True))
    assert pairs == {s["flag"]: str(s["value"]) for s in rep["verdict"]["settings"]}
    # the storm's prescription: a KV cache for the peak in flight with a limit recomputed on it, its length
    # bound, and the host pool sized from the measured peak of concurrently preempted sequences
    assert {"--kv-cache-memory-bytes", "--max-num-seqs", "--max-model-len", "--kv-offloading-size",
            "--kv-offloading-backend"} == set(pairs)
    why = next(s["why"] for s in rep["verdict"]["settings"] if s["flag"] == "--kv-offloading-size")
    assert why.startswith("the measured peak of")
    # --trace without --emit-flags gives the same verdict analyze does
    doc = json.loads(kvtop_cli("advise", "--trace", str(trace), "--format", "json").stdout)
    assert doc["action"] == rep["verdict"]["action"] and doc["settings"] == rep["verdict"]["settings"]


def test_emit_flags_from_a_scenario_and_nothing_to_change(tmp_path: Path, kvtop_cli):
    doc = json.loads((REPO / "tests" / "scenarios" / "S1.json").read_text())
    doc.pop("expect", None)
    doc["preemption"]["peak_preempted"] = 2
    path = tmp_path / "s.json"
    path.write_text(json.dumps(doc))
    r = kvtop_cli("advise", "--scenario", str(path), "--emit-flags")
    assert r.returncode == 0, r.stderr
    words = shlex.split(r.stdout)
    assert words[words.index("--kv-offloading-size") + 1] == "20"  # 2 x 10.49 GB -> 20 GiB
    healthy = tmp_path / "h.jsonl"
    assert kvtop_cli("simulate", "--preset", "healthy", "--duration", "10", "-o", str(healthy)).returncode == 0
    r = kvtop_cli("advise", "--trace", str(healthy), "--emit-flags")
    assert r.returncode == 0 and r.stdout == "\n"  # no_action: an empty line, nothing to append


def test_settings_read_from_a_config_file_stay_off_the_launcher_line(tmp_path: Path, kvtop_cli):
    """Triton's TensorRT-LLM settings live in config.pbtxt and trtllm-build: S6's admission limit is
    named on stderr, and the line a launcher appends stays empty rather than carrying those words."""
    doc = json.loads((REPO / "tests" / "scenarios" / "S6.json").read_text())
    doc.pop("expect", None)
    doc["engine"] = "triton"
    path = tmp_path / "s.json"
    path.write_text(json.dumps(doc))
    r = kvtop_cli("advise", "--scenario", str(path), "--emit-flags")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "\n", r.stdout
    assert "trtllm-build --max_batch_size = 128: not a flag of the engine's launcher" in r.stderr, r.stderr


def test_advise_bad_input_is_one_line(tmp_path: Path, kvtop_cli):
    for args, msg in ((["--trace", str(tmp_path / "none.jsonl"), "--emit-flags"], "no such trace"),
                      (["--trace", "x", "--scenario", "y"], "not allowed with")):
        r = kvtop_cli("advise", *args)
        assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr
