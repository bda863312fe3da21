"""Recording proxy against a tiny scripted SSE upstream (issue 4).

The upstream writes SSE events at scripted times; the proxy must stamp each token after the upstream
wrote its bytes and before the client had them (an order, not a latency: it holds however busy the
machine is; bench/proxy_overhead.py measures how close), the client must get exactly the bytes a
direct connection gets, and nothing the user wrote, the model wrote, or any header value may reach
the trace.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as hs
from local_server import serve
from multidict import CIMultiDict

import kvtop.sources.sse as sse_mod
from kvtop.model.records import RequestRecord
from kvtop.model.trace import TraceReader, TraceWriter, make_header
from kvtop.sources.proxy import RecordingProxy, make_proxy
from kvtop.sources.sse import StreamRecorder

PROMPT_MARKER = "PROMPT-MARKER-7f3a9c"
COMPLETION_MARKER = "COMPLETION-MARKER-b81e44"
AUTH_MARKER = "Bearer AUTH-MARKER-5d2c01"
HEADER_MARKER = "HEADER-MARKER-e0917a"


def sse(obj: Any) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


def chunk(text: str, usage_ct: int | None = None, finish: str | None = None) -> dict[str, Any]:
    d: dict[str, Any] = {
        "id": "cmpl-1", "object": "text_completion", "model": "m",
        "choices": [{"index": 0, "text": text, "finish_reason": finish}],
    }
    if usage_ct is not None:
        d["usage"] = {"prompt_tokens": 7, "completion_tokens": usage_ct, "total_tokens": 7 + usage_ct}
    return d


def chat_chunk(content: str | None, role: str | None = None, finish: str | None = None) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    if role:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


# Scripts: list of (seconds after the request reached the upstream, bytes to write, tokens carried).
SCRIPTS: dict[str, list[tuple[float, bytes, int]]] = {
    # steady stream, 40 ms per token
    "steady": [(0.05 + 0.04 * i, sse(chunk(f"tok{i} " + COMPLETION_MARKER)), 1) for i in range(8)]
    + [(0.40, sse(chunk("", finish="length")), 0), (0.41, b"data: [DONE]\n\n", 0)],
    # a 1.5 s stall after the third token
    "stall": [(0.05, sse(chunk("a")), 1), (0.09, sse(chunk("b")), 1), (0.13, sse(chunk("c")), 1),
              (1.63, sse(chunk("d")), 1), (1.67, sse(chunk("e", finish="stop")), 1),
              (1.68, b"data: [DONE]\n\n", 0)],
    # continuous usage stats: the second content chunk carries 2 tokens; one event split across
    # two TCP writes 60 ms apart (its time is when the second half arrives)
    "usage": [(0.05, sse(chunk("x", usage_ct=1)), 1), (0.10, sse(chunk("yz", usage_ct=3)), 2),
              (0.15, sse(chunk("w", usage_ct=4))[:17], 0), (0.21, sse(chunk("w", usage_ct=4))[17:], 1),
              (0.25, sse(chunk("", usage_ct=4, finish="stop")), 0), (0.26, b"data: [DONE]\n\n", 0)],
    # chat: role-only first chunk carries no token; CRLF line endings
    "chat": [(0.03, sse(chat_chunk("", role="assistant")).replace(b"\n", b"\r\n"), 0),
             (0.06, sse(chat_chunk("Hel")).replace(b"\n", b"\r\n"), 1),
             (0.09, sse(chat_chunk("lo")).replace(b"\n", b"\r\n"), 1),
             (0.10, sse(chat_chunk(None, finish="stop")).replace(b"\n", b"\r\n"), 0),
             (0.11, b"data: [DONE]\r\n\r\n", 0)],
}


class ScriptedUpstream:
    """An OpenAI-compatible server whose streams follow SCRIPTS exactly, in time."""

    def __init__(self) -> None:
        self.t0: dict[str, float] = {}
        self.headers: dict[str, CIMultiDict[str]] = {}
        self.bodies: dict[str, bytes] = {}
        self.disconnected: dict[str, float] = {}
        # when each scripted write actually went out (a loaded test machine can be late)
        self.sent: dict[str, list[float]] = {}
        self.port = 0
        self.default_script = "steady"
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        self._runner, self.port = await serve(app)

    async def stop(self) -> None:
        if self._runner:
            await self._runner.cleanup()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text="vllm:num_requests_running 1\n", content_type="text/plain")

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        t0 = time.monotonic()
        raw = await request.read()
        body = json.loads(raw)
        rid = request.headers.get("X-Request-Id", "?")
        self.t0[rid] = t0
        self.headers[rid] = CIMultiDict(request.headers)
        self.bodies[rid] = raw
        script = body.get("script", self.default_script)
        if script == "error400":
            return web.json_response({"object": "error", "type": "BadRequestError",
                                      "message": f"bad prompt {PROMPT_MARKER}", "code": 400}, status=400)
        if script == "error500":
            return web.Response(status=500, text="Internal Server Error")
        if not body.get("stream"):
            return web.json_response({
                "id": "cmpl-2", "object": "text_completion", "model": "m",
                "choices": [{"index": 0, "text": COMPLETION_MARKER, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 11, "total_tokens": 16},
            })
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        try:
            if script == "dies":  # the engine crashes mid-stream
                for i in range(2):
                    await resp.write(sse(chunk(f"t{i}")))
                    await asyncio.sleep(0.02)
                assert request.transport is not None
                request.transport.abort()
                return resp
            if script == "endless":
                i = 0
                while True:
                    await resp.write(sse(chunk(f"t{i}")))
                    i += 1
                    await asyncio.sleep(0.03)
            for at, data, _ in SCRIPTS[script]:
                delay = t0 + at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                self.sent.setdefault(rid, []).append(time.monotonic())
                await resp.write(data)
            # a client that leaves right after the last token (the probe at its stop) closes the
            # transport under write_eof: that is a disconnect too, not a harness failure
            await resp.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            self.disconnected[rid] = time.monotonic()
            raise
        return resp


class Recorder:
    def __init__(self) -> None:
        self.records: list[RequestRecord] = []

    def __call__(self, rec: RequestRecord) -> None:
        self.records.append(rec)

    def of(self, rid: str) -> list[RequestRecord]:
        return [r for r in self.records if r.id == rid]


@pytest.fixture
async def upstream():
    u = ScriptedUpstream()
    await u.start()
    yield u
    await u.stop()


@pytest.fixture(params=[1, 2], ids=["in-process", "2-workers"])
async def proxied(upstream, request):
    """The proxy in this process, and as a pool of two worker processes sharing the port."""
    rec = Recorder()
    proxy = make_proxy(upstream.url, rec, time.monotonic, workers=request.param)
    await proxy.start()
    yield upstream, proxy, rec
    await proxy.stop()


async def _post(base: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
                ) -> tuple[int, CIMultiDict[str], bytes]:
    async with aiohttp.ClientSession(auto_decompress=False) as s:
        async with s.post(base + path, json=body, headers=headers or {}) as r:
            data = await r.read()
            return r.status, CIMultiDict(r.headers), data


def _events_done(data: bytes) -> int:
    return data.count(b"\n\n") + data.count(b"\r\n\r\n")


async def _post_timed(base: str, path: str, body: dict[str, Any], headers: dict[str, str]
                      ) -> tuple[int, CIMultiDict[str], bytes, list[float]]:
    """_post, and when the client had each complete SSE event (time.monotonic, one per event)."""
    got: list[float] = []
    data = b""
    async with aiohttp.ClientSession(auto_decompress=False) as s:
        async with s.post(base + path, json=body, headers=headers) as r:
            async for piece in r.content.iter_any():
                now = time.monotonic()
                data += piece
                got += [now] * (_events_done(data) - len(got))
            return r.status, CIMultiDict(r.headers), data, got


def _event_sends(script: str, sent: list[float]) -> list[tuple[float, int]]:
    """(when the write that completed it went out, tokens it carries) per event of a script."""
    return [(ts, k) for (_, data, k), ts in zip(SCRIPTS[script], sent, strict=True) if _events_done(data)]


async def test_token_times_match_script_and_bytes_match_direct(proxied):
    upstream, proxy, rec = proxied
    names = ["steady", "stall", "usage"]
    ids = {n: f"req-{n}" for n in names}
    bodies = {n: {"model": "m", "prompt": PROMPT_MARKER, "stream": True, "script": n} for n in names}
    through = await asyncio.gather(*[
        _post_timed(proxy.url, "/v1/completions", bodies[n], {"X-Request-Id": ids[n]}) for n in names])
    direct = await asyncio.gather(*[
        _post(upstream.url, "/v1/completions", bodies[n], {"X-Request-Id": "direct-" + n}) for n in names])
    await proxy.flush_records()
    for n, (st, hd, data, _), (dst, dhd, ddata) in zip(names, through, direct, strict=True):
        assert st == dst == 200
        assert data == ddata, n  # client-side bytes identical to a direct connection
        assert hd["Content-Type"] == dhd["Content-Type"] == "text/event-stream"
        assert hd["X-Request-Id"] == ids[n]

    for n, (_, _, _, received) in zip(names, through, strict=True):
        rid = ids[n]
        sent = upstream.sent[rid]
        assert len(sent) == len(SCRIPTS[n])
        events = _event_sends(n, sent)
        assert len(received) == len(events)
        recs = rec.of(rid)
        assert [r.event for r in recs][0] == "arrive" and recs[-1].event == "finish"
        assert recs[0].source == "proxy"
        toks = [r for r in recs if r.event in ("first_token", "token")]
        assert [r.event for r in toks] == ["first_token"] + ["token"] * (len(toks) - 1)
        # every token counted once (the split event: one); events that came in one read (a busy
        # machine reads late) share a record and that read's time
        windows = [(ts, got) for (ts, k), got in zip(events, received, strict=True) for _ in range(k)]
        stamps = [r.t for r in toks for _ in range(r.n)]
        assert len(stamps) == len(windows) == sum(k for _, _, k in SCRIPTS[n])
        # each token stamped after the upstream wrote the bytes that completed it, before the client had them
        for t, (sent_t, got_t) in zip(stamps, windows, strict=True):
            assert sent_t <= t <= got_t, (n, sent_t, t, got_t)
        assert [r.t for r in recs] == sorted(r.t for r in recs)
        # finish is stamped when [DONE] arrived: after its write, before the client read it
        assert events[-1][0] <= recs[-1].t <= received[-1]

    stall = [r.t for r in rec.of(ids["stall"]) if r.event in ("first_token", "token") for _ in range(r.n)]
    gaps = [b - a for a, b in zip(stall, stall[1:], strict=False)]
    # the scripted 1.5 s stall after the third token is the stream's largest gap, and one gap: the
    # stamps around it sit in their windows, so however late the machine ran, the gap is at least
    # the upstream's own pause minus how late the client got the third token
    assert gaps.index(max(gaps)) == 2
    sent = upstream.sent[ids["stall"]]
    got = through[1][3]
    assert sent[3] - got[2] <= gaps[2] <= got[3] - sent[2]

    fin = {n: rec.of(ids[n])[-1] for n in names}
    assert fin["steady"].finish_reason == "length"
    assert fin["stall"].finish_reason == "stop"
    assert fin["usage"].completion_tokens == 4 and fin["usage"].prompt_tokens == 7
    assert sum(r.n or 0 for r in rec.of(ids["usage"]) if r.event in ("first_token", "token")) == 4


async def test_chat_crlf_and_request_id_assigned(proxied):
    upstream, proxy, rec = proxied
    st, hd, data, received = await _post_timed(
        proxy.url, "/v1/chat/completions",
        {"model": "m", "messages": [{"role": "user", "content": PROMPT_MARKER}], "stream": True, "script": "chat"}, {})
    assert st == 200
    await proxy.flush_records()
    rid = hd["X-Request-Id"]
    assert len(rid) == 32 and int(rid, 16) >= 0  # assigned uuid4 hex ...
    assert rid in upstream.t0  # ... and forwarded upstream
    recs = rec.of(rid)
    # the role-only chunk carries no token; "Hel" and "lo" do (one record if they came in one read)
    assert [r.event for r in recs][:2] == ["arrive", "first_token"] and recs[-1].event == "finish"
    assert [r.event for r in recs[2:-1]] in ([], ["token"])
    stamps = [r.t for r in recs[1:-1] for _ in range(r.n)]
    sent = upstream.sent[rid]
    assert len(stamps) == 2
    assert sent[1] <= stamps[0] <= received[1] and sent[2] <= stamps[1] <= received[2]
    assert recs[-1].finish_reason == "stop"


async def test_prompt_token_ids_non_streaming_and_passthrough(proxied):
    upstream, proxy, rec = proxied
    st, _, data = await _post(proxy.url, "/v1/completions",
                              {"model": "m", "prompt": [1, 2, 3, 4, 5, 6], "stream": False},
                              {"X-Request-Id": "ns-1"})
    assert st == 200 and json.loads(data)["usage"]["completion_tokens"] == 11
    await proxy.flush_records()
    recs = rec.of("ns-1")
    assert [r.event for r in recs] == ["arrive", "finish"]
    assert recs[0].prompt_tokens == 6
    assert recs[1].completion_tokens == 11 and recs[1].prompt_tokens == 5 and recs[1].finish_reason == "stop"

    n_before = len(rec.records)
    async with aiohttp.ClientSession() as s:
        async with s.get(proxy.url + "/v1/models?x=1") as r:
            assert r.status == 200 and (await r.json())["data"][0]["id"] == "m"
        async with s.get(proxy.url + "/metrics") as r:
            assert r.status == 200 and "vllm:num_requests_running 1" in await r.text()
        async with s.get(proxy.url + "/nope") as r:
            assert r.status == 404
    await proxy.flush_records()
    assert len(rec.records) == n_before  # pass-through paths are not recorded


async def test_client_disconnect_records_cancel_and_closes_upstream(proxied):
    upstream, proxy, rec = proxied
    async with aiohttp.ClientSession() as s:
        r = await s.post(proxy.url + "/v1/completions", json={"model": "m", "prompt": "p", "stream": True,
                                                              "script": "endless"},
                         headers={"X-Request-Id": "gone"})
        seen = b""
        while seen.count(b"\n\n") < 3:
            seen += await r.content.readany()
        t_close = time.monotonic()
        r.close()  # hang up mid-stream
    deadline = time.monotonic() + 30  # bounds a hang only
    while time.monotonic() < deadline:
        await proxy.flush_records()
        if "gone" in upstream.disconnected and any(x.event == "cancel" for x in rec.of("gone")):
            break
        await asyncio.sleep(0.02)
    events = [x.event for x in rec.of("gone")]
    assert events[0] == "arrive" and events[1] == "first_token" and events[-1] == "cancel"
    assert "finish" not in events
    cancel = rec.of("gone")[-1]
    assert t_close <= cancel.t
    # the endless upstream never ends a stream itself: it saw its client (the proxy) go away
    # because the proxy closed it when the client left
    assert upstream.disconnected["gone"] >= t_close
    while getattr(proxy, "in_flight", 0) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert getattr(proxy, "in_flight", 0) == 0


async def test_upstream_errors_pass_through_and_are_recorded(proxied):
    upstream, proxy, rec = proxied
    for script, status in (("error400", 400), ("error500", 500)):
        body = {"model": "m", "prompt": PROMPT_MARKER, "stream": True, "script": script}
        st, hd, data = await _post(proxy.url, "/v1/completions", body, {"X-Request-Id": script})
        dst, dhd, ddata = await _post(upstream.url, "/v1/completions", body, {"X-Request-Id": script + "-d"})
        await proxy.flush_records()
        assert st == dst == status and data == ddata
        assert hd["Content-Type"] == dhd["Content-Type"]
        recs = rec.of(script)
        assert [r.event for r in recs] == ["arrive", "error"]
        assert recs[1].status == status
    assert rec.of("error400")[1].error == "BadRequestError"
    assert rec.of("error500")[1].error == "http_500"


async def test_upstream_dying_mid_stream_is_an_error_and_the_client_sees_a_cut(proxied):
    upstream, proxy, rec = proxied
    got = b""
    async with aiohttp.ClientSession() as s:
        async with s.post(proxy.url + "/v1/completions", json={"model": "m", "prompt": "p", "stream": True,
                                                               "script": "dies"},
                          headers={"X-Request-Id": "dies"}) as r:
            with pytest.raises(aiohttp.ClientPayloadError):
                async for data in r.content.iter_any():
                    got += data
    assert got.count(b"\n\n") == 2  # what was sent before the crash still arrived
    await proxy.flush_records()
    events = [(x.event, x.error) for x in rec.of("dies")]
    assert events == [("arrive", None), ("first_token", None), ("token", None), ("error", "upstream_disconnected")]


async def test_upstream_refused_gives_502_json():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rec = Recorder()
    proxy = RecordingProxy(f"http://127.0.0.1:{port}", rec, time.monotonic)
    await proxy.start()
    try:
        st, hd, data = await _post(proxy.url, "/v1/completions", {"model": "m", "prompt": "p", "stream": True},
                                   {"X-Request-Id": "r1"})
        assert st == 502
        assert json.loads(data)["error"]["type"] == "upstream_unreachable"
        assert [r.event for r in rec.of("r1")] == ["arrive", "error"]
        assert rec.of("r1")[1].status == 502 and rec.of("r1")[1].error == "upstream_unreachable"
    finally:
        await proxy.stop()


async def test_no_text_or_headers_in_trace(upstream, tmp_path: Path):
    path = tmp_path / "t.jsonl"
    writer = TraceWriter(path, make_header(engine={"adapter": "vllm", "url": upstream.url}))
    proxy = RecordingProxy(upstream.url, writer.write, time.monotonic)
    await proxy.start()
    try:
        hdrs = {"Authorization": AUTH_MARKER, "X-Custom": HEADER_MARKER, "X-Request-Id": "priv-1"}
        for script in ("steady", "error400", "usage"):
            await _post(proxy.url, "/v1/completions",
                        {"model": "m", "prompt": PROMPT_MARKER, "stream": True, "script": script}, hdrs)
        await _post(proxy.url, "/v1/chat/completions",
                    {"model": "m", "messages": [{"role": "user", "content": PROMPT_MARKER}], "stream": False},
                    hdrs)
    finally:
        await proxy.stop()
        writer.close()
    # Authorization reaches the upstream untouched ...
    assert upstream.headers["priv-1"]["Authorization"] == AUTH_MARKER
    assert upstream.headers["priv-1"]["X-Custom"] == HEADER_MARKER
    text = path.read_text()
    # ... and appears nowhere in the trace, nor does any text either side wrote
    for marker in (PROMPT_MARKER, COMPLETION_MARKER, "AUTH-MARKER", HEADER_MARKER, "tok1", "Hel"):
        assert marker not in text
    recs = list(TraceReader(path).records())
    assert sum(1 for r in recs if r.event == "arrive") == 4
    assert sum(r.n for r in recs if r.event in ("first_token", "token")) == 8 + 4


def _feed_all(data: bytes, split: list[int]) -> list[RequestRecord]:
    out: list[RequestRecord] = []
    sr = StreamRecorder("x", out.append, 200, True)
    prev = 0
    for i, cut in enumerate([*split, len(data)]):
        sr.feed(data[prev:cut], float(i))
        prev = cut
    sr.finish(99.0)
    return out


def test_recorder_tolerates_any_split():
    events = [d for _, d, _ in SCRIPTS["usage"]]
    stream = b"".join(events) + b": keepalive comment\n\n"
    # one read per event: one record per content chunk, with its token count
    per_event = _feed_all(stream, list(itertools.accumulate(len(e) for e in events))[:-1])
    assert [(r.event, r.n) for r in per_event] == [
        ("first_token", 1), ("token", 2), ("token", 1), ("finish", None)]
    # chunks that arrive in one read share its timestamp and become one record (n summed)
    whole = _feed_all(stream, [])
    assert [(r.event, r.n, r.t) for r in whole] == [("first_token", 4, 0.0), ("finish", None, 0.0)]
    # any split, LF or CRLF: nothing lost or double-counted, each token stamped by the read completing it
    for data in (stream, stream.replace(b"\n", b"\r\n")):
        for cut in range(1, len(data)):
            got = _feed_all(data, [cut])
            toks = [r for r in got if r.event in ("first_token", "token")]
            assert sum(r.n for r in toks) == 4, cut
            assert [r.event for r in got] == ["first_token"] + ["token"] * (len(toks) - 1) + ["finish"], cut
            assert [r.t for r in toks] == sorted({r.t for r in toks}), cut  # at most one record per read
            assert set(r.t for r in toks) <= {0.0, 1.0}, cut


def test_recorder_midstream_error_and_multi_token_chunks():
    out: list[RequestRecord] = []
    sr = StreamRecorder("x", out.append, 200, True)
    sr.feed(sse({"choices": [{"index": 0, "text": "ab", "token_ids": [5, 6], "finish_reason": None}]}), 1.0)
    sr.feed(sse({"choices": [{"index": 0, "text": "c", "logprobs": {"tokens": ["c", "d", "e"]}}]}), 2.0)
    sr.feed(sse({"error": {"message": PROMPT_MARKER, "type": "InternalServerError", "code": 500}}), 3.0)
    sr.feed(b"data: [DONE]\n\n", 4.0)
    assert [(r.event, r.n, r.t) for r in out[:2]] == [("first_token", 2, 1.0), ("token", 3, 2.0)]
    assert out[2].event == "error" and out[2].error == "InternalServerError" and out[2].status == 500
    assert len(out) == 3 and PROMPT_MARKER not in repr(out)


_texts = hs.lists(hs.sampled_from(["a", " ", '"', "\\", ":", "{", "}", "é", "\n", "null", '"text":"',
                                   '"finish_reason":"stop"', '"usage"', '"index"']), max_size=5).map("".join)


@settings(max_examples=300, deadline=None)
@given(
    chat=hs.booleans(), text=_texts, finish=hs.sampled_from([None, "stop", "length"]),
    logprobs=hs.sampled_from([None, "none", "list"]), choices=hs.integers(1, 2), spaced=hs.booleans(),
    role=hs.booleans(), usage=hs.sampled_from([None, 1, 3]),
)
def test_fast_path_counts_like_the_full_parser(chat, text, finish, logprobs, choices, spaced, role, usage):
    """The no-parse fast path for plain chunks must agree with the JSON parser on every chunk."""
    def one(i: int) -> dict[str, Any]:
        c: dict[str, Any] = {"index": i, "finish_reason": finish}
        if chat:
            c["delta"] = {"role": "assistant", "content": text} if role else {"content": text}
        else:
            c["text"] = text
        if logprobs == "none":
            c["logprobs"] = None
        elif logprobs == "list":
            c["logprobs"] = {"tokens": ["a", "b"]} if not chat else {"content": [{"token": "a"}, {"token": "b"}]}
        return c
    obj: dict[str, Any] = {"id": "x", "choices": [one(i) for i in range(choices)]}
    if usage is not None:
        obj["usage"] = {"completion_tokens": usage}
    data = json.dumps(obj, separators=(", ", ": ") if spaced else (",", ":"), ensure_ascii=spaced).encode()

    def records(fast: bool) -> list[tuple[str, int | None]]:
        out: list[RequestRecord] = []
        sr = StreamRecorder("x", out.append, 200, True)
        saved = sse_mod._plain_token_chunk
        if not fast:
            sse_mod._plain_token_chunk = lambda d: None
        try:
            sr.feed(b"data: " + data + b"\n\n", 1.0)
        finally:
            sse_mod._plain_token_chunk = saved
        return [(r.event, r.n) for r in out]

    assert records(True) == records(False)
