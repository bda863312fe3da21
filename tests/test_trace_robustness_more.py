"""Cut .jsonl.gz traces, agent trace directories and damaged traces read by every command that reads
a trace (analyze, advise --trace, compare) the same way: what was recorded is kept, and what was
not read is said."""

from __future__ import annotations

import gzip
import json
import lzma
import subprocess
import zlib
from pathlib import Path

import pytest
from conftest import run_kvtop

from kvtop.model.trace import TraceReader

ENDS_EARLY = "the compressed data ends early (the .gz file was cut)"


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    t = tmp_path_factory.mktemp("sim") / "small.jsonl"
    r = run_kvtop("simulate", "--preset", "preemption-storm", "--seed", "1", "--duration", "15", "-o", str(t),
                  timeout=60)
    assert r.returncode == 0, r.stderr
    return t


def _analyze(path: Path) -> dict:
    r = run_kvtop("analyze", str(path), "--format", "json", timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _one_line_error(r: subprocess.CompletedProcess[str]) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("kvtop: error: "), (r.returncode, r.stderr)
    assert r.stdout == ""
    return lines[0]


def test_a_gz_trace_cut_at_half_reads_every_whole_line_before_the_cut(trace: Path, tmp_path: Path) -> None:
    gz = gzip.compress(trace.read_bytes())
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(gz[: len(gz) // 2])
    # what zlib itself gives for the cut bytes: every line but the torn last one is a record
    lines = zlib.decompressobj(wbits=31).decompress(cut.read_bytes()).split(b"\n")
    assert lines[-1]  # the cut tears a line
    want = [json.loads(x) for x in lines[1:-1]]
    assert len(want) > 5000
    r = TraceReader(cut)
    got = list(r.dicts())
    assert got == want
    assert r.skipped == 1
    w = r.warning()
    assert w is not None and "skipped 1 malformed line (" in w and w.count(ENDS_EARLY) == 1, w

    # analyze finds the gaps of those lines (gzip.open lost the last megabyte: 0 gaps) and says why it stopped
    plain = tmp_path / "prefix.jsonl"
    plain.write_bytes(b"\n".join(lines[:-1]) + b"\n")
    rep = _analyze(cut)
    assert rep["gaps"] == _analyze(plain)["gaps"] > 4000
    assert sum(ENDS_EARLY in x for x in rep["warnings"]) == 1, rep["warnings"]
    assert any("skipped 1 malformed line (" in x for x in rep["warnings"]), rep["warnings"]


def test_a_gz_cut_between_two_lines_still_says_it_was_cut(trace: Path, tmp_path: Path) -> None:
    data = trace.read_bytes().split(b"\n")
    head = b"\n".join(data[:2001]) + b"\n"  # the header and 2000 records, then the cut
    c = zlib.compressobj(wbits=31)
    cut = tmp_path / "cut.jsonl.gz"
    # a sync flush ends the bytes so far on a line: no torn line tells the reader of the cut
    cut.write_bytes(c.compress(head) + c.flush(zlib.Z_SYNC_FLUSH))
    r = TraceReader(cut)
    assert sum(1 for _ in r.dicts()) == 2000 and r.skipped == 0
    w = r.warning()
    assert w is not None and ENDS_EARLY in w and "malformed" not in w, w
    rep = _analyze(cut)
    assert rep["records"] == 2000 and any(ENDS_EARLY in x for x in rep["warnings"]), rep["warnings"]


def _segment(lines: list[bytes]) -> bytes:
    return b"\n".join(lines) + b"\n"


def test_a_cut_segment_in_a_trace_directory_loses_no_record_of_the_next(trace: Path, tmp_path: Path) -> None:
    lines = trace.read_bytes().rstrip(b"\n").split(b"\n")
    header = json.loads(lines[0])
    header["agent_wall_t0"] = 1.0e9  # both segments of one agent run
    head = json.dumps(header).encode()
    mid = len(lines) // 2
    d = tmp_path / "agent"
    d.mkdir()
    first = gzip.compress(_segment([head, *lines[1:mid]]))
    first_cut = first[: len(first) * 3 // 4]
    (d / "kvtop-20261205T120000.000000Z.jsonl.gz").write_bytes(first_cut)
    (d / "kvtop-20261205T121000.000000Z.jsonl.gz").write_bytes(gzip.compress(_segment([head, *lines[mid:]])))
    kept = zlib.decompressobj(wbits=31).decompress(first_cut).split(b"\n")[1:-1]
    r = TraceReader(d)
    got = list(r.dicts())
    # the torn line of the first segment ends at its end: the second segment's first record is read
    assert got == [json.loads(x) for x in [*kept, *lines[mid:]]]
    assert r.skipped == 1
    w = r.warning()
    assert w is not None and f"segment kvtop-20261205T120000.000000Z.jsonl.gz: {ENDS_EARLY}" in w, w

    # advise and compare read the directory as analyze does, and say what analyze says about it
    rep = _analyze(d)
    assert rep["gaps"] > 4000
    adv = run_kvtop("advise", "--trace", str(d), "--format", "json", timeout=60)
    assert adv.returncode == 0 and json.loads(adv.stdout)["action"] == rep["verdict"]["action"], adv.stderr
    cmp = run_kvtop("compare", str(trace), str(d), "--format", "json", timeout=60)
    assert cmp.returncode == 0, cmp.stderr
    assert json.loads(cmp.stdout)["b"]["completed"] > 0
    for out in (adv, cmp):
        assert out.stderr.count(ENDS_EARLY) == 1 and "skipped 1 malformed line (" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr


def test_advise_and_compare_warn_of_skipped_lines_as_analyze_does(trace: Path, tmp_path: Path) -> None:
    lines = trace.read_text().splitlines(keepends=True)
    for at in (5000, 500, 50):
        lines.insert(at, "not json at all\n")
    bad = tmp_path / "garbage.jsonl"
    bad.write_text("".join(lines))
    said = f"warning: {bad}: skipped 3 malformed lines (more than"
    an = run_kvtop("analyze", str(bad), timeout=60)
    assert an.returncode == 0 and said in an.stdout, an.stdout
    adv = run_kvtop("advise", "--trace", str(bad), "--emit-flags", timeout=60)
    assert adv.returncode == 0 and f"kvtop: {said}" in adv.stderr, adv.stderr
    cmp = run_kvtop("compare", str(trace), str(bad), "--format", "json", timeout=60)
    assert cmp.returncode == 0 and cmp.stderr.count(f"kvtop: {said}") == 1, cmp.stderr
    assert json.loads(cmp.stdout)["outcome"] == "no_change"  # the three lines carried no record
    # a clean trace: nothing to say
    clean = run_kvtop("compare", str(trace), str(trace), timeout=60)
    assert clean.returncode == 0 and "warning" not in clean.stderr, clean.stderr


def test_analyze_says_which_header_fields_it_ignored_as_replay_does(trace: Path, tmp_path: Path) -> None:
    """A header whose ITL target is -1 and whose interval is a word: analyze ignored both and derived a
    target of its own without a word; now its warnings name them, as replay's did."""
    lines = trace.read_text().splitlines(keepends=True)
    head = json.loads(lines[0])
    head["itl_target_s"], head["interval_s"] = -1, "fast"
    bad = tmp_path / "bad-header.jsonl"
    bad.write_text(json.dumps(head) + "\n" + "".join(lines[1:]))
    rep = _analyze(bad)
    said = [w for w in rep["warnings"] if "ignored wrong-typed header field(s)" in w]
    assert said == [f"{bad}: ignored wrong-typed header field(s): itl_target_s, interval_s"], rep["warnings"]
    assert rep["itl_target_s"] != -1
    assert not [w for w in _analyze(trace)["warnings"] if "header" in w]


def test_a_header_that_names_no_adapter_is_judged_by_the_engine_records(trace: Path, tmp_path: Path) -> None:
    """The agent's trace segments named no adapter in their header: analyze then judged them without
    the engine's semantics (its counter's moment, its flag names) while the agent's live analysis
    read the adapter off the engine records, and the two disagreed on the same spikes (23 vs 31
    preemptions in a reviewer's run). Now analyze reads it off the records too."""
    lines = trace.read_text().splitlines(keepends=True)
    head = json.loads(lines[0])
    assert head["engine"]["adapter"] == "vllm"
    head["engine"] = {"url": head["engine"]["url"]}
    bare = tmp_path / "no-adapter.jsonl"
    bare.write_text(json.dumps(head) + "\n" + "".join(lines[1:]))
    # an agent started before its engine answered: its first record is a failed scrape, whose adapter
    # is "unknown" until one answered; the engine's own adapter is the one to judge by
    down = {"kind": "engine", "t": 0.0, "adapter": "unknown", "url": head["engine"]["url"], "up": False,
            "warnings": ["refused"]}
    late = tmp_path / "down-first.jsonl"
    late.write_text(json.dumps(head) + "\n" + json.dumps(down) + "\n" + "".join(lines[1:]))

    def judged(path: Path) -> tuple:
        r = run_kvtop("analyze", str(path), "--itl-target-ms", "30", "--format", "json", timeout=60)
        assert r.returncode == 0, r.stderr
        rep = json.loads(r.stdout)
        return ({k: v["count"] for k, v in rep["causes"].items()}, rep["verdict"]["action"],
                [(s["flag"], s["value"]) for s in rep["verdict"]["settings"]])

    named = judged(trace)
    assert named[0]["preemption"] > 0 and all(flag for flag, _ in named[2]), named
    assert judged(bare) == named
    assert judged(late) == named


@pytest.mark.parametrize("kind", ["empty", "text", "xz"])
def test_compare_refuses_a_file_that_is_not_a_trace_in_analyzes_one_line(kind: str, trace: Path,
                                                                         tmp_path: Path) -> None:
    b = tmp_path / f"b.{kind}"
    b.write_bytes({"empty": b"", "text": b"hello\nworld\n", "xz": lzma.compress(trace.read_bytes())}[kind])
    said = _one_line_error(run_kvtop("analyze", str(b), timeout=60))
    assert "is not a kvtop trace" in said
    assert _one_line_error(run_kvtop("compare", str(trace), str(b), timeout=60)) == said
    assert _one_line_error(run_kvtop("compare", str(b), str(trace), timeout=60)) == said
    assert _one_line_error(run_kvtop("advise", "--trace", str(b), timeout=60)) == said
