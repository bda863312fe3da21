"""The token sidecar (``<trace>.tokens``, written by ``TraceWriter(columns=True)`` as ``kvtop record``
does) changes nothing in ``kvtop analyze``'s results, only where the token lines are read from: every
chunk it covers gives the JSONL reading's ``Parsed`` exactly, the whole report is the same with and
without it (and the same as the streaming path's), and a sidecar of another trace, or one the trace
no longer matches, is ignored with a one-line note (issue 23 item 4)."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import run_kvtop

from kvtop.analysis import fastscan
from kvtop.analysis.analyzer import Analyzer
from kvtop.analysis.scan import analyze_trace
from kvtop.model import token_columns as TC
from kvtop.model.records import EngineRecord, RequestRecord
from kvtop.model.trace import TraceReader, TraceWriter, make_header
from kvtop.model.validate import T_MAX, T_MIN

CHUNK = 32 << 10  # small chunks: dozens of them, stalls across their boundaries


def _write(path: Path, seed: int = 7, streams: int = 60, steps: int = 400, odd: bool = True,
           flush_s: float = 0.0) -> None:
    """A recorded run as the writer sees it: arrivals naming their engine, first tokens, tokens
    (a few stalls), scrapes, finishes and cancels; with ``odd``, the lines the fast path cannot
    take (n >= 100, an escaped id, a long id, resyncs, dict-written tokens) here and there."""
    rnd = random.Random(seed)
    w = TraceWriter(path, make_header(engine={"adapter": "vllm", "url": "http://e:8000"}), flush_interval_s=flush_s,
                    columns=True)
    t = 0.0
    live: dict[str, int] = {}
    born = 0
    for step in range(steps):
        t += 0.02 + (0.8 if rnd.random() < 0.01 else 0.0)  # now and then every stream stalls
        while len(live) < streams:
            rid = f"r{born}" if not (odd and born in (70, 400)) else ("x" * 60 if born == 70 else f'q"{born}')
            born += 1
            w.write(RequestRecord(t, rid, "arrive", prompt_tokens=rnd.randint(50, 4000),
                                  engine="http://e:8000" if born % 3 else None))
            live[rid] = 0
        if step % 10 == 0:
            w.write(EngineRecord(t, "vllm", url="http://e:8000", kv_usage=rnd.random(), running=float(len(live)),
                                 waiting=0.0, preemptions_total=float(step // 50)))
        for rid in list(live):
            if rnd.random() < 0.15:
                continue  # this stream is silent this step
            k = live[rid]
            tt = t + rnd.random() * 0.01
            n = 1 if rnd.random() < 0.9 else rnd.randint(2, 9)
            oddstep = odd and step % 100 == 50
            if oddstep and rnd.random() < 0.05:
                n = 150  # three digits: the fast path's reading stops at two
            if k == 0:
                w.write(RequestRecord(tt, rid, "first_token", n, prompt_tokens=100 if rnd.random() < 0.5 else None))
            elif oddstep and rnd.random() < 0.05:
                w.write(RequestRecord(tt, rid, "resync", n))
            elif odd and rnd.random() < 0.002:
                w.write({"kind": "request", "t": tt, "id": rid, "event": "token", "n": n, "source": "proxy"})
            else:
                w.write(RequestRecord(tt, rid, "token", n))
            live[rid] = k + 1
            if k > 30 and rnd.random() < 0.03:
                w.write(RequestRecord(tt + 0.001, rid, "cancel" if rnd.random() < 0.2 else "finish"))
                del live[rid]
    w.close()


def _report(path: Path, **kw: object) -> str:
    """The report as JSON, without the sidecar's own note (what each check below looks at apart)."""
    d = analyze_trace(str(path), **kw).to_dict()  # type: ignore[arg-type]
    d["warnings"] = [w for w in d["warnings"] if not w.startswith(f"{path}{TC.SUFFIX}: ignored")]
    return json.dumps(d, sort_keys=True)


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("side") / "run.jsonl"
    _write(p)
    return p


def test_every_chunk_the_sidecar_covers_reads_as_the_jsonl_does(trace: Path) -> None:
    cols, note = fastscan.open_columns(str(trace))
    assert cols is not None and note is None
    assert cols.covered == trace.stat().st_size  # closed cleanly: it speaks for the whole trace
    assert Path(str(trace) + TC.SUFFIX).stat().st_mode & 0o777 == 0o600  # private, as the trace is
    with open(trace, "rb") as f:
        head = len(f.readline())
        ends = fastscan._bounds(f, head, trace.stat().st_size, CHUNK)
    used = fell_back = 0
    for a, b in zip([head, *ends[:-1]], ends, strict=True):
        ok, got = fastscan._parse_cols(cols, a, b)
        want = fastscan._parse_range(str(trace), a, b, False)
        if not ok:
            fell_back += 1
            continue
        used += 1
        assert (got is None) == (want is None)
        if got is None or want is None:
            continue
        assert want.slow is None  # the sidecar never covers a chunk the JSONL reading sends through the streaming path
        assert got.ids == want.ids and got.tokens == want.tokens
        for x, y in ((got.codes, want.codes), (got.ts, want.ts), (got.ns, want.ns), (got.ft, want.ft)):
            assert x.dtype.kind == y.dtype.kind and np.array_equal(x, y)
        assert got.others == want.others and got.engines == want.engines
    assert used > 20
    assert 0 < fell_back < used / 2  # the odd lines send their chunks to the JSONL


def test_report_is_the_same_with_and_without_the_sidecar_and_streaming(trace: Path) -> None:
    want = _report(trace, columns=False)
    assert json.loads(want)["spikes_total"] > 0  # there are stalls to attribute
    assert _report(trace) == want
    assert _report(trace, fast=False) == want  # the streaming (live) path's reading
    for workers in (0, 2):
        runs = []
        for columns in (True, False):
            an = Analyzer()
            an.set_header(TraceReader(trace).header)
            skipped = fastscan.scan(str(trace), an, chunk_bytes=CHUNK, workers=workers, columns=columns)
            an.finish()
            runs.append((skipped, an.records, an.n_gaps, an.n_spikes, an.median_gap(),
                         [(s.candidate.request_id, s.candidate.t_end, s.finding.cause) for s in an.spikes]))
        assert runs[0] == runs[1]


def test_token_entry_takes_a_line_only_where_the_fast_path_reads_it_the_same(tmp_path: Path) -> None:
    """Lines near the token layout, each alone in a chunk: the sidecar's rule says yes only where
    ``fastscan._parse`` reads a token event, with the same time, id, n and kind."""
    rnd = random.Random(3)
    base = ['{"kind":"request","t":', "12.5", ',"id":"', "req-1", '","event":"', "token", '"', ',"n":7', "}"]
    alts = [['{"kind":"request","t":', '{"kind": "request","t":'], ["12.5", "1e3", "-0.5", "07", "1.", "null",
            "12345678901234567890123456", "2e9", "0.000001"], [',"id":"', ',"id": "'],
            ["req-1", "", "a\\\"b", "x" * 47, "x" * 48, "é"], ['","event":"'], ["token", "first_token", "tokens", "arrive"],
            ['"'], [',"n":7', ',"n":42', ',"n":100', ',"n":-1', ',"n":7.0', "", ',"source":"proxy"', ',"n": 7', ',"n":٣'],
            ["}", "} ", ',"x":1}']]
    seen = {True: 0, False: 0}
    for _ in range(3000):
        parts = [rnd.choice(a) if rnd.random() < 0.3 else b for a, b in zip(alts, base, strict=True)]
        line = "".join(parts)
        entry = TC.token_entry(line, T_MIN, T_MAX)
        p = fastscan._parse(line.encode() + b"\n")
        fast = p is not None and p.slow is None and len(p.ts) == 1
        seen[entry is not None] += 1
        if entry is None:
            continue
        assert fast, line
        assert p is not None
        t, at, n_id, n, ft = entry
        assert (p.ts[0], p.ids, p.ns[0], bool(p.ft[0])) == (t, [line[at:at + n_id]], n, ft), line
    assert seen[True] > 300 and seen[False] > 300


def test_a_foreign_or_stale_sidecar_is_ignored_with_a_note(trace: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.jsonl"
    _write(other, seed=8, steps=100)
    want = _report(other, columns=False)
    # another trace's sidecar beside it
    shutil.copy(str(trace) + TC.SUFFIX, str(other) + TC.SUFFIX)
    notes = [w for w in analyze_trace(str(other)).warnings if TC.SUFFIX in w]
    assert notes == [f"{other}{TC.SUFFIX}: ignored (it belongs to another trace)"]
    assert _report(other) == want
    # not a sidecar at all
    Path(str(other) + TC.SUFFIX).write_bytes(b"garbage" * 20)
    assert any("not a kvtop token sidecar" in w for w in analyze_trace(str(other)).warnings)


def test_a_trace_cut_short_or_written_on_uses_the_sidecar_for_what_still_matches(trace: Path, tmp_path: Path) -> None:
    raw = trace.read_bytes()
    # cut at a line in the middle: an earlier flush mark still matches the JSONL
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(raw[: raw.index(b"\n", len(raw) // 2) + 1])
    shutil.copy(str(trace) + TC.SUFFIX, str(cut) + TC.SUFFIX)
    cols, note = fastscan.open_columns(str(cut))
    assert cols is not None and note is None and 0 < cols.covered <= cut.stat().st_size
    assert _report(cut) == _report(cut, columns=False)
    # the last line rewritten in place, same length (the marks check the tail of the trace, not
    # every byte: an edit further in is not seen, the trace is the record of truth)
    bad = tmp_path / "bad.jsonl"
    i = raw.rindex(b"\n", 0, len(raw) - 1) + 1
    j = raw.index(b'"t":', i) + 4
    bad.write_bytes(raw[:j] + (b"9" if raw[j:j + 1] != b"9" else b"8") + raw[j + 1:])
    shutil.copy(str(trace) + TC.SUFFIX, str(bad) + TC.SUFFIX)
    cols, note = fastscan.open_columns(str(bad))
    assert cols is not None and cols.covered <= i  # never trusted past the change
    assert _report(bad) == _report(bad, columns=False)
    # a torn sidecar (a crash mid-record) and records after the JSONL's end
    torn = tmp_path / "torn.jsonl"
    shutil.copy(trace, torn)
    side = (Path(str(trace) + TC.SUFFIX)).read_bytes()
    Path(str(torn) + TC.SUFFIX).write_bytes(side[: len(side) - 30])
    cols, _ = fastscan.open_columns(str(torn))
    assert cols is not None and cols.covered < torn.stat().st_size
    assert _report(torn) == _report(torn, columns=False)
    # another writer appended to the trace (no sidecar of its own): the sidecar covers what it wrote
    more = tmp_path / "more.jsonl"
    shutil.copy(trace, more)
    shutil.copy(str(trace) + TC.SUFFIX, str(more) + TC.SUFFIX)
    w = TraceWriter(more, {})
    w.write(RequestRecord(500.0, "late", "token", 1))
    w.write(RequestRecord(500.5, "late", "token", 1))
    w.close()
    cols, _ = fastscan.open_columns(str(more))
    assert cols is not None and cols.covered == trace.stat().st_size
    assert _report(more) == _report(more, columns=False)


def test_kvtop_analyze_prints_the_same_with_and_without_the_sidecar(trace: Path, tmp_path: Path) -> None:
    plain = tmp_path / "plain.jsonl"
    shutil.copy(trace, plain)
    shutil.copy(str(trace) + TC.SUFFIX, str(plain) + TC.SUFFIX)
    outs = []
    for _ in range(2):
        r = run_kvtop("analyze", str(plain), "--format", "json")
        assert r.returncode == 0, r.stderr
        outs.append(r.stdout)
        Path(str(plain) + TC.SUFFIX).unlink(missing_ok=True)
    assert outs[0] == outs[1]


def test_an_id_coded_twice_is_one_stream(tmp_path: Path) -> None:
    """The writer's id codes are bounded (65,536, then they start over with new codes): an id seen
    before and after that has two codes, and a chunk holding both reads it as one stream."""
    p = tmp_path / "many.jsonl"
    w = TraceWriter(p, make_header(), columns=True)
    w.write(RequestRecord(0.0, "again", "token", 1))
    for i in range(1 << 16):
        w.write(RequestRecord(0.001 + i * 1e-6, f"s{i}", "token", 1))
    w.write(RequestRecord(0.5, "again", "token", 2))
    w.close()
    cols, _ = fastscan.open_columns(str(p))
    assert cols is not None
    with open(cols.side, "rb") as g:
        kind = fastscan._records(g.fileno(), 0, cols.count)["kind"]
    assert int(np.count_nonzero(kind == TC.ID)) == (1 << 16) + 2  # "again" defined twice
    head = len(p.read_bytes().split(b"\n", 1)[0]) + 1
    ok, got = fastscan._parse_cols(cols, head, p.stat().st_size)
    want = fastscan._parse_range(str(p), head, p.stat().st_size, False)
    assert ok and got is not None and want is not None
    assert got.ids == want.ids and np.array_equal(got.codes, want.codes) and np.array_equal(got.ns, want.ns)
    assert got.ids.count("again") == 1


def test_a_sidecar_cut_short_while_read_sends_its_chunks_to_the_jsonl(trace: Path, tmp_path: Path) -> None:
    """A recorder started again with --force truncates the sidecar under a running analysis: the
    chunks it no longer holds are read from the JSONL (a short read, not a crash)."""
    p = tmp_path / "t.jsonl"
    shutil.copy(trace, p)
    shutil.copy(str(trace) + TC.SUFFIX, str(p) + TC.SUFFIX)
    cols, _ = fastscan.open_columns(str(p))
    assert cols is not None
    side = Path(str(p) + TC.SUFFIX)
    side.write_bytes(side.read_bytes()[: side.stat().st_size // 3])
    with open(p, "rb") as f:
        head = len(f.readline())
        ends = fastscan._bounds(f, head, p.stat().st_size, CHUNK)
    used = []
    for a, b in zip([head, *ends[:-1]], ends, strict=True):
        ok, got = fastscan._parse_cols(cols, a, b)
        used.append(ok)
        if ok and got is not None:
            want = fastscan._parse_range(str(p), a, b, False)
            assert want is not None and got.ids == want.ids and np.array_equal(got.ts, want.ts)
    assert any(used) and not all(used) and not any(used[len(used) // 2:])
