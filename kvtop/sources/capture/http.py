"""Incremental HTTP/1.1 parsing of one captured TCP connection into request records.

The TCP layer (``tcp.py``) hands each direction's bytes over in order, with the kernel time of the
packet that carried them, and says where bytes were lost (``hole``) and when a side closed. Only
what a record needs is read: method, path, status, ``X-Request-Id``, framing headers, the SSE
events (through the same ``StreamRecorder`` as the proxy) and, for a small request body, a token-id
prompt's length. Text, headers and bodies are never kept beyond the bounded parse buffers.
"""

from __future__ import annotations

import json
import re
import uuid
from collections import deque
from dataclasses import dataclass

from kvtop.model.records import RequestRecord
from kvtop.sources.sse import RECORDED_PATHS, Emit, StreamRecorder, prompt_tokens_from_request

HEAD_CAP = 64 << 10  # a request or response head larger than this is not an API call we parse
PROMPT_BODY_CAP = 1 << 20  # request bodies up to this size are parsed for a token-id prompt length
RESYNC_CAP = 64 << 10  # bytes searched for the next chunk boundary after a hole in chunked framing
LINE_CAP = 1024  # a chunk-size line longer than this is not chunked framing; trailer lines are cut to it
# Requests waiting for their response on one connection. API clients do not pipeline deeply; a
# client whose requests are never answered (or whose answers we lost) must not grow this queue.
MAX_PENDING = 1024

_METHODS = (b"POST ", b"GET ", b"PUT ", b"DELETE ", b"HEAD ", b"OPTIONS ", b"PATCH ")
_METHOD_MAX = max(len(m) for m in _METHODS)
_STATUS_PREFIX = b"HTTP/1."
_SAFE_ID = re.compile(rb"^[A-Za-z0-9_.:\-]{1,128}$")
# After a hole that lost a chunk-size line: the next chunk that starts an SSE event (or the last chunk).
# A chunk extension (";name=value", which the size-line reader skips) must not hide a boundary, and
# the last chunk may carry trailers (a "Name:" line) or an event start with another field ("event:").
_CHUNK_START = re.compile(rb"\r\n([0-9a-fA-F]{1,8})(?:;[^\r\n]{0,256})?\r\n(?=data:|\r\n|[A-Za-z0-9-]{1,64}:)")
# chunk-size = 1*HEXDIG (RFC 9112 §7.1): int(x, 16) alone also takes "-5", "+5", "0x5" and "5_0"
_CHUNK_SIZE = re.compile(rb"[0-9a-fA-F]{1,16}")
_CHUNK_HEAD = re.compile(rb"([0-9a-fA-F]{1,16})\r\n")


@dataclass
class CaptureStats:
    """Counters a capture keeps; shown by the commands and the console."""

    packets: int = 0
    bytes: int = 0
    kernel_drops: int = 0
    connections: int = 0
    requests: int = 0
    holes: int = 0
    hole_bytes: int = 0
    retransmits: int = 0
    # a packet seen again within COPY_S on a second interface (a container's veth and its bridge):
    # the same segment twice, not a retransmission
    copies: int = 0
    out_of_order: int = 0
    joined_mid_stream: int = 0
    lost_connections: int = 0  # a hole we could not resynchronise after: the rest is not observed
    tls_connections: int = 0
    http2_connections: int = 0
    other_connections: int = 0  # not HTTP/1.x at all
    # responses whose body is compressed (Content-Encoding: gzip behind a proxy that compresses
    # event streams): their tokens cannot be read, so they end incomplete with no token counted
    encoded_responses: int = 0


class _Exchange:
    """One request and (once it starts) its response."""

    __slots__ = ("id", "recorded", "t_arrive", "head_req", "rec", "prompt_tokens", "body", "body_lost", "arrived")

    def __init__(self, rid: str, recorded: bool, t: float, head_req: bool):
        self.id = rid
        self.recorded = recorded
        self.t_arrive = t
        self.head_req = head_req
        self.rec: StreamRecorder | None = None
        self.prompt_tokens: int | None = None
        self.body: list[bytes] | None = [] if recorded else None
        self.body_lost = False
        self.arrived = False  # its arrive record was emitted (the request body is complete)


class _Chunked:
    """Chunked transfer decoding, resumable at any byte (a size line may be split across packets)."""

    __slots__ = ("left", "state", "line", "resync")

    SIZE, DATA, DATA_END, TRAILER, DONE = range(5)

    def __init__(self) -> None:
        self.left = 0
        self.state = self.SIZE
        self.line = b""
        self.resync: bytes | None = None  # bytes held while looking for a chunk boundary after a hole

    def feed(self, data: bytes, out: list[bytes]) -> int:
        """Append the payload bytes of ``data`` to ``out``; return how many bytes of ``data`` were
        consumed (less than ``len(data)`` only once the last chunk and trailers are done)."""
        if self.resync is not None:
            buf = self.resync + data
            m = _boundary(buf)
            # a status line before any boundary: the next response on the connection began, so this
            # body ended in the lost bytes (its last chunk among them). Searching on, a boundary in
            # the next response's body had given its tokens, and each later one's, to the request
            # before it. Chunked SSE bytes never hold CRLF + "HTTP/1." (JSON escapes line breaks).
            st = buf.find(b"\r\n" + _STATUS_PREFIX)
            if st >= 0 and (m is None or (m if isinstance(m, int) else m.start()) > st):
                self.resync = None
                self.state = self.DONE
                return max(0, st + 2 - (len(buf) - len(data)))
            if m is None:
                self.resync = buf[-RESYNC_CAP:]
                return len(data)
            if isinstance(m, int):  # a candidate whose chunk end is not here yet: hold from it on
                self.resync = buf[m:]
                return len(data)
            self.resync = None
            self.state = self.SIZE
            self.line = b""
            tail = buf[m.start() + 2:]  # from the size line on (it may begin in the held bytes)
            return max(0, len(data) - len(tail) + self._feed(tail, out))
        return self._feed(data, out)

    def _feed(self, data: bytes, out: list[bytes]) -> int:
        n = len(data)
        if self.state == self.SIZE and not self.line:
            # the streaming case: a packet that is exactly one whole chunk (one SSE event), read
            # without the state machine; anything else (extensions, a last chunk, a split) goes on below
            m = _CHUNK_HEAD.match(data)
            if m is not None:
                start = m.end()
                size = int(m.group(1), 16)
                if size and start + size + 2 == n and data.endswith(b"\r\n"):
                    out.append(data[start:n - 2])
                    return n
        i = 0
        while i < n:
            st = self.state
            if st == self.DATA:
                take = min(self.left, n - i)
                out.append(data[i:i + take])
                i += take
                self.left -= take
                if self.left == 0:
                    self.state = self.DATA_END
                    self.line = b""
            elif st == self.SIZE:
                j = data.find(b"\n", i)
                if j < 0:
                    self.line += data[i:]
                    if len(self.line) > LINE_CAP:
                        self.line = b""
                        raise ValueError("chunk-size line too long")
                    return n
                line = self.line + data[i:j]
                self.line = b""
                i = j + 1
                digits = line.split(b";", 1)[0].strip()
                if not _CHUNK_SIZE.fullmatch(digits):
                    raise ValueError("not a chunk-size line")
                size = int(digits, 16)
                if size == 0:
                    self.state = self.TRAILER
                else:
                    self.left = size
                    self.state = self.DATA
            elif st == self.DATA_END:
                j = data.find(b"\n", i)
                if j < 0:
                    return n  # nothing of the line after a chunk's data is needed: keep none of it
                self.line = b""
                i = j + 1
                self.state = self.SIZE
            elif st == self.TRAILER:
                j = data.find(b"\n", i)
                if j < 0:
                    # only whether the line is blank matters: its first bytes tell
                    self.line = (self.line + data[i:])[:LINE_CAP]
                    return n
                line = self.line + data[i:j]
                self.line = b""
                i = j + 1
                if not line.strip():
                    self.state = self.DONE
                    return i
            else:
                return i
        return n

    def hole(self, lost: int) -> bool:
        """``lost`` bytes are missing here. True when the framing survives (the hole was inside one
        chunk's data); otherwise the decoder searches the following bytes for a chunk boundary."""
        if self.state == self.DATA and lost < self.left:
            self.left -= lost
            return True
        self.resync = b"\r\n"  # lets a size line at the very start of the next bytes match
        return False

    @property
    def done(self) -> bool:
        return self.state == self.DONE


def _boundary(buf: bytes) -> re.Match[bytes] | int | None:
    """The first chunk boundary in ``buf`` whose chunk really ends where its size says (a CRLF there);
    the offset of a candidate whose end is not in ``buf`` yet; None when there is none.

    A hole that ends inside a size line leaves its tail ("6b" cut to "b"), which reads as a size line
    of the wrong size: checked against where that chunk must end, it is passed over."""
    pos = 0
    while True:
        m = _CHUNK_START.search(buf, pos)
        if m is None:
            return None
        size = int(m.group(1), 16)
        end = m.end() + size
        if size == 0 or size > RESYNC_CAP // 2:  # the last chunk, or one too long to wait for
            return m
        if len(buf) < end + 2:
            return m.start()
        if buf[end:end + 2] == b"\r\n":
            return m
        pos = m.start() + 1


class _Body:
    """How the current message body ends: chunked, a Content-Length, or the connection's close."""

    __slots__ = ("chunked", "left", "to_close")

    def __init__(self, chunked: _Chunked | None, left: int, to_close: bool = False):
        self.chunked = chunked
        self.left = left
        self.to_close = to_close


def _head_fields(head: bytes) -> tuple[bytes, dict[bytes, bytes]]:
    """The start line and the few headers we read (lower-cased names); every other header is dropped."""
    lines = head.split(b"\r\n") if b"\r\n" in head else head.split(b"\n")
    want = {}
    for line in lines[1:]:
        k, sep, v = line.partition(b":")
        if not sep:
            continue
        k = k.strip().lower()
        if k in (b"content-length", b"transfer-encoding", b"x-request-id", b"content-type", b"connection",
                 b"content-encoding"):
            want[k] = v.strip()
    return lines[0], want


def _framing(h: dict[bytes, bytes]) -> _Body | None:
    te = h.get(b"transfer-encoding", b"").lower()
    if b"chunked" in te:
        return _Body(_Chunked(), 0)
    cl = h.get(b"content-length")
    if cl is not None:
        try:
            n = int(cl)
        except ValueError:
            return None
        return _Body(None, max(0, n))
    return _Body(None, 0)


class HttpConnection:
    """Both directions of one HTTP/1.1 connection; pairs responses with requests in order
    (keep-alive and pipelining)."""

    def __init__(self, emit: Emit, stats: CaptureStats, cls: str | None = None, engine: str | None = None):
        self.emit = emit
        self.stats = stats
        self.cls = cls
        self.engine = engine  # the server's host:port, written on each arrive
        self.dead: str | None = None  # why we stopped parsing: tls, http2, not_http, lost
        self.pending: deque[_Exchange] = deque()  # requests (oldest first) whose response is not finished
        self._c_head = b""
        self._c_body: _Body | None = None
        self._c_ex: _Exchange | None = None
        self._c_started = False
        self._s_head = b""
        self._s_body: _Body | None = None
        self._s_ex: _Exchange | None = None

    # -- client -> server ---------------------------------------------------------------------
    def client_data(self, data: bytes, t: float) -> None:
        if self.dead:
            return
        if not self._c_started:
            self._c_started = True
            if data[:1] == b"\x16" and data[1:2] == b"\x03":
                self._die("tls")
                return
            if data.startswith(b"PRI * HTTP/2"):
                self._die("http2")
                return
        while data and not self.dead:
            if self._c_body is None:
                data = self._client_head(data, t)
            else:
                data = self._client_body(data, t)

    def _split_head(self, pending: bytes, data: bytes) -> tuple[bytes | None, bytes, bytes]:
        """``data`` added to a message head being read: (the head, the bytes after it, what stays
        pending). The head is None until its blank line arrives; a head past HEAD_CAP is no HTTP."""
        buf = pending + data
        end = buf.find(b"\r\n\r\n")
        if end >= 0:
            return buf[:end], buf[end + 4:], b""
        if len(buf) > HEAD_CAP:
            self._die("not_http")
            return None, b"", b""
        return None, b"", buf

    def _client_head(self, data: bytes, t: float) -> bytes:
        if not self._c_head:
            data = data.lstrip(b"\r\n")  # empty lines before a request line are ignored (RFC 9112 §2.2)
            if not data:
                return b""
        if len(self._c_head) < _METHOD_MAX:
            lead = self._c_head + data
            if not lead.startswith(_METHODS):
                # a segment boundary may cut the method itself ("PO" | "ST /v1/..."): wait for the rest
                if len(lead) < _METHOD_MAX and any(m.startswith(lead) for m in _METHODS):
                    self._c_head = lead
                    return b""
                self._die("not_http")
                return b""
        head, rest, self._c_head = self._split_head(self._c_head, data)
        if head is None:
            return b""
        start, h = _head_fields(head)
        parts = start.split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            self._die("http2" if start.startswith(b"PRI") else "not_http")
            return b""
        method, target = parts[0], parts[1]
        path = target.split(b"?", 1)[0].decode("latin-1")
        if path.startswith("http://"):  # absolute form
            path = "/" + path.split("/", 3)[-1] if path.count("/") >= 3 else "/"
        recorded = method == b"POST" and path in RECORDED_PATHS
        xid = h.get(b"x-request-id")
        rid = xid.decode() if xid is not None and _SAFE_ID.match(xid) else uuid.uuid4().hex
        ex = _Exchange(rid, recorded, t, method == b"HEAD")
        body = _framing(h)
        if body is None:
            self._die("not_http")
            return b""
        if len(self.pending) >= MAX_PENDING:
            self.lose(t)
            return b""
        self.pending.append(ex)
        self._c_ex = ex
        self._c_body = body
        if body.chunked is None and body.left == 0:
            self._request_done()
        return rest

    def _client_body(self, data: bytes, t: float) -> bytes:
        body = self._c_body
        ex = self._c_ex
        assert body is not None and ex is not None
        if body.chunked is not None:
            out: list[bytes] = []
            try:
                used = body.chunked.feed(data, out)
            except ValueError:
                self._die("not_http")
                return b""
            self._keep_body(ex, out)
            if body.chunked.done:
                self._request_done()
                return data[used:]
            return b""
        take = min(body.left, len(data))
        self._keep_body(ex, [data[:take]])
        body.left -= take
        if body.left == 0:
            self._request_done()
        return data[take:]

    @staticmethod
    def _keep_body(ex: _Exchange, parts: list[bytes]) -> None:
        if ex.body is None:
            return
        ex.body.extend(parts)
        if sum(len(p) for p in ex.body) > PROMPT_BODY_CAP:
            ex.body = None  # too large to be worth parsing: its prompt length stays unknown

    def _request_done(self) -> None:
        ex = self._c_ex
        self._c_body = None
        self._c_ex = None
        if ex is None or not ex.recorded:
            return
        if ex.body and not ex.body_lost:
            try:
                d = json.loads(b"".join(ex.body))
                if isinstance(d, dict):
                    ex.prompt_tokens = prompt_tokens_from_request(d)
            except (ValueError, UnicodeDecodeError):
                pass
        ex.body = None
        ex.arrived = True
        self.stats.requests += 1
        self.emit(RequestRecord(ex.t_arrive, ex.id, "arrive", prompt_tokens=ex.prompt_tokens, cls=self.cls,
                                source="capture", engine=self.engine))

    def client_hole(self, lost: int, t: float) -> None:
        body = self._c_body
        if self.dead:
            return
        if body is not None and body.chunked is None and lost <= body.left:
            body.left -= lost  # a hole inside a request body: only its prompt length is lost
            if self._c_ex is not None:
                self._c_ex.body_lost = True
            if body.left == 0:  # ... up to its very end: the request is complete all the same
                self._request_done()
            return
        if body is not None and body.chunked is not None and body.chunked.hole(lost):
            if self._c_ex is not None:
                self._c_ex.body_lost = True
            return
        self.lose(t)

    # -- server -> client ---------------------------------------------------------------------
    def server_data(self, data: bytes, t: float) -> None:
        body = self._s_body
        if body is not None and body.chunked is not None and not self.dead:
            ch = body.chunked
            if ch.state == _Chunked.SIZE and not ch.line and ch.resync is None:
                # the streaming case: a segment that is exactly one whole chunk (one SSE event), as
                # _server_body and _Chunked would take it, without their calls
                m = _CHUNK_HEAD.match(data)
                if m is not None:
                    start = m.end()
                    n = len(data)
                    size = int(m.group(1), 16)
                    if size and start + size + 2 == n and data.endswith(b"\r\n"):
                        ex = self._s_ex
                        if ex is not None and ex.rec is not None:
                            ex.rec.feed(data[start:n - 2], t)
                        return
        while data and not self.dead:
            if self._s_body is None:
                data = self._server_head(data, t)
            else:
                data = self._server_body(data, t)

    def _server_head(self, data: bytes, t: float) -> bytes:
        if len(self._s_head) < len(_STATUS_PREFIX) and not (self._s_head + data).startswith(_STATUS_PREFIX):
            lead = self._s_head + data
            if _STATUS_PREFIX.startswith(lead):  # a segment boundary inside "HTTP/1.": wait for the rest
                self._s_head = lead
                return b""
            data = lead
            if data[:1] == b"\x16":
                self._die("tls")
            elif data.startswith(b"\x00\x00") or data[3:4] == b"\x04":  # an HTTP/2 SETTINGS frame
                self._die("http2")
            else:
                self._die("not_http")
            return b""
        head, rest, self._s_head = self._split_head(self._s_head, data)
        if head is None:
            return b""
        start, h = _head_fields(head)
        try:
            status = int(start.split(b" ", 2)[1])
        except (IndexError, ValueError):
            self._die("not_http")
            return b""
        if status == 101:
            self._die("not_http")  # upgraded (websocket, h2c): no longer HTTP/1.1
            return b""
        if 100 <= status < 200:
            return rest  # 100 Continue: the real response follows
        ex = self.pending[0] if self.pending else None
        if ex is None:
            self._die("lost")  # a response with no request: we are out of step
            return b""
        if ex.head_req or status in (204, 304):
            body: _Body | None = _Body(None, 0)
        else:
            body = _framing(h)
            if body is None:
                self._die("not_http")
                return b""
            if body.chunked is None and b"content-length" not in h:
                body.to_close = True
        assert body is not None
        if ex.recorded:
            ctype = h.get(b"content-type", b"")
            ex.rec = StreamRecorder(ex.id, self.emit, status, ctype.lower().startswith(b"text/event-stream"))
            if h.get(b"content-encoding", b"identity").lower() not in (b"identity", b""):
                self.stats.encoded_responses += 1
                ex.rec.unreadable()
        self._s_ex = ex
        self._s_body = body
        if body.chunked is None and body.left == 0 and not body.to_close:
            self._response_done(t)
        return rest

    def _server_body(self, data: bytes, t: float) -> bytes:
        body = self._s_body
        ex = self._s_ex
        assert body is not None and ex is not None
        rec = ex.rec
        if body.chunked is not None:
            out: list[bytes] = []
            try:
                used = body.chunked.feed(data, out)
            except ValueError:
                self._die("not_http")
                return b""
            if rec is not None and out:
                rec.feed(out[0] if len(out) == 1 else b"".join(out), t)
            if body.chunked.done:
                self._response_done(t)
                return data[used:]
            return b""
        if body.to_close:
            if rec is not None:
                rec.feed(data, t)
            return b""
        take = min(body.left, len(data))
        if rec is not None:
            rec.feed(data[:take] if take < len(data) else data, t)
        body.left -= take
        if body.left == 0:
            self._response_done(t)
        return data[take:]

    def _response_done(self, t: float) -> None:
        ex = self._s_ex
        self._s_ex = None
        self._s_body = None
        if ex is None:
            return
        if self.pending and self.pending[0] is ex:
            self.pending.popleft()
        if ex.rec is not None:
            ex.rec.finish(t)

    def server_hole(self, lost: int, t: float) -> None:
        if self.dead:
            return
        body = self._s_body
        ex = self._s_ex
        if body is not None and ex is not None:
            if body.chunked is not None:
                body.chunked.hole(lost)  # framing kept, or recovered at the next chunk boundary
            elif body.to_close or lost <= body.left:
                body.left = max(0, body.left - lost)
            else:
                self.lose(t)
                return
            if ex.rec is not None:
                ex.rec.hole()
            if body.chunked is None and not body.to_close and body.left == 0:
                self._response_done(t)  # the hole ran to the body's end: the framing holds, the end is known
            return
        self.lose(t)

    # -- ends -----------------------------------------------------------------------------------
    def client_closed(self, t: float, reset: bool) -> None:
        """The client sent FIN or RST: every recorded request still waiting for its end is cancelled."""
        if self.dead:
            return
        for ex in self.pending:
            if not ex.recorded:
                continue
            if ex.rec is not None:
                if not ex.rec.ended:
                    ex.rec.cancel(t)
            elif ex.arrived:  # no response yet
                self.emit(RequestRecord(t, ex.id, "cancel"))
        self.pending.clear()
        self._s_ex = None
        self._s_body = None

    def server_closed(self, t: float, reset: bool) -> None:
        if self.dead:
            return
        body = self._s_body
        if body is not None and body.to_close and not reset:
            self._response_done(t)  # a body delimited by the close has ended
        for ex in self.pending:
            if not ex.recorded:
                continue
            if ex.rec is not None:
                if not ex.rec.ended:
                    ex.rec.error(t, "upstream_disconnected")
            elif ex.arrived:
                self.emit(RequestRecord(t, ex.id, "error", error="upstream_disconnected"))
        self.pending.clear()
        self._s_ex = None
        self._s_body = None

    def lose(self, t: float) -> None:
        """A hole we cannot parse across: end what is in flight as incomplete, observe no more."""
        for ex in self.pending:
            if not (ex.recorded and ex.arrived):
                continue
            if ex.rec is not None:
                ex.rec.hole()
                ex.rec.error(t, "capture_lost")
            else:
                self.emit(RequestRecord(t, ex.id, "error", error="capture_lost", incomplete=True))
        self.pending.clear()
        self.stats.lost_connections += 1
        self.dead = "lost"

    def _die(self, why: str) -> None:
        self.dead = why
        self.pending.clear()
        if why == "tls":
            self.stats.tls_connections += 1
        elif why == "http2":
            self.stats.http2_connections += 1
        elif why == "not_http":
            self.stats.other_connections += 1
        elif why == "lost":
            self.stats.lost_connections += 1
