"""The SSE recorder's shortcut for a stream's token chunks (one event per read, recognised by the
bytes around the text of the previous plain token chunk) records exactly what the full parser does,
whatever the texts hold (quotes, backslashes, line breaks, key names, nothing) and however the chunks change
shape in between (chat deltas, logprobs, a finish reason, usage, errors)."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtop.model.records import RequestRecord
from kvtop.sources.sse import StreamRecorder


class FullParser(StreamRecorder):
    """The reference: every event through the regular expressions and ``json``."""

    __slots__ = ()

    def _learn_shape(self, chunk: bytes) -> None:
        return None


TEXTS = st.one_of(
    st.sampled_from(["", "a", "hello", "usage", "index", "text", "\"", "\\", "a\\", "x\\\\", "\"text\":\"b",
                     "\n", "é", "null", "}", "]},{"]),
    st.binary(max_size=6).map(lambda b: b.decode("latin-1")),
    st.text(max_size=12),
)


@st.composite
def chunk(draw: st.DrawFn) -> bytes:
    text = draw(TEXTS)
    kind = draw(st.sampled_from(["completion", "completion", "completion", "chat", "finish", "logprobs", "usage",
                                 "two", "error", "null_text", "other_id", "raw"]))
    if kind == "raw":  # arbitrary bytes where the text goes, not JSON-escaped (a broken or hostile stream)
        return (b'data: {"id":"cmpl-1","object":"text_completion","model":"m","choices":[{"index":0,"text":"'
                + draw(st.binary(max_size=8)) + b'","logprobs":null,"finish_reason":null}]}\n\n')
    rid = "cmpl-2" if kind == "other_id" else "cmpl-1"
    choice: dict[str, object] = {"index": 0, "text": text, "logprobs": None, "finish_reason": None}
    if kind == "chat":
        choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
    elif kind == "finish":
        choice["finish_reason"] = "length"
    elif kind == "logprobs":
        choice["logprobs"] = {"tokens": [text]}
    elif kind == "null_text":
        choice["text"] = None
    obj: dict[str, object] = {"id": rid, "object": "text_completion", "model": "m", "choices": [choice]}
    if kind == "two":
        obj["choices"] = [choice, {**choice, "index": 1}]
    elif kind == "usage":
        obj["usage"] = {"prompt_tokens": 3, "completion_tokens": 7}
    elif kind == "error":
        obj = {"error": {"type": "overloaded", "code": 503}}
    sep = draw(st.sampled_from([(",", ":"), (", ", ": ")]))
    return b"data: " + json.dumps(obj, separators=sep, ensure_ascii=draw(st.booleans())).encode() + b"\n\n"


def _records(cls: type[StreamRecorder], events: list[bytes | None]) -> list[RequestRecord]:
    """``None``: bytes lost there (passive capture's hole)."""
    out: list[RequestRecord] = []
    rec = cls("r", out.append, 200, True)
    for i, ev in enumerate(events):
        if ev is None:
            rec.hole()
        else:
            rec.feed(ev, float(i))
    rec.feed(b"data: [DONE]\n\n", float(len(events)))
    return out


@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(chunk(), chunk(), chunk(), chunk(), st.none()), min_size=1, max_size=30))
def test_the_token_shortcut_records_what_the_parser_does(events: list[bytes | None]) -> None:
    assert _records(StreamRecorder, events) == _records(FullParser, events)


def test_a_plain_stream_is_counted_token_by_token() -> None:
    ev = [b'data: {"id":"c","choices":[{"index":0,"text":"t%d","logprobs":null,"finish_reason":null}]}\n\n' % i
          for i in range(50)]
    recs = _records(StreamRecorder, ev)
    assert [r.event for r in recs] == ["first_token"] + ["token"] * 49 + ["finish"]
    assert sum(r.n or 0 for r in recs) == 50 and [r.t for r in recs[:50]] == [float(i) for i in range(50)]


def test_a_text_that_could_end_its_string_early_goes_to_the_parser() -> None:
    """After a plain chunk has taught the shortcut its shape, raw texts holding what could end or
    break the JSON string (a quote, a line break, a trailing backslash, the two shapes overlapping)
    are counted as the parser counts them, not as one token each."""
    head = b'data: {"id":"c","choices":[{"index":0,"text":"'
    tail = b'","logprobs":null,"finish_reason":null}]}\n\n'
    hostile = [b'a"b', b"a\nb", b"a\rb", b"a\\", b"\n", b'"', b"\\"]
    for text in hostile:
        events: list[bytes | None] = [head + b"x" + tail, head + text + tail, head + b"y" + tail]
        assert _records(StreamRecorder, events) == _records(FullParser, events), text
    overlap: list[bytes | None] = [head + b"x" + tail, head + tail[1:]]  # starts with one, ends with the other
    assert _records(StreamRecorder, overlap) == _records(FullParser, overlap)
    plain: list[bytes | None] = [head + b"x" + tail, head + b"y" + tail]
    assert sum(r.n or 0 for r in _records(StreamRecorder, plain)) == 2


def test_an_event_too_big_to_hold_is_skipped_and_the_stream_read_on_marked_incomplete() -> None:
    # one 3 MB event (a huge logprobs payload, say) between tokens: the recorder stopped reading
    # the stream there and its end said nothing of what it missed
    tok = b'data: {"id":"c","choices":[{"index":0,"text":"t","logprobs":null,"finish_reason":null}]}\n\n'
    big = b'data: {"id":"c","choices":[{"index":0,"text":"' + b"x" * (3 << 20) + b'","finish_reason":null}]}\n\n'
    out: list[RequestRecord] = []
    rec = StreamRecorder("r", out.append, 200, True)
    rec.feed(tok, 0.0)
    for i in range(0, len(big), 65536):  # as the socket hands it over
        rec.feed(big[i:i + 65536], 1.0)
    rec.feed(tok, 2.0)
    rec.feed(tok, 3.0)
    rec.feed(b"data: [DONE]\n\n", 4.0)
    assert [(r.event, r.t) for r in out] == [("first_token", 0.0), ("resync", 2.0), ("token", 3.0), ("finish", 4.0)]
    assert out[-1].incomplete is True
