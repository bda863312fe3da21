"""The capture's HTTP/1.1 parser (kvtop/sources/capture/http.py) against a reference, h11.

The capture parses untrusted bytes by hand because no library resynchronises after a lost segment.
These tests prove the hand-written parser against h11 (the sans-I/O HTTP/1.1 parser under httpx)
on the same byte streams (docs/capture.md, "What the parser is proven against"):

- agreement wherever h11 can speak: seeded well-formed conversations (Content-Length and chunked
  bodies in both directions, chunk extensions and trailers, SSE streams, JSON and error bodies,
  HEAD, 204/304, 100 Continue, a body delimited by the close, header-name case and spacing,
  keep-alive and pipelining) give the same requests (id, body) and responses (id, status, body) in
  the same order, whether the bytes arrive in one piece, split at every byte boundary or in random
  segments; and the records the capture emits equal those of the proxy's own recorder fed h11's
  decoded bodies;
- resynchronisation where h11 cannot: a segment lost inside a body leaves every later event of that
  stream and every later exchange on the connection exactly as without the loss (h11, fed the same
  bytes, misframes or raises);
- a fuzz run of the parser alone (hypothesis): arbitrary and mutated byte streams, split anywhere,
  with holes and closes, never raise and never hold more than the parser's fixed caps.
"""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass, field

import h11
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtop.model.records import RequestRecord
from kvtop.sources.capture import http as cap
from kvtop.sources.capture.http import HEAD_CAP, PROMPT_BODY_CAP, RESYNC_CAP, CaptureStats, HttpConnection
from kvtop.sources.sse import StreamRecorder, prompt_tokens_from_request

T = 1.0  # one time for every byte: records from differently split streams compare equal


# ---- seeded well-formed conversations ---------------------------------------------------------------
@dataclass
class Exchange:
    rid: str
    method: bytes
    path: bytes
    req_body: bytes  # decoded
    req_wire: bytes
    status: int
    resp_body: bytes  # decoded ("" for HEAD / 204 / 304)
    resp_wire: bytes
    chunks: list[tuple[int, bytes]] = field(default_factory=list)  # (offset in resp_wire, payload) if chunked
    closes: bool = False  # the response body ends with the connection

    @property
    def recorded(self) -> bool:
        return self.method == b"POST" and self.path in (b"/v1/completions", b"/v1/chat/completions")


def _name(rnd: random.Random, name: str) -> bytes:
    return rnd.choice((name, name.lower(), name.upper())).encode()


def _header(rnd: random.Random, name: str, value: str) -> bytes:
    return _name(rnd, name) + rnd.choice((b": ", b":", b":  ")) + value.encode() + rnd.choice((b"", b" ")) + b"\r\n"


def _chunked(rnd: random.Random, payloads: list[bytes], base: int) -> tuple[bytes, list[tuple[int, bytes]]]:
    """Chunked framing of ``payloads`` (one chunk each); offsets are where each chunk's size line starts."""
    out = bytearray()
    where = []
    for p in payloads:
        where.append((base + len(out), p))
        size = f"{len(p):x}"
        size = rnd.choice((size, size.upper(), "00" + size))
        ext = rnd.choice(("", "", ";x=1", ";name"))
        out += f"{size}{ext}\r\n".encode() + p + b"\r\n"
    out += b"0\r\n"
    if rnd.random() < 0.2:
        out += b"X-Trailer: done\r\n"
    out += b"\r\n"
    return bytes(out), where


def _split(rnd: random.Random, data: bytes) -> list[bytes]:
    """SSE bodies as servers write them: an event per chunk, or events cut across chunks."""
    if rnd.random() < 0.6:
        return [data]
    cuts = sorted(rnd.sample(range(1, len(data)), min(len(data) - 1, rnd.randint(1, 6))))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]


def _event(rnd: random.Random, k: int, chat: bool) -> bytes:
    if chat:
        d = {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": f"t{k}"}}]}
    else:
        d = {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": f"t{k}"}]}
    return b"data: " + json.dumps(d).encode() + rnd.choice((b"\n\n", b"\r\n\r\n"))


def make_exchange(rnd: random.Random, i: int, last: bool) -> Exchange:
    rid = f"req-{i}"
    kind = rnd.choices(("post", "get", "head"), (8, 1, 1))[0]
    chat = rnd.random() < 0.5
    path = b"/v1/chat/completions" if chat else b"/v1/completions"
    method = b"POST"
    req_body = b""
    if kind == "get":
        method, path = b"GET", rnd.choice((b"/metrics", b"/health", b"/v1/models"))
    elif kind == "head":
        method, path = b"HEAD", b"/v1/models"
    else:
        prompt = list(range(rnd.randint(1, 300)))
        req_body = json.dumps({"model": "m", "prompt": prompt, "stream": True, "max_tokens": 8}).encode()
    head = method + b" " + path + rnd.choice((b"", b"?x=1")) + b" HTTP/1.1\r\n" + _header(rnd, "Host", "engine:8000")
    head += _header(rnd, "X-Request-Id", rid)
    if method == b"POST":
        head += _header(rnd, "Content-Type", "application/json")
        if rnd.random() < 0.3:
            wire, _ = _chunked(rnd, _split(rnd, req_body), 0)
            req_wire = head + _header(rnd, "Transfer-Encoding", rnd.choice(("chunked", "Chunked"))) + b"\r\n" + wire
        else:
            req_wire = head + _header(rnd, "Content-Length", str(len(req_body))) + b"\r\n" + req_body
    else:
        req_wire = head + b"\r\n"

    chunks: list[tuple[int, bytes]] = []
    closes = False
    pre = b"HTTP/1.1 100 Continue\r\n\r\n" if method == b"POST" and rnd.random() < 0.1 else b""
    r = rnd.random()
    if method == b"HEAD":
        status, body = 200, b""
        resp = pre + b"HTTP/1.1 200 OK\r\n" + _header(rnd, "Content-Length", "1234") + b"\r\n"
    elif method == b"GET" and r < 0.3:
        status, body = rnd.choice((204, 304)), b""
        resp = pre + f"HTTP/1.1 {status} No Content\r\n".encode() + _header(rnd, "Date", "today") + b"\r\n"
    elif method == b"POST" and r < 0.15:
        status = rnd.choice((400, 429, 500))
        body = json.dumps({"error": {"message": "no", "type": "BadRequestError", "code": status}}).encode()
        resp = (pre + f"HTTP/1.1 {status} Error\r\n".encode() + _header(rnd, "Content-Type", "application/json")
                + _header(rnd, "Content-Length", str(len(body))) + b"\r\n" + body)
    elif method == b"POST" and r < 0.3:
        status = 200
        body = json.dumps({"id": "c", "choices": [{"text": "hello", "finish_reason": "stop"}],
                           "usage": {"prompt_tokens": 3, "completion_tokens": 1}}).encode()
        resp = (pre + b"HTTP/1.1 200 OK\r\n" + _header(rnd, "Content-Type", "application/json")
                + _header(rnd, "Content-Length", str(len(body))) + b"\r\n" + body)
    elif method == b"POST" and last and r < 0.4:  # no length, no chunking: the body ends with the connection
        status, closes = 200, True
        body = b"".join(_event(rnd, k, chat) for k in range(rnd.randint(1, 5))) + b"data: [DONE]\n\n"
        resp = (pre + b"HTTP/1.1 200 OK\r\n" + _header(rnd, "Content-Type", "text/event-stream")
                + _header(rnd, "Connection", "close") + b"\r\n" + body)
    elif method == b"POST":
        status = 200
        events = [_event(rnd, k, chat) for k in range(rnd.randint(1, 12))] + [b"data: [DONE]\n\n"]
        body = b"".join(events)
        head = (pre + b"HTTP/1.1 200 OK\r\n" + _header(rnd, "Content-Type", "text/event-stream; charset=utf-8")
                + _header(rnd, "Cache-Control", "no-cache") + _header(rnd, "Transfer-Encoding", "chunked") + b"\r\n")
        payloads = events if rnd.random() < 0.7 else _split(rnd, body)
        wire, chunks = _chunked(rnd, payloads, len(head))
        resp = head + wire
    else:
        status = 200
        body = b"# HELP x\nx 1\n"
        resp = pre + b"HTTP/1.1 200 OK\r\n" + _header(rnd, "Content-Length", str(len(body))) + b"\r\n" + body
    return Exchange(rid, method, path, req_body, req_wire, status, body, resp, chunks, closes)


def conversation(seed: int, n: int | None = None) -> list[Exchange]:
    rnd = random.Random(seed)
    n = n or rnd.randint(1, 5)
    return [make_exchange(rnd, i, i == n - 1) for i in range(n)]


def _closes(conv: list[Exchange]) -> bool:
    return conv[-1].closes


# ---- the reference: h11 ---------------------------------------------------------------------------
def h11_requests(data: bytes) -> list[tuple[str, bytes]]:
    """(X-Request-Id, decoded body) of each request in a client byte stream, as h11 reads them."""
    srv = h11.Connection(h11.SERVER)
    srv.receive_data(data)
    srv.receive_data(b"")
    out: list[tuple[str, bytes]] = []
    body = b""
    rid = ""
    while True:
        ev = srv.next_event()
        if ev is h11.NEED_DATA or isinstance(ev, h11.ConnectionClosed):
            return out
        if ev is h11.PAUSED:
            srv.send(h11.Response(status_code=200, headers=[("Content-Length", "0")]))
            srv.send(h11.EndOfMessage())
            srv.start_next_cycle()
        elif isinstance(ev, h11.Request):
            rid, body = dict(ev.headers)[b"x-request-id"].decode(), b""
        elif isinstance(ev, h11.Data):
            body += ev.data
        elif isinstance(ev, h11.EndOfMessage):
            out.append((rid, body))


def h11_responses(conv: list[Exchange], data: bytes) -> list[tuple[str, int, bytes]]:
    """(request id, status, decoded body) of each response in a server byte stream, as h11 reads them
    (h11 must be told each request first: a HEAD's response has a length but no body)."""
    cli = h11.Connection(h11.CLIENT)
    cli.receive_data(data)
    cli.receive_data(b"")
    out: list[tuple[str, int, bytes]] = []
    for ex in conv:
        cli.send(h11.Request(method=ex.method, target=ex.path, headers=[("Host", "engine")]))
        cli.send(h11.EndOfMessage())
        status, body = 0, b""
        while True:
            ev = cli.next_event()
            if isinstance(ev, h11.Response):
                status = ev.status_code
            elif isinstance(ev, h11.Data):
                body += ev.data
            elif isinstance(ev, h11.EndOfMessage):
                out.append((ex.rid, status, body))
                break
            elif isinstance(ev, h11.InformationalResponse):
                continue
            else:
                return out
        if cli.our_state is h11.MUST_CLOSE or cli.their_state is h11.MUST_CLOSE:
            return out
        cli.start_next_cycle()
    return out


# ---- kvtop's parser, observed ---------------------------------------------------------------------
class Seen:
    """What a fake StreamRecorder sees of each recorded response: status, body bytes, how it ended."""

    def __init__(self) -> None:
        self.responses: dict[str, list] = {}
        self.order: list[str] = []


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> Seen:
    s = Seen()

    class FakeRecorder:
        def __init__(self, rid: str, emit, status: int, sse: bool):
            self.rid, self.ended, self.holes = rid, False, 0
            s.responses[rid] = [status, bytearray(), None]

        def feed(self, chunk: bytes, t: float) -> None:
            s.responses[self.rid][1] += chunk

        def hole(self) -> None:
            self.holes += 1

        def finish(self, t: float) -> None:
            self.ended = True
            s.responses[self.rid][2] = "finish"
            s.order.append(self.rid)

        def cancel(self, t: float, reason: str | None = None) -> None:
            self.ended = True
            s.responses[self.rid][2] = "cancel"

        def error(self, t: float, etype: str, status: int | None = None) -> None:
            self.ended = True
            s.responses[self.rid][2] = etype

    monkeypatch.setattr(cap, "StreamRecorder", FakeRecorder)
    return s


class Observed(HttpConnection):
    """The capture's connection with each finished request's id and kept body noted."""

    def __init__(self) -> None:
        self.records: list[RequestRecord] = []
        super().__init__(self.records.append, CaptureStats())
        self.requests: list[tuple[str, bytes | None]] = []

    def _request_done(self) -> None:
        ex = self._c_ex
        if ex is not None:
            self.requests.append((ex.id, b"".join(ex.body) if ex.body is not None else None))
        super()._request_done()


def segments(data: bytes, cuts: list[int]) -> list[bytes]:
    cuts = sorted({c for c in cuts if 0 < c < len(data)})
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]


def run_kvtop(conv: list[Exchange], client_cuts: list[int], server_cuts: list[int], interleave: bool) -> Observed:
    c = Observed()
    if interleave:  # request, its response, next request (keep-alive)
        for ex in conv:
            for seg in segments(ex.req_wire, client_cuts):
                c.client_data(seg, T)
            for seg in segments(ex.resp_wire, server_cuts):
                c.server_data(seg, T)
    else:  # every request first, then every response (pipelining)
        for seg in segments(b"".join(ex.req_wire for ex in conv), client_cuts):
            c.client_data(seg, T)
        for seg in segments(b"".join(ex.resp_wire for ex in conv), server_cuts):
            c.server_data(seg, T)
    if _closes(conv):
        c.server_closed(T, reset=False)
    return c


def reference(conv: list[Exchange]) -> tuple[list[tuple[str, bytes]], list[tuple[str, int, bytes]]]:
    return (h11_requests(b"".join(ex.req_wire for ex in conv)),
            h11_responses(conv, b"".join(ex.resp_wire for ex in conv)))


def check_agrees(conv: list[Exchange], c: Observed, seen: Seen, ref=None) -> None:
    ref_req, ref_resp = ref or reference(conv)
    assert len(ref_req) == len(ref_resp) == len(conv)  # the generator writes what h11 accepts
    assert c.dead is None, c.dead
    # requests: the same ids in the same order; a recorded request's body byte for byte
    assert [rid for rid, _ in c.requests] == [rid for rid, _ in ref_req]
    for (rid, body), (_, ref_body), ex in zip(c.requests, ref_req, conv, strict=True):
        assert body == (ref_body if ex.recorded else None), rid
    # responses: every recorded one with h11's status and decoded body, finished, in order
    recorded = [(rid, status, body) for (rid, status, body), ex in zip(ref_resp, conv, strict=True) if ex.recorded]
    assert seen.order == [rid for rid, _, _ in recorded]
    for rid, status, body in recorded:
        assert seen.responses[rid] == [status, bytearray(body), "finish"], rid
    assert not c.pending


SEEDS = range(300)


@pytest.mark.parametrize("interleave", [False, True])
def test_agrees_with_h11_on_whole_and_randomly_segmented_streams(seen, interleave):
    rnd = random.Random(int(interleave))
    for seed in SEEDS:
        conv = conversation(seed)
        n_c = sum(len(ex.req_wire) for ex in conv)
        n_s = sum(len(ex.resp_wire) for ex in conv)
        ref = reference(conv)
        for cuts in ([], [], [rnd.randrange(1, 1 << 12) for _ in range(rnd.randint(1, 40))]):
            seen.responses.clear()
            seen.order.clear()
            cc = cuts if cuts else []
            sc = [rnd.randrange(1, n_s) for _ in range(rnd.randint(0, 40))] if cuts else []
            c = run_kvtop(conv, [x % max(n_c, 1) for x in cc], sc, interleave)
            check_agrees(conv, c, seen, ref)


def test_agrees_with_h11_split_at_every_byte_boundary(seen):
    """Every one-cut split of a pipelined conversation (both directions) and every two-byte segmentation."""
    for seed in (1, 3):
        conv = conversation(seed, n=3)
        ref = reference(conv)
        client = b"".join(ex.req_wire for ex in conv)
        server = b"".join(ex.resp_wire for ex in conv)
        for k in range(1, max(len(client), len(server))):
            seen.responses.clear()
            seen.order.clear()
            check_agrees(conv, run_kvtop(conv, [k], [k], interleave=False), seen, ref)
        seen.responses.clear()
        seen.order.clear()
        tiny = list(range(0, max(len(client), len(server)), 2))
        check_agrees(conv, run_kvtop(conv, tiny, tiny, interleave=False), seen, ref)


def reference_records(conv: list[Exchange]) -> list[RequestRecord]:
    """What the capture should emit: an arrive per recorded request (h11's body, the capture's prompt
    reading), then the proxy's own recorder fed h11's decoded response bodies."""
    client = b"".join(ex.req_wire for ex in conv)
    server = b"".join(ex.resp_wire for ex in conv)
    out: list[RequestRecord] = []
    for (rid, body), ex in zip(h11_requests(client), conv, strict=True):
        if ex.recorded:
            out.append(RequestRecord(T, rid, "arrive", prompt_tokens=prompt_tokens_from_request(json.loads(body)),
                                     source="capture"))
    for (rid, status, body), ex in zip(h11_responses(conv, server), conv, strict=True):
        if ex.recorded:
            headers = ex.resp_wire.split(b"\r\n\r\n", 2)
            sse = b"text/event-stream" in (headers[1] if ex.resp_wire.startswith(b"HTTP/1.1 100") else headers[0])
            rec = StreamRecorder(rid, out.append, status, sse)
            rec.feed(body, T)
            rec.finish(T)
    return out


def merged(records: list[RequestRecord]) -> list[RequestRecord]:
    """Token records of one response merged run by run: the recorder writes one record per read (a
    read's tokens share its time), so how the bytes were cut changes the records' count, not their sum."""
    out: list[RequestRecord] = []
    for r in records:
        if r.event == "token" and out and out[-1].id == r.id and out[-1].event in ("first_token", "token"):
            out[-1] = dataclasses.replace(out[-1], n=(out[-1].n or 0) + (r.n or 0))
        elif r.event == "first_token" and out and out[-1].id == r.id and out[-1].event == "first_token":
            out[-1] = dataclasses.replace(out[-1], n=(out[-1].n or 0) + (r.n or 0))
        else:
            out.append(r)
    return out


def test_emitted_records_equal_the_proxy_recorder_on_h11_bodies():
    """The SSE layer too: the capture's records (arrive, first_token, tokens, finish, usage) are those
    the proxy's StreamRecorder writes from h11's decoded bodies, however the bytes were segmented."""
    rnd = random.Random(7)
    for seed in range(150):
        conv = conversation(seed)
        ref = reference_records(conv)
        for cuts in ([], [rnd.randrange(1, 4000) for _ in range(30)]):
            c = run_kvtop(conv, cuts, cuts, interleave=False)
            assert merged(c.records) == merged(ref), seed


# ---- segment loss: kvtop resynchronises where h11 cannot ----------------------------------------
def _lossy_case(rnd: random.Random, seed: int) -> tuple[list[Exchange], int, int, int] | None:
    """A conversation with a hole inside one chunked SSE response body: (conversation, exchange index,
    hole start, hole end) in that response's wire bytes."""
    conv = conversation(seed, n=rnd.randint(2, 4))
    idx = [i for i, ex in enumerate(conv) if ex.chunks and len(ex.chunks) >= 3 and ex.recorded]
    if not idx:
        return None
    i = rnd.choice(idx)
    ex = conv[i]
    first = ex.chunks[0][0]
    last_payload_end = ex.chunks[-1][0]  # keep the last chunk and the terminator: the response must end
    a = rnd.randrange(first, last_payload_end - 1)
    b = rnd.randrange(a + 1, min(last_payload_end, a + 400))
    return conv, i, a, b


def test_a_lost_segment_inside_a_body_loses_nothing_after_it():
    rnd = random.Random(3)
    tried = 0
    h11_failed = 0
    for seed in range(400):
        case = _lossy_case(rnd, seed)
        if case is None:
            continue
        conv, i, a, b = case
        tried += 1
        full = Observed()
        lossy = Observed()
        for c in (full, lossy):
            for ex in conv:
                c.client_data(ex.req_wire, T)
        for j, ex in enumerate(conv):
            full.server_data(ex.resp_wire, T)
            if j != i:
                lossy.server_data(ex.resp_wire, T)
                continue
            lossy.server_data(ex.resp_wire[:a], T)
            lossy.server_hole(b - a, T)
            at_hole = len(lossy.records)
            lossy.server_data(ex.resp_wire[b:], T)
        if _closes(conv):
            full.server_closed(T, reset=False)
            lossy.server_closed(T, reset=False)
        assert lossy.dead is None and not lossy.pending, (seed, lossy.dead)
        rid = conv[i].rid
        # every later exchange on the connection: exactly as without the loss
        later = {ex.rid for ex in conv[i + 1:]}
        assert [r for r in lossy.records if r.id in later] == [r for r in full.records if r.id in later], seed
        # the damaged stream: one resync, every token whose chunk starts after the hole, an incomplete end
        got = [r for r in lossy.records if r.id == rid]
        ref = [r for r in full.records if r.id == rid]
        # the framing resumes at the first chunk past the hole that starts an event (docs/capture.md):
        # every token event from there on must arrive
        resume = next((k for k, (off, p) in enumerate(conv[i].chunks) if off >= b + 2 and p.startswith(b"data:")), None)
        after = 0 if resume is None else sum(p.count(b"data: {") for _, p in conv[i].chunks[resume:])
        streamed = ("first_token", "token", "resync")
        before = [r for r in lossy.records[:at_hole] if r.id == rid and r.event in streamed]
        past = [r for r in lossy.records[at_hole:] if r.id == rid and r.event in streamed]
        assert got[-1].event == "finish" and got[-1].incomplete, seed
        assert sum(r.n or 0 for r in past) >= after, seed
        if before and past:  # the gap across the hole is unknown: never measured as a stall
            assert past[0].event == "resync", seed
        assert sum(r.n or 0 for r in before + past) <= sum(r.n or 0 for r in ref if r.event in streamed), seed
        # h11 on the same bytes: the framing is gone, it raises or reads a different conversation
        server = b"".join(ex.resp_wire for ex in conv[:i]) + conv[i].resp_wire[:a] + conv[i].resp_wire[b:] + b"".join(
            ex.resp_wire for ex in conv[i + 1:])
        try:
            if h11_responses(conv, server) != h11_responses(conv, b"".join(ex.resp_wire for ex in conv)):
                h11_failed += 1
        except h11.RemoteProtocolError:
            h11_failed += 1
    assert tried > 50 and h11_failed == tried


def test_a_hole_inside_a_content_length_body_keeps_the_connection_in_step(seen):
    rnd = random.Random(11)
    tried = 0
    for seed in range(400):
        conv = conversation(seed, n=3)
        idx = [i for i, ex in enumerate(conv) if ex.recorded and not ex.chunks and len(ex.resp_body) > 20
               and b"content-length" in ex.resp_wire.lower()]
        if not idx or _closes(conv):
            continue
        i = rnd.choice(idx)
        body_at = len(conv[i].resp_wire) - len(conv[i].resp_body)
        a = rnd.randrange(body_at, len(conv[i].resp_wire) - 1)
        b = rnd.randrange(a + 1, len(conv[i].resp_wire))  # at least one byte of the body after the hole
        tried += 1
        seen.responses.clear()
        seen.order.clear()
        c = Observed()
        for ex in conv:
            c.client_data(ex.req_wire, T)
        for j, ex in enumerate(conv):
            if j == i:
                c.server_data(ex.resp_wire[:a], T)
                c.server_hole(b - a, T)
                c.server_data(ex.resp_wire[b:], T)
            else:
                c.server_data(ex.resp_wire, T)
        assert c.dead is None
        wire = conv[i].resp_wire
        assert seen.responses[conv[i].rid][1] == wire[body_at:a] + wire[b:]  # all but the lost bytes
        assert seen.order == [ex.rid for ex in conv if ex.recorded]  # every response framed, in order
    assert tried > 30


# ---- the parser alone, fuzzed ------------------------------------------------------------------------
def _bounded(c: HttpConnection) -> None:
    """Every buffer the parser holds stays under its cap, whatever it was fed."""
    assert len(c._c_head) <= HEAD_CAP and len(c._s_head) <= HEAD_CAP
    assert len(c.pending) <= cap.MAX_PENDING
    for body in (c._c_body, c._s_body):
        if body is not None and body.chunked is not None:
            ch = body.chunked
            assert len(ch.line) <= cap.LINE_CAP
            assert ch.resync is None or len(ch.resync) <= RESYNC_CAP
    for ex in c.pending:
        assert ex.body is None or sum(len(p) for p in ex.body) <= PROMPT_BODY_CAP + (64 << 10)


_WELL_FORMED = [conversation(s, n=3) for s in range(40)]

op = st.one_of(
    st.tuples(st.just("c"), st.binary(max_size=300)),
    st.tuples(st.just("s"), st.binary(max_size=300)),
    st.tuples(st.just("ch"), st.integers(1, 5000)),
    st.tuples(st.just("sh"), st.integers(1, 5000)),
    st.tuples(st.just("cc"), st.booleans()),
    st.tuples(st.just("sc"), st.booleans()),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, max_size=30))
def test_fuzz_arbitrary_bytes_never_raise_and_stay_bounded(ops):
    c = HttpConnection(lambda r: None, CaptureStats())
    for kind, arg in ops:
        if kind == "c":
            c.client_data(arg, T)
        elif kind == "s":
            c.server_data(arg, T)
        elif kind == "ch":
            c.client_hole(arg, T)
        elif kind == "sh":
            c.server_hole(arg, T)
        elif kind == "cc":
            c.client_closed(T, arg)
        else:
            c.server_closed(T, arg)
        _bounded(c)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(which=st.integers(0, len(_WELL_FORMED) - 1), seed=st.integers(0, 2**32))
def test_fuzz_mutated_conversations_never_raise_and_stay_bounded(which, seed):
    """Well-formed conversations with bytes flipped, inserted or dropped, cut anywhere, with holes."""
    rnd = random.Random(seed)
    conv = _WELL_FORMED[which]
    client = bytearray(b"".join(ex.req_wire for ex in conv))
    server = bytearray(b"".join(ex.resp_wire for ex in conv))
    for buf in (client, server):
        for _ in range(rnd.randint(0, 6)):
            i = rnd.randrange(len(buf))
            m = rnd.randrange(3)
            if m == 0:
                buf[i] = rnd.randrange(256)
            elif m == 1:
                buf[i:i] = rnd.choice([b"\r\n", b"0\r\n\r\n", b"ffffffff\r\n", b"\r\n\r\n", b"-5\r\n",
                                       b"HTTP/1.1 200 OK\r\n", b"POST / HTTP/1.1\r\n", b"x" * 2000])
            else:
                del buf[i:i + rnd.randint(1, 50)]
    c = HttpConnection(lambda r: None, CaptureStats())
    ci = si = 0
    while ci < len(client) or si < len(server):
        step = rnd.randint(1, 400)
        if ci < len(client) and (si >= len(server) or rnd.random() < 0.5):
            c.client_data(bytes(client[ci:ci + step]), T)
            ci += step
        else:
            if rnd.random() < 0.1:
                c.server_hole(step, T)
            else:
                c.server_data(bytes(server[si:si + step]), T)
            si += step
        _bounded(c)
    c.server_closed(T, rnd.random() < 0.5)
    _bounded(c)


def test_endless_chunk_line_endings_and_trailers_are_not_kept():
    """A chunk's data followed by bytes that never end the line (or an endless trailer line): the
    decoder holds none of them (it used to append every byte to its line buffer)."""
    for tail in (b"3\r\nabc" + b"x" * 200_000, b"3\r\nabc\r\n0\r\nX-T: " + b"y" * 200_000):
        c = HttpConnection(lambda r: None, CaptureStats())
        c.client_data(b"POST /v1/completions HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n", T)
        for k in range(0, len(tail), 1000):
            c.client_data(tail[k:k + 1000], T)
            _bounded(c)


def test_pipelined_requests_without_responses_are_bounded():
    """A client that pipelines requests the server never answers (or whose answers are lost) cannot
    grow the pending queue without bound: past MAX_PENDING the connection is given up as lost."""
    c = HttpConnection(lambda r: None, CaptureStats())
    req = b"GET /health HTTP/1.1\r\nHost: h\r\n\r\n"
    for _ in range(cap.MAX_PENDING + 10):
        c.client_data(req, T)
        _bounded(c)
    assert c.dead == "lost" and c.stats.lost_connections == 1


# ---- one test per parser bug the differential test found -----------------------------------------
def test_a_segment_boundary_inside_the_method_or_the_status_line_prefix():
    """"PO" | "ST /v1/..." and "HT" | "TP/1.1 200": a new message's first bytes cut by a segment
    boundary (the previous message ended near the end of a segment) are held, not taken for non-HTTP."""
    for cut_c, cut_s in ((2, 3), (1, 1), (4, 6)):
        conv = conversation(4, n=2)
        c = Observed()
        client = b"".join(ex.req_wire for ex in conv)
        server = b"".join(ex.resp_wire for ex in conv)
        second_c = len(conv[0].req_wire) + cut_c
        second_s = len(conv[0].resp_wire) + cut_s
        for seg in segments(client, [second_c]):
            c.client_data(seg, T)
        for seg in segments(server, [second_s]):
            c.server_data(seg, T)
        assert c.dead is None and [rid for rid, _ in c.requests] == ["req-0", "req-1"]
        assert not c.pending


def _sse_response(events: list[bytes], ext: bytes = b"", trailer: bytes = b"") -> tuple[bytes, list[int]]:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    body = bytearray(head)
    starts = []
    for e in events:
        starts.append(len(body))
        body += f"{len(e):x}".encode() + ext + b"\r\n" + e + b"\r\n"
    body += b"0\r\n" + trailer + b"\r\n"
    return bytes(body), starts


def _tokens_after_hole(resp: bytes, a: int, b: int) -> tuple[HttpConnection, list[RequestRecord]]:
    out: list[RequestRecord] = []
    c = HttpConnection(out.append, CaptureStats())
    c.client_data(b"POST /v1/completions HTTP/1.1\r\nHost: h\r\nX-Request-Id: r\r\nContent-Length: 2\r\n\r\n{}", T)
    c.server_data(resp[:a], T)
    c.server_hole(b - a, T)
    c.server_data(resp[b:], T)
    return c, out


EV = [b'data: {"choices": [{"index": 0, "text": "t%d"}]}\n\n' % k for k in range(8)]


def test_resync_finds_a_chunk_boundary_with_an_extension_and_a_last_chunk_with_trailers():
    for ext, trailer in ((b";x=1", b""), (b"", b"X-Trailer: done\r\n"), (b";name", b"Server-Timing: 1\r\n")):
        resp, starts = _sse_response(EV + [b"data: [DONE]\n\n"], ext, trailer)
        c, out = _tokens_after_hole(resp, starts[1] + 10, starts[3] + 5)  # from inside event 1 into event 3
        assert c.dead is None and not c.pending  # the response ended: the connection stays in step
        assert sum(r.n or 0 for r in out if r.event in ("first_token", "token", "resync")) >= 8 - 4
        assert out[-1].event == "finish" and out[-1].incomplete


def test_a_hole_ending_inside_a_size_line_is_not_read_as_a_smaller_chunk():
    """The hole swallows the "6" of "6b": "b\\r\\n" is a size line of the wrong size; checked against
    where its chunk must end, it is passed over and the next real boundary is taken (it killed the
    connection as not HTTP)."""
    resp, starts = _sse_response(EV + [b"data: [DONE]\n\n"])
    c, out = _tokens_after_hole(resp, starts[1] + 10, starts[3] + 1)
    assert c.dead is None and not c.pending
    assert sum(r.n or 0 for r in out if r.event in ("first_token", "token", "resync")) >= 8 - 4


def test_chunk_size_lines_are_hex_digits_only():
    """int(x, 16) alone reads "-5", "+5", "0x5" and "5_0"; a negative size walked the decoder backwards."""
    for size in (b"-5", b"+5", b"0x5", b"5_0", b" ", b""):
        c = HttpConnection(lambda r: None, CaptureStats())
        c.client_data(b"POST /v1/completions HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n" + size
                      + b"\r\nhello\r\n0\r\n\r\n", T)
        assert c.dead == "not_http", size
