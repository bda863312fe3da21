"""Scanning an OpenAI-compatible response into request records (docs/design.md §5.1).

``StreamRecorder`` turns one response's bytes (SSE events or a JSON body) into arrive-less request
records: first_token, token, finish, cancel, error. The recording proxy, the probe and passive
capture all feed it, so the three sources count tokens and time chunks the same way. Nothing the
user wrote or the model generated is kept, and no header: only counts, ids, status codes and short
machine-readable reason strings.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from kvtop.model.records import RequestRecord

Emit = Callable[[RequestRecord], None]
Clock = Callable[[], float]

RECORDED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})

# Bounded buffers: the recorder must never hold a whole large response in memory.
_SSE_BUFFER_CAP = 1 << 20
_JSON_BODY_CAP = 16 << 20
_ERROR_BODY_CAP = 64 << 10


# Only identifier-like strings leave the stream: an error "type" or finish_reason that looked
# like prose could carry user text.
_SAFE_WORD = re.compile(r"^[A-Za-z][A-Za-z0-9_.:\-]{0,63}$")


def safe_word(v: Any) -> str | None:
    if isinstance(v, str) and _SAFE_WORD.match(v):
        return v
    return None


def prompt_tokens_from_request(body: dict[str, Any]) -> int | None:
    """Prompt length when the request itself says (a token-id prompt); text prompts are unknown."""
    p = body.get("prompt")
    if isinstance(p, list) and p:
        if all(isinstance(x, int) for x in p):
            return len(p)
        if all(isinstance(x, list) and x and all(isinstance(y, int) for y in x) for x in p):
            return sum(len(x) for x in p)
    return None


def error_type_from_body(body: bytes, status: int | None) -> str:
    """Machine-readable error type from an error body (OpenAI, vLLM, TGI, FastAPI shapes)."""
    try:
        d = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        d = None
    if isinstance(d, dict):
        err = d.get("error")
        for cand in (
            err.get("type") if isinstance(err, dict) else None,
            err.get("code") if isinstance(err, dict) else None,
            d.get("type"),
            d.get("error_type"),
        ):
            w = safe_word(cand)
            if w:
                return w
    return f"http_{status}" if status else "error"


def _chunk_tokens(choice: dict[str, Any]) -> int:
    """Tokens carried by one streamed choice: explicit token ids / logprobs when present, else 1."""
    ids = choice.get("token_ids")
    if isinstance(ids, list) and ids:
        return len(ids)
    lp = choice.get("logprobs")
    if isinstance(lp, dict):
        toks = lp.get("tokens")  # completions
        if not isinstance(toks, list):
            toks = lp.get("content")  # chat
        if isinstance(toks, list) and toks:
            return len(toks)
    text = choice.get("text")
    if text:
        return 1
    delta = choice.get("delta")
    if isinstance(delta, dict):
        for k in ("content", "reasoning_content", "reasoning", "tool_calls", "function_call", "refusal"):
            if delta.get(k):
                return 1
    return 0


# The commonest chunk (one choice, plain text delta, not finished) is counted without a JSON
# parse. JSON escapes every quote inside a string, so these key patterns can only match real keys,
# never text inside a value. Anything else (several choices, usage, token ids, logprobs, errors,
# tool calls, finish) goes through the full parser.
_SLOW_RE = re.compile(rb'"(?:usage|metrics|timings|token_ids|error|tool_calls|function_call|reasoning\w*|refusal)"')
_FINISH_NULL_RE = re.compile(rb'"finish_reason": ?null')
_LOGPROBS_RE = re.compile(rb'"logprobs": ?(.)')
_TEXT_RE = re.compile(rb'"(?:text|content)": ?(null|"")?')


def _plain_token_chunk(data: bytes) -> int | None:
    """1 token, 0 for an empty delta, or None when the chunk needs the full parser."""
    if _SLOW_RE.search(data) is not None or data.count(b'"index"') != 1:
        return None
    if _FINISH_NULL_RE.search(data) is None:
        return None
    lp = _LOGPROBS_RE.search(data)
    if lp is not None and lp.group(1) != b"n":
        return None
    found = _TEXT_RE.findall(data)
    if len(found) != 1:
        return None
    return 0 if found[0] else 1



# vLLM's per-request metrics object (``--enable-per-request-metrics``; on the final usage chunk of
# a stream, in the body of a non-streamed response): field -> the finish record's field. Only
# these numbers are read; they are engine-core times in milliseconds.
_ENGINE_METRICS = (("queue_time_ms", "engine_queue_s"), ("time_to_first_token_ms", "engine_ttft_s"),
                   ("generation_time_ms", "engine_decode_s"))
_METRIC_MAX_MS = 7 * 86400e3  # a week: anything longer is not a request's time


# llama.cpp's ``timings`` object (every response's final chunk or body, llama-server's
# ``server_task_result``): the time it processed the prompt (from the slot taking the request to the
# first token) and the time it generated, in milliseconds; the queue before a free slot is not in it.
_LLAMACPP_TIMINGS = (("prompt_ms", "engine_ttft_s"), ("predicted_ms", "engine_decode_s"))


def engine_metrics(m: Any, fields: tuple[tuple[str, str], ...] = _ENGINE_METRICS) -> dict[str, float] | None:
    """Seconds from a response's ``metrics`` object (``fields``: llama.cpp's ``timings`` with
    ``_LLAMACPP_TIMINGS``), finite, non-negative numbers only."""
    if not isinstance(m, dict):
        return None
    out = {}
    for key, name in fields:
        v = m.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= _METRIC_MAX_MS:
            out[name] = round(v / 1000.0, 6)
    return out or None


def cached_tokens(usage: Any, timings: Any) -> int | None:
    """Prompt tokens the engine served from its prefix cache, where the response says it."""
    for obj, key in ((timings, "cache_n"), (usage.get("prompt_tokens_details") if isinstance(usage, dict) else None,
                                            "cached_tokens")):
        v = obj.get(key) if isinstance(obj, dict) else None
        if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
            return v
    return None


class StreamRecorder:
    """Turns one response's bytes into request records. Shared by the proxy and the probe.

    Feed it every chunk with the time it arrived; it tolerates SSE events split across reads,
    CRLF line endings and comments, and never keeps more than a bounded buffer.
    """

    __slots__ = (
        "id", "emit", "sse", "status", "ended", "_buf", "_body", "_tokens", "_usage_ct", "_prompt_tokens",
        "_finish_reason", "_overflow", "_pend_n", "_pend_t", "holes", "_skip", "_resync", "_metrics", "_cached",
        "_tok_pre", "_tok_suf",
    )

    def __init__(self, request_id: str, emit: Emit, status: int, sse: bool):
        self.id = request_id
        self.emit = emit
        self.status = status
        self.sse = sse and status < 400
        self.ended = False
        self._buf = b""
        self._body: list[bytes] = []
        self._tokens = 0
        self._usage_ct: int | None = None
        self._prompt_tokens: int | None = None
        self._finish_reason: str | None = None
        self._overflow = 0
        # Token chunks that arrived in the same read share one timestamp; they become one record
        # (n summed) at the end of the read: a gap of zero between them is TCP batching, not timing.
        self._pend_n = 0
        self._pend_t = 0.0
        # Passive capture can lose bytes (a kernel drop): ``hole()`` counts it, the next token
        # record is a "resync" (its gap from the previous token is unknown, never a stall) and
        # the end record says incomplete.
        self.holes = 0
        self._skip = False
        self._resync = False
        self._metrics: dict[str, float] | None = None
        self._cached: int | None = None
        # A stream's token chunks differ only in their text: the bytes around the text of the last
        # plain token chunk, so the next one is recognised by comparison (see feed)
        self._tok_pre = b""
        self._tok_suf = b""

    @property
    def tokens(self) -> int:
        return self._tokens

    def feed(self, chunk: bytes, t: float) -> None:
        if self.ended:
            return
        if self._skip:
            chunk = self._after_hole(chunk)
            if not chunk:
                return
        if not self.sse:
            cap = _ERROR_BODY_CAP if self.status >= 400 else _JSON_BODY_CAP
            if self._overflow + len(chunk) <= cap:
                self._body.append(chunk)
            self._overflow += len(chunk)
            return
        if not self._buf:
            pre = self._tok_pre
            if pre and chunk.startswith(pre):
                suf = self._tok_suf
                if chunk.endswith(suf):
                    # the stream's next token chunk, recognised by the bytes around the text of
                    # its last plain one (the commonest chunk of all, counted without parsing): a
                    # text without a quote, a line break or a trailing backslash cannot end its
                    # JSON string early or reach past it, so the event has that event's keys and
                    # values around one string, what _plain_token_chunk would answer (1 token, or
                    # 0 for an empty text)
                    lp = len(pre)
                    end = len(chunk) - len(suf)
                    text = chunk[lp:end]
                    # byte values, not one-byte strings: ``34 in text`` is a memchr, ``b'"' in
                    # text`` a general search (5 times the cost)
                    if lp <= end and 34 not in text and 10 not in text and 13 not in text and text[-1:] != b"\\":
                        if text:
                            if self._pend_n or self._resync or not self._tokens:
                                self._pend_n += 1
                                self._pend_t = t
                                self._flush_tokens()
                            else:
                                # _flush_tokens' plain "token" record
                                self.emit(RequestRecord(t, self.id, "token", 1))
                                self._tokens += 1
                        elif self._pend_n:
                            self._flush_tokens()
                        return
            if chunk.startswith(b"data: ") and chunk.find(b"\n") == len(chunk) - 2 and chunk.endswith(b"\n\n") \
                    and b"\r" not in chunk:
                # one read that is exactly one one-line event (what the loop below would find,
                # without its copies)
                data = chunk[6:-2]
                n = _plain_token_chunk(data) if data != b"[DONE]" else None
                if n is None:
                    self._event(chunk[:-2], t)
                elif n:
                    self._learn_shape(chunk)
                    self._pend_n += n
                    self._pend_t = t
                if self._pend_n and not self.ended:
                    self._flush_tokens()
                return
        buf = self._buf + chunk if self._buf else chunk
        if b"\r" in buf:
            hold = buf.endswith(b"\r")  # may be the first half of a CRLF split across reads
            body = buf[:-1] if hold else buf
            buf = body.replace(b"\r\n", b"\n").replace(b"\r", b"\n") + (b"\r" if hold else b"")
        start = 0
        while True:
            i = buf.find(b"\n\n", start)
            if i < 0:
                break
            self._event(buf[start:i], t)
            start = i + 2
            if self.ended:
                self._buf = b""
                return
        if self._pend_n:
            self._flush_tokens()
        rest = buf[start:] if start else buf
        if len(rest) > _SSE_BUFFER_CAP:
            # An event too big to hold (or a body that is not SSE at all): its bytes are passed on
            # unread, as a capture's lost bytes are: the stream is read again from the next event,
            # its next tokens a resync, and its end says incomplete (it said nothing and the rest
            # of the stream went unrecorded)
            self._buf = b""
            self.hole()
            return
        self._buf = rest

    def _learn_shape(self, chunk: bytes) -> None:
        """Remember the bytes around the text of ``chunk``, a one-line plain token event."""
        m = _TEXT_RE.search(chunk)
        if m is None or m.group(1) is not None:
            return
        start = m.end()
        if chunk[start:start + 1] != b'"':
            return
        end = chunk.find(b'"', start + 1)
        if end < 0 or b"\\" in chunk[start + 1:end]:
            return
        self._tok_pre = chunk[:start + 1]
        self._tok_suf = chunk[end:]

    def hole(self) -> None:
        """Bytes of this response were lost between the last ``feed`` and the next."""
        if self.ended:
            return
        self.holes += 1
        if self._pend_n:
            self._flush_tokens()
        self._resync = True
        if self.sse:
            self._buf = b""
            self._skip = True  # the next bytes may start mid-event
        else:
            self._overflow = _JSON_BODY_CAP + 1  # a JSON body with a hole in it cannot be parsed

    def unreadable(self) -> None:
        """The body is encoded (``Content-Encoding: gzip``): no token can be read from it, so none is
        counted (a gzip stream read as SSE finds no event: a finish with no token) and the end says
        incomplete; an error status still ends as that error."""
        self.holes += 1
        self.sse = False
        self._overflow = _JSON_BODY_CAP + 1

    def _after_hole(self, chunk: bytes) -> bytes:
        if chunk.startswith(b"data:"):  # the hole ended on an event boundary (the usual case)
            self._skip = False
            return chunk
        chunk = chunk.replace(b"\r\n", b"\n")
        i = chunk.find(b"\n\n")
        if i < 0:
            return b""
        self._skip = False
        return chunk[i + 2:]

    def _event(self, raw: bytes, t: float) -> None:
        if raw.startswith(b"data: ") and b"\n" not in raw:
            data: bytes | None = raw[6:]  # the usual one-line event
        else:
            data = None
            for line in raw.split(b"\n"):
                if line.startswith(b"data:"):
                    v = line[5:]
                    if v.startswith(b" "):
                        v = v[1:]
                    data = v if data is None else data + b"\n" + v
        if data is None:
            return
        if data == b"[DONE]":
            self.finish(t)
            return
        n = _plain_token_chunk(data)
        if n is not None:
            if n:
                self._pend_n += n
                self._pend_t = t
            return
        try:
            obj = json.loads(data)
        except ValueError:
            return
        if not isinstance(obj, dict):
            return
        self._chunk(obj, t)

    def _chunk(self, obj: dict[str, Any], t: float) -> None:
        err = obj.get("error")
        if err is not None or obj.get("object") == "error":
            etype = None
            code = None
            if isinstance(err, dict):
                etype = safe_word(err.get("type")) or safe_word(err.get("code"))
                code = err.get("code") if isinstance(err.get("code"), int) else None
            etype = etype or safe_word(obj.get("type")) or "stream_error"
            self._end(RequestRecord(t, self.id, "error", status=code, error=etype))
            return
        n = 0
        choices = obj.get("choices")
        if isinstance(choices, list):
            for c in choices:
                if not isinstance(c, dict):
                    continue
                n += _chunk_tokens(c)
                fr = c.get("finish_reason")
                if fr is not None and self._finish_reason is None:
                    self._finish_reason = safe_word(fr) or "other"
        usage = obj.get("usage")
        if isinstance(usage, dict):
            ct = usage.get("completion_tokens")
            pt = usage.get("prompt_tokens")
            if isinstance(pt, int):
                self._prompt_tokens = pt
            if isinstance(ct, int):
                # Continuous usage stats: the delta is the exact token count of this chunk.
                if n and ct > (self._usage_ct or 0):
                    n = ct - (self._usage_ct or 0)
                self._usage_ct = ct
        self._engine_facts(obj)
        if n:
            self._pend_n += n
            self._pend_t = t

    def _flush_tokens(self) -> None:
        n = self._pend_n
        self._pend_n = 0
        if self._resync:
            # after lost bytes, even the stream's first seen token: the real first may have been lost,
            # and its time taken for the first token's would inflate the TTFT
            ev = "resync"
        elif self._tokens == 0:
            ev = "first_token"
        else:
            ev = "token"
        self._resync = False
        self.emit(RequestRecord(self._pend_t, self.id, ev, n))
        self._tokens += n

    def _end(self, rec: RequestRecord) -> None:
        if not self.ended:
            if self._pend_n:
                self._flush_tokens()
            self.ended = True
            if self.holes:
                rec.incomplete = True
            self.emit(rec)

    def finish(self, t: float) -> None:
        """Upstream finished normally ([DONE] or end of body)."""
        if self.ended:
            return
        if not self.sse and self._body and self._overflow <= _JSON_BODY_CAP:
            body = b"".join(self._body)
            self._body = []
            if self.status >= 400:
                self._end(RequestRecord(t, self.id, "error", status=self.status,
                                        error=error_type_from_body(body, self.status)))
                return
            self._parse_json_body(body)
        if self.status >= 400:
            self._end(RequestRecord(t, self.id, "error", status=self.status, error=f"http_{self.status}"))
            return
        ct = self._usage_ct if self._usage_ct is not None else None
        rec = RequestRecord(t, self.id, "finish", finish_reason=self._finish_reason,
                            completion_tokens=ct, prompt_tokens=self._prompt_tokens)
        for k, v in (self._metrics or {}).items():
            setattr(rec, k, v)
        rec.cached_tokens = self._cached
        self._end(rec)

    def _engine_facts(self, obj: dict[str, Any]) -> None:
        """What the engine says of the request on its final chunk or body: its own times (vLLM's
        ``metrics``, llama.cpp's ``timings``) and the prompt tokens its prefix cache served."""
        m, tm = obj.get("metrics"), obj.get("timings")
        if m is not None:
            self._metrics = engine_metrics(m) or self._metrics
        if tm is not None:
            self._metrics = engine_metrics(tm, _LLAMACPP_TIMINGS) or self._metrics
        cached = cached_tokens(obj.get("usage"), tm)
        if cached is not None:
            self._cached = cached

    def _parse_json_body(self, body: bytes) -> None:
        try:
            d = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            return
        if not isinstance(d, dict):
            return
        for c in d.get("choices") or []:
            if isinstance(c, dict) and c.get("finish_reason") is not None:
                self._finish_reason = safe_word(c.get("finish_reason")) or "other"
                break
        usage = d.get("usage")
        if isinstance(usage, dict):
            if isinstance(usage.get("completion_tokens"), int):
                self._usage_ct = usage["completion_tokens"]
            if isinstance(usage.get("prompt_tokens"), int):
                self._prompt_tokens = usage["prompt_tokens"]
        self._engine_facts(d)

    def cancel(self, t: float, reason: str | None = None) -> None:
        self._end(RequestRecord(t, self.id, "cancel", error=reason))

    def error(self, t: float, etype: str, status: int | None = None) -> None:
        self._end(RequestRecord(t, self.id, "error", status=status, error=etype))
