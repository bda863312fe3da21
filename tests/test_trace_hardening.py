"""Hostile or broken trace files: wrong-typed fields, deep nesting and endless lines are skipped and
counted, never a traceback (issue 14 item 5); traces are created private (item 9)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from conftest import run_kvtop

from kvtop.analysis.scan import analyze_trace
from kvtop.model.trace import TraceError, TraceReader, TraceWriter, make_header
from kvtop.model.validate import MAX_LINE_BYTES

GOOD = [
    {"kind": "request", "t": 0.0, "id": "a", "event": "arrive", "prompt_tokens": 10},
    {"kind": "request", "t": 0.1, "id": "a", "event": "first_token", "n": 1},
    {"kind": "request", "t": 0.2, "id": "a", "event": "token", "n": 1},
    {"kind": "request", "t": 1.5, "id": "a", "event": "token", "n": 1},
    {"kind": "request", "t": 1.6, "id": "a", "event": "finish"},
]
BAD = [
    {"kind": "request", "t": "soon", "id": "a", "event": "token", "n": 1},
    {"kind": "request", "t": None, "id": "a", "event": "token", "n": 1},
    {"kind": "request", "t": 0.3, "id": {"x": 1}, "event": "token", "n": 1},
    {"kind": "request", "t": -1e308, "id": "a", "event": "token", "n": 1},
    {"kind": "request", "t": 12345678901.5, "id": "a", "event": "token", "n": 1},
    {"kind": "request", "t": 0.3, "id": "a", "event": "token", "n": -3},
    {"kind": "request", "t": 0.3, "id": "a", "event": "token", "n": "7"},
    {"kind": "request", "t": 0.3, "id": "a", "event": "arrive", "prompt_tokens": "many"},
    {"kind": "engine", "t": 0.5, "adapter": 3, "running": 2},
    {"kind": "engine", "t": 0.5, "adapter": "vllm", "running": "2"},
    {"kind": "engine", "t": 0.5, "adapter": "vllm", "running": float("nan"), "waiting": float("inf")},
    {"kind": "engine", "t": 0.5, "adapter": "vllm", "itl": {"buckets": "x", "count": 1, "sum": 0}},
    {"kind": "gpu", "t": 0.5, "index": "zero"},
    {"kind": "host", "t": 0.5, "mem_total_bytes": [1]},
]


def _write(path: Path, header: dict, lines: list[str]) -> Path:
    path.write_text(json.dumps(header) + "\n" + "".join(ln + "\n" for ln in lines))
    return path


def _hostile(tmp_path: Path) -> Path:
    header = make_header(engine={"adapter": ["vllm"], "model": 7}, kv=[1, 2], itl_target_s="fast")
    lines = [json.dumps(d) for d in GOOD[:3]] + [json.dumps(d) for d in BAD]
    lines += ['{"kind":"request","t":0.25,"id":"a","event":"token","n":1,"x":' + "[" * 100_000 + "]" * 100_000 + "}",
              '{"kind":"request","t":NaN,"id":"a","event":"token","n":1}',
              "x" * (MAX_LINE_BYTES + 10)]
    lines += [json.dumps(d) for d in GOOD[3:]]
    return _write(tmp_path / "hostile.jsonl", header, lines)


def test_reader_skips_and_counts_every_bad_record(tmp_path):
    r = TraceReader(_hostile(tmp_path))
    got = list(r.dicts())
    assert got == GOOD
    assert r.skipped == len(BAD) + 3
    assert r.header["engine"]["adapter"] is None and r.header["kv"] == {} and r.header["itl_target_s"] is None
    w = r.warning()
    assert w and f"skipped {len(BAD) + 3}" in w and "engine.adapter" in w and "itl_target_s" in w


@pytest.mark.parametrize("args", [("analyze", "--format", "json"), ("analyze", "--format", "text"),
                                  ("replay", "--headless", "--format", "json")])
def test_commands_survive_a_hostile_trace(tmp_path, args):
    path = _hostile(tmp_path)
    r = run_kvtop(args[0], str(path), *args[1:])
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.returncode == 0, r.stderr[-2000:]
    if "json" in args:
        json.loads(r.stdout)


@pytest.mark.parametrize("fast", [True, False])
def test_both_analysis_paths_skip_the_same_records(tmp_path, fast):
    rep = analyze_trace(str(_hostile(tmp_path)), fast=fast)
    assert any(f"skipped {len(BAD) + 3}" in w for w in rep.warnings), rep.warnings


def test_endless_header_line_is_refused_without_reading_it_whole(tmp_path):
    p = tmp_path / "huge.jsonl"
    with open(p, "w") as f:
        f.write('{"kind":"header","pad":"' + "x" * (4 * MAX_LINE_BYTES))
    with pytest.raises(TraceError, match="longer than"):
        TraceReader(p)
    r = run_kvtop("analyze", "/dev/zero")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


def test_traces_are_created_private(tmp_path):
    p = tmp_path / "t.jsonl"
    old = os.umask(0o022)
    try:
        with TraceWriter(p, make_header()) as w:
            w.write({"kind": "request", "t": 0.0, "id": "a", "event": "arrive"})
    finally:
        os.umask(old)
    assert stat.S_IMODE(p.stat().st_mode) == 0o600


# What json reads and msgspec refuses (or reads differently), on lines the reader must judge as
# json always did: a huge exponent (infinity), NaN, a UTF-8 byte-order mark, a lone surrogate
# escape, integers past 64 bits (msgspec keeps them integers; orjson would have made them floats)
EDGE_LINES = [
    b'{"kind":"host","t":1.0,"x":1e400}',
    b'{"kind":"host","t":1.0,"x":NaN}',
    b'\xef\xbb\xbf{"kind":"host","t":1.0}',
    b'{"kind":"request","t":1.0,"id":"a\\ud800","event":"token","n":1}',
    b'{"kind":"host","t":1.0,"x":123456789012345678901234567890}',
    b'{"kind":"request","t":1.0,"id":"a","event":"token","n":123456789012345678901234567890}',
    b'{"kind":"request","t":1.0,"id":"a","event":"token","n":1,"source":"proxy"}',
    b'{"kind":"request","t":1.0,"id":"a","event":"token","n":1,"source":5}',
    b'{"kind":"request","t":1.0,"id":"a","event":"token","n":1,"class":7}',
    b'{"kind":"request","t":1.0,"id":"a","event":"token","n":1,"class":"chat","source":"proxy"}',
    b'{"kind":"request","t":1.0,"id":"a","event":"token","n":1} trailing',
    b'{"kind":"request","t":1e400,"id":"a","event":"token","n":1}',
    b"[" * 3000 + b"]" * 3000,
]


@pytest.mark.parametrize("line", EDGE_LINES, ids=range(len(EDGE_LINES)))
def test_trace_lines_read_as_json_reads_them(line):
    from kvtop.model.validate import parse_line, record_ok

    for text in (line, line.decode("utf-8")):  # the fast path reads bytes, the trace reader text
        try:
            want = json.loads(text)
            want = want if record_ok(want) else None
        except (ValueError, RecursionError):
            want = None
        assert repr(parse_line(text)) == repr(want)  # repr: NaN == NaN, and int stays int


def test_token_lines_with_a_wrong_typed_extra_field_are_skipped(tmp_path):
    p = tmp_path / "t.jsonl"
    lines = [json.dumps(make_header(engine={"adapter": "vllm"}))]
    lines += [json.dumps({"kind": "request", "t": 0.1 * i, "id": "a", "event": "token", "n": 1, "source": s})
              for i, s in enumerate(["proxy", 5, "capture", None, ["x"]])]
    p.write_text("\n".join(lines) + "\n")
    r = TraceReader(p)
    assert [d["source"] for d in r.dicts()] == ["proxy", "capture", None]
    assert r.skipped == 2


# token lines near every edge of the streaming reader's one-step token check (``TokenLine``)
TOKEN_VARIANTS = [
    '{"kind":"request","t":5,"id":"a","event":"token","n":1}',
    '{"kind":"request","t":-1,"id":"a","event":"token","n":1}',
    '{"kind":"request","t":-1.0000001,"id":"a","event":"token","n":1}',
    '{"kind":"request","t":-2,"id":"a","event":"token","n":1}',
    '{"kind":"request","t":1e9,"id":"a","event":"token","n":1}',
    '{"kind":"request","t":1000000001,"id":"a","event":"token","n":1}',
    '{"kind":"request","t":1.0,"id":"a","event":"token","n":0}',
    '{"kind":"request","t":1.0,"id":"a","event":"token","n":9007199254740992}',
    '{"kind":"request","t":1.0,"id":"a","event":"token","n":9007199254740993}',
    '{"kind":"request","t":1.0,"id":"a","event":"token","n":2.0}',
    '{"kind":"request","t":1.0,"id":"a","event":"token","n":true}',
    '{"kind":"request","t":1.0,"id":"a","event":"token","n":null}',
    '{"kind":"request","t":1.0,"id":"a","event":"token"}',
    '{"kind":"request","t":1.0,"id":7,"event":"token","n":1}',
    '{"kind":"request","t":true,"id":"a","event":"token","n":1}',
    '{"kind":"request","t":1.0,"id":"a","event":"token","n":1,"source":null}',
    '{"kind":"request","t":1.0,"id":"a","event":"token","n":1,"source":"capture"}',
    '{"kind":"request","t":1.0,"id":"a","event":"token","n":1,"incomplete":true}',
    '{"kind":"request","t":1.0,"t":2.5,"id":"a","event":"token","n":1}',
    '{"kind":"request","t":1.0,"id":"a","event":"token","n":1,"n":-1}',
    '{"kind":"request","t":1.0,"id":"a","event":"token","n":-1,"n":3}',
    '{"kind":"engine","t":1.0,"id":"a","event":"token","n":1}',
    '{"kind":"request","t":1.0,"id":"a","event":"first_token","n":1}',
    '  {"kind":"request","t":1.0,"id":"a\\u00e9","event":"token","n":1}  ',
    '{"kind":"request","t":1.0,"id":"a","event":"token","n":1,"source":"proxy","x":[' + "[" * 3000 + "]" * 3000 + "]}",
    '{"event":"token","n":1,"id":"b","t":0.5,"kind":"request"}',
]


def test_streaming_reader_reads_every_line_as_dicts_does(tmp_path):
    lines = [json.dumps(make_header(engine={"adapter": "vllm"}))] + TOKEN_VARIANTS
    lines += [ln.decode("utf-8", errors="replace") for ln in EDGE_LINES] + [json.dumps(d) for d in GOOD + BAD]
    lines += ['{"kind":"request","t":2.0,"id":"a","event":"token","n":1,"s":"' + "x" * MAX_LINE_BYTES + '"}']
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(lines) + "\n")
    plain, items = TraceReader(p), TraceReader(p)
    want, got = list(plain.dicts()), list(items.items())
    assert len(got) == len(want) and items.skipped == plain.skipped > 0
    tokens = 0
    for g, d in zip(got, want, strict=True):
        if isinstance(g, dict):
            assert repr(g) == repr(d)
        else:  # the fields the analysis reads, of the same values and types
            tokens += 1
            assert d["kind"] == "request" and d["event"] == "token"
            assert repr((g.t, g.id, g.n, g.source)) == repr((d["t"], d["id"], d["n"], d.get("source")))
    assert tokens >= 12  # the plain lines came through the token check
