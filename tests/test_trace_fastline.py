"""The trace writer's token line (built from its parts, its time written without ``round``) is the
line the general writer makes of the same record, byte for byte, and so is the token sidecar: the
same records written once as ``RequestRecord`` (the fast path) and once as their dicts (the general
path, ``json`` over ``trace_time``) give the same two files."""

from __future__ import annotations

import dataclasses
import json
import math
import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtop.model import token_columns as TC
from kvtop.model.records import RequestRecord, to_dict
from kvtop.model.trace import TraceWriter, make_header
from kvtop.sources.sse import StreamRecorder

# every optional field but n: a token record carrying any of them is not a plain token line
OPTIONAL = [f.name for f in dataclasses.fields(RequestRecord) if f.name not in ("t", "id", "event", "n")]


def _halfway(k: int, d: int) -> list[float]:
    """A time at the midpoint of two 6-decimal values and the floats either side of it."""
    t = k + d / 1e6 + 5e-7
    return [t, math.nextafter(t, 0.0), math.nextafter(t, math.inf)]


TIMES = st.one_of(
    st.floats(1e-3, 4e9),  # the fast path's range
    st.floats(1e-7, 2e10),  # and either side of it
    st.integers(0, 4 * 10**15).map(lambda us: us / 1e6),  # exactly 6 decimals
    st.integers(0, 4 * 10**10).map(lambda v: v / 10),  # few decimals: trailing zeros
    st.builds(_halfway, st.integers(0, 4 * 10**9), st.integers(0, 10**6 - 1)).flatmap(st.sampled_from),
    st.sampled_from([1e-3, math.nextafter(1e-3, 0.0), 4e9, math.nextafter(4e9, 0.0), 1e9, math.nextafter(1e9, 2e9),
                     1e-5, 5e-5, 0.0, -0.0, -1.5, 1.0, 100.0, 12.5, 1e16, math.inf, -math.inf, math.nan]),
    st.integers(0, 10**9),  # an int time (not the fast path's)
)
IDS = st.one_of(
    st.sampled_from(["chatcmpl-1", "cmpl-7f3a", "", '"', "\\", 'a"b\\c', "é", "\x00\x1f", "\u2028", "a" * 47,
                     "a" * 48, "b" * 80, "id with spaces", "</script>"]),
    st.text(max_size=60),
)


@st.composite
def record(draw: st.DrawFn) -> RequestRecord:
    kind = draw(st.sampled_from(["token"] * 6 + ["first_token", "resync", "finish", "extra"]))
    t = draw(TIMES)
    rid = draw(st.one_of(IDS, st.sampled_from(["r1", "r2"])))  # ids seen again: their sidecar code known
    # the sidecar holds n of one or two digits
    n = draw(st.one_of(st.just(1), st.sampled_from([0, 2, 9, 10, 99, 100, 101]), st.integers(0, 10**12), st.none()))
    if kind == "finish":  # a stream's last record, with the usage its last chunk carried
        return RequestRecord(t, rid, "finish", finish_reason=draw(st.sampled_from([None, "length", "stop"])),
                             completion_tokens=draw(st.integers(0, 5000)), prompt_tokens=draw(st.integers(0, 5000)))
    rec = RequestRecord(t, rid, "token" if kind == "extra" else kind, n)
    if kind == "extra":  # a token record with another field set: the general path's
        setattr(rec, draw(st.sampled_from(OPTIONAL)), draw(st.sampled_from([7, "x", True, 0.25])))
    return rec


def _written(d: Path, name: str, items: list[RequestRecord | dict[str, object] | None],
             header: dict[str, object]) -> tuple[bytes, bytes]:
    path = d / name
    w = TraceWriter(path, header, flush_interval_s=3600.0, columns=True)
    for it in items:
        if it is None:
            w.flush()  # a sidecar mark, at the same place in both
        else:
            w.write(it)
    w.close()
    return path.read_bytes(), Path(TC.sidecar_path(str(path))).read_bytes()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(record(), record(), record(), st.none()), min_size=1, max_size=40))
def test_token_lines_and_sidecar_are_the_general_writers(recs: list[RequestRecord | None]) -> None:
    header = make_header(engine={}, recorder="test")
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        fast = _written(d, "fast.jsonl", list(recs), header)
        general = _written(d, "general.jsonl", [None if r is None else to_dict(r) for r in recs], header)
    assert fast[0] == general[0]
    assert fast[1] == general[1]


@st.composite
def stream(draw: st.DrawFn) -> tuple[str, list[bytes]]:
    """One response's SSE reads: token chunks with random texts, then a last chunk with usage."""
    rid = draw(IDS)
    texts = draw(st.lists(st.one_of(st.sampled_from(["", "a", " the", '"', "\\", "\n"]), st.text(max_size=8)),
                          min_size=1, max_size=25))
    reads = [b"data: " + json.dumps({"id": rid, "object": "text_completion", "model": "m",
                                     "choices": [{"index": 0, "text": x, "logprobs": None, "finish_reason": None}]},
                                    separators=(",", ":")).encode() + b"\n\n" for x in texts]
    last = {"id": rid, "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
            "usage": {"prompt_tokens": draw(st.integers(0, 9000)), "completion_tokens": len(texts)}}
    reads.append(b"data: " + json.dumps(last).encode() + b"\n\ndata: [DONE]\n\n")
    return rid, reads


@settings(max_examples=150, deadline=None)
@given(st.lists(stream(), min_size=1, max_size=4), st.lists(TIMES, min_size=1, max_size=20))
def test_recorded_streams_are_written_as_the_general_writer_writes_them(
        streams: list[tuple[str, list[bytes]]], times: list[float]) -> None:
    """Streams through the recorder, interleaved, at times of every precision: the trace and sidecar
    the records make are those their dicts make through the general path."""
    recs: list[RequestRecord] = []
    recorders = [(StreamRecorder(rid, recs.append, 200, True), list(reads)) for rid, reads in streams]
    i = 0
    while any(reads for _, reads in recorders):
        for r, reads in recorders:
            if reads:
                t = times[i % len(times)]
                r.feed(reads.pop(0), t if isinstance(t, float) else float(t))
                i += 1
    header = make_header(engine={}, recorder="test")
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        fast = _written(d, "fast.jsonl", list(recs), header)
        general = _written(d, "general.jsonl", [to_dict(r) for r in recs], header)
    assert fast == general


def test_a_token_record_with_any_other_field_set_is_written_whole() -> None:
    """Each optional field in turn (a field added to RequestRecord too): the general path's line."""
    header = make_header(engine={}, recorder="test")
    recs: list[RequestRecord | None] = []
    for name in OPTIONAL:
        for value in (7, "x", True, 0.25):
            rec = RequestRecord(12.345678, "r1", "token", 1)
            setattr(rec, name, value)
            recs += [RequestRecord(12.0, "r1", "token", 1), rec]
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        fast = _written(d, "fast.jsonl", list(recs), header)
        general = _written(d, "general.jsonl", [None if r is None else to_dict(r) for r in recs], header)
    assert fast == general
    assert fast[0].count(b'"event":"token"') == 8 * len(OPTIONAL)


def test_a_plain_token_stream_is_read_back_from_its_sidecar() -> None:
    """The fast path's lines are token lines the sidecar holds, with their times to the microsecond."""
    header = make_header(engine={}, recorder="test")
    times = [1.0 + i * 0.0200000004 for i in range(50)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.jsonl"
        with TraceWriter(path, header, columns=True) as w:
            for t in times:
                w.write(RequestRecord(t, "r1", "token", 1))
        side = Path(TC.sidecar_path(str(path))).read_bytes()
    recs = [TC.RECORD.unpack_from(side, TC.HEAD.size + i * TC.RECORD.size)
            for i in range((len(side) - TC.HEAD.size) // TC.RECORD.size)]
    tokens = [r for r in recs if r[5] == TC.TOKEN]
    assert [r[1] for r in tokens] == [round(t, 6) for t in times]
