"""Recording reverse proxy for OpenAI-compatible servers (DESIGN §5.1).

Bytes are forwarded to the client as soon as each upstream read returns; recording parses a copy
of the stream on the side and emits ``RequestRecord``s (arrive, first_token, token, finish,
cancel, error) timestamped when the bytes arrived from upstream. Nothing the user wrote or the
model generated is ever recorded, and no header: only counts, ids, status codes and short
machine-readable reason strings.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import uuid
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage
from yarl import URL

from kvtop.model.records import RequestRecord
from kvtop.model.sanitize import redact_url

Emit = Callable[[RequestRecord], None]
Clock = Callable[[], float]



class _ServerLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """aiohttp's server log, minus the traceback for requests its parser refuses.

    A header with control characters (a hostile ``X-Request-Id``) is answered 400 by aiohttp and
    then logged as a full traceback; that is the client's mistake, worth one line at most.
    """

    def __init__(self) -> None:
        super().__init__(logging.getLogger("aiohttp.server"), {})

    def exception(self, msg: object, *args: object, exc_info: object = True, **kw: object) -> None:
        if isinstance(exc_info, BadHttpMessage):
            first = str(exc_info).strip().splitlines()
            self.logger.info("refused a malformed request: %s", first[0] if first else "bad HTTP message")
            return
        self.logger.error(msg, *args, exc_info=exc_info, **kw)  # type: ignore[arg-type]

_SAFE_REQUEST_ID = re.compile(r"[\x20-\x7e]{1,256}")
RECORDED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})

# RFC 9110 §7.6.1 hop-by-hop headers, plus the ones aiohttp must compute itself.
_HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "Proxy-Connection",
        "TE", "Trailer", "Trailers", "Transfer-Encoding", "Upgrade",
    )
)
# Bounded buffers: the recorder must never hold a whole large response in memory.
_SSE_BUFFER_CAP = 1 << 20
_JSON_BODY_CAP = 16 << 20
_ERROR_BODY_CAP = 64 << 10
_REQUEST_BODY_CAP = 256 << 20

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
_SLOW_RE = re.compile(rb'"(?:usage|token_ids|error|tool_calls|function_call|reasoning\w*|refusal)"')
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



def _upstream_url(upstream: str) -> str:
    u = URL(upstream)
    if u.scheme not in ("http", "https") or not u.host:
        raise ValueError(f"upstream must be an http(s) URL, got {upstream!r}")
    return upstream.rstrip("/")

class StreamRecorder:
    """Turns one response's bytes into request records. Shared by the proxy and the probe.

    Feed it every chunk with the time it arrived; it tolerates SSE events split across reads,
    CRLF line endings and comments, and never keeps more than a bounded buffer.
    """

    __slots__ = (
        "id", "emit", "sse", "status", "ended", "_buf", "_body", "_tokens", "_usage_ct", "_prompt_tokens",
        "_finish_reason", "_overflow", "_pend_n", "_pend_t",
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

    @property
    def tokens(self) -> int:
        return self._tokens

    def feed(self, chunk: bytes, t: float) -> None:
        if self.ended:
            return
        if not self.sse:
            cap = _ERROR_BODY_CAP if self.status >= 400 else _JSON_BODY_CAP
            if self._overflow + len(chunk) <= cap:
                self._body.append(chunk)
            self._overflow += len(chunk)
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
            # Not SSE after all (or a pathological event): stop parsing, keep forwarding.
            self.sse = False
            self._overflow = _JSON_BODY_CAP + 1
            rest = b""
        self._buf = rest

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
        if n:
            self._pend_n += n
            self._pend_t = t

    def _flush_tokens(self) -> None:
        n = self._pend_n
        self._pend_n = 0
        self.emit(RequestRecord(self._pend_t, self.id, "first_token" if self._tokens == 0 else "token", n=n))
        self._tokens += n

    def _end(self, rec: RequestRecord) -> None:
        if not self.ended:
            if self._pend_n:
                self._flush_tokens()
            self.ended = True
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
        self._end(RequestRecord(t, self.id, "finish", finish_reason=self._finish_reason,
                                completion_tokens=ct, prompt_tokens=self._prompt_tokens))

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

    def cancel(self, t: float, reason: str | None = None) -> None:
        self._end(RequestRecord(t, self.id, "cancel", error=reason))

    def error(self, t: float, etype: str, status: int | None = None) -> None:
        self._end(RequestRecord(t, self.id, "error", status=status, error=etype))


def _forward_headers(headers: Any, drop: frozenset[str]) -> list[tuple[str, str]]:
    conn = headers.get("Connection", "")
    listed = {h.strip().lower() for h in conn.split(",") if h.strip()}
    out = []
    for k, v in headers.items():
        lk = k.lower()
        if lk in _HOP_BY_HOP or lk in listed or lk in drop:
            continue
        out.append((k, v))
    return out


_REQ_DROP = frozenset({"host", "content-length"})
_RESP_DROP = frozenset()


class RecordingProxy:
    """aiohttp reverse proxy in front of one OpenAI-compatible ``upstream``.

    ``emit`` receives every record synchronously on the event loop (keep it cheap; a trace
    writer's buffered ``write`` is). ``clock`` gives the run-relative time in seconds.
    """

    def __init__(
        self,
        upstream: str,
        emit: Emit,
        clock: Clock,
        host: str = "127.0.0.1",
        port: int = 0,
        cls: str | None = None,
        reuse_port: bool = False,
    ):
        self.upstream = _upstream_url(upstream)
        self.emit = emit
        self.clock = clock
        self.host = host
        self.port = port
        self.cls = cls
        self.reuse_port = reuse_port
        self.requests_seen = 0
        self.in_flight = 0
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._stopping = False
        self._handlers: set[asyncio.Task[Any]] = set()

    async def start(self) -> None:
        # Long streams may stall for minutes without being broken; only the connect is bounded.
        timeout = aiohttp.ClientTimeout(total=None, connect=30, sock_connect=10, sock_read=None)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=False),
            timeout=timeout,
            auto_decompress=False,  # bytes reach the client exactly as the upstream sent them
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        app = web.Application(client_max_size=_REQUEST_BODY_CAP)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        # handler_cancellation: a client that hangs up mid-stall is noticed at once, so the
        # upstream request is closed and the cancel is timestamped when it happened.
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None, logger=_ServerLog())
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True,
                           reuse_port=self.reuse_port or None)
        try:
            await site.start()
        except OSError:
            await self._runner.cleanup()
            await self._session.close()
            raise
        server = site._server
        if server is not None and getattr(server, "sockets", None):
            self.port = server.sockets[0].getsockname()[1]

    async def stop(self, grace_s: float = 0.0) -> None:
        """Stop listening; streams still running after ``grace_s`` are cut off (recorded as cancel)."""
        self._stopping = True
        if self._handlers and grace_s > 0:
            await asyncio.wait(list(self._handlers), timeout=grace_s)
        for task in list(self._handlers):
            task.cancel()
        if self._handlers:
            await asyncio.wait(list(self._handlers), timeout=5)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def flush_records(self) -> None:
        """Every record of what happened so far has been emitted (always true in-process)."""

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        task = asyncio.current_task()
        if task is None:
            return await self._proxy(request)
        self._handlers.add(task)
        try:
            return await self._proxy(request)
        finally:
            self._handlers.discard(task)

    async def _proxy(self, request: web.Request) -> web.StreamResponse:
        t_arrive = self.clock()
        assert self._session is not None
        path = request.path
        recorded = request.method == "POST" and path in RECORDED_PATHS
        given = request.headers.get("X-Request-Id")
        # A client's id with control characters cannot be forwarded (the HTTP client refuses it) nor
        # shown safely: such a request gets a fresh id, like one that sent none.
        rid = given if given and _SAFE_REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        headers = _forward_headers(request.headers, _REQ_DROP)
        if rid != given:
            headers = [(k, v) for k, v in headers if k.lower() != "x-request-id"]
            headers.append(("X-Request-Id", rid))
        rec: StreamRecorder | None = None
        data: Any = None
        if recorded:
            data = await request.read()
            prompt_tokens = None
            try:
                body = json.loads(data) if data else None
                if isinstance(body, dict):
                    prompt_tokens = prompt_tokens_from_request(body)
            except (ValueError, UnicodeDecodeError):
                pass
            self.requests_seen += 1
            self.emit(RequestRecord(t_arrive, rid, "arrive", prompt_tokens=prompt_tokens, cls=self.cls,
                                    source="proxy"))
            # The recorder parses the stream, so ask for it uncompressed; engines do not compress SSE.
            headers = [(k, v) for k, v in headers if k.lower() != "accept-encoding"]
        elif request.body_exists:
            data = request.content
            if request.content_length is not None:
                headers.append(("Content-Length", str(request.content_length)))
        url = URL(self.upstream + request.raw_path, encoded=True)
        self.in_flight += 1
        resp: web.StreamResponse | None = None
        try:
            try:
                up = await self._session.request(request.method, url, headers=headers, data=data,
                                                 allow_redirects=False)
            except asyncio.CancelledError:
                if rec is None and recorded:
                    self._ended_early(rid, "proxy_stopped" if self._stopping else None)
                raise
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
                t = self.clock()
                if recorded:
                    self.emit(RequestRecord(t, rid, "error", status=502, error="upstream_unreachable"))
                return web.json_response(
                    {"error": {"message": f"kvtop proxy: upstream {redact_url(self.upstream)} unreachable ({type(e).__name__})",
                               "type": "upstream_unreachable", "code": 502}},
                    status=502,
                    headers={"X-Request-Id": rid},
                )
            try:
                if recorded:
                    ctype = up.headers.get("Content-Type", "")
                    rec = StreamRecorder(rid, self.emit, up.status, ctype.startswith("text/event-stream"))
                resp = web.StreamResponse(status=up.status, reason=up.reason)
                for k, v in _forward_headers(up.headers, _RESP_DROP):
                    resp.headers.add(k, v)
                if "X-Request-Id" not in resp.headers:
                    resp.headers["X-Request-Id"] = rid
                await resp.prepare(request)
                clock = self.clock
                try:
                    async for chunk in up.content.iter_any():
                        t = clock()
                        await resp.write(chunk)
                        if rec is not None:
                            rec.feed(chunk, t)
                except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, asyncio.TimeoutError):
                    # Upstream died mid-body: record it and cut the client off rather than
                    # ending the body cleanly (which would look like a complete response).
                    if rec is not None:
                        rec.error(self.clock(), "upstream_disconnected")
                    if request.transport is not None:
                        request.transport.close()
                    return resp
                if rec is not None:
                    rec.finish(self.clock())
                await resp.write_eof()
                return resp
            except ConnectionResetError:
                # The client went away: close (not release) the upstream connection so the engine
                # sees the disconnect and aborts the request.
                if rec is not None:
                    rec.cancel(self.clock())
                up.close()
                return resp if resp is not None else web.Response(status=499)
            except asyncio.CancelledError:
                if rec is not None:
                    rec.cancel(self.clock(), "proxy_stopped" if self._stopping else None)
                up.close()
                raise
            finally:
                up.release()
        finally:
            self.in_flight -= 1

    def _ended_early(self, rid: str, reason: str | None) -> None:
        with contextlib.suppress(Exception):
            self.emit(RequestRecord(self.clock(), rid, "cancel", error=reason))


def parse_listen(value: str, default_port: int = 8001) -> tuple[str, int]:
    """``HOST:PORT``, ``[v6]:PORT``, ``:PORT`` or ``PORT`` (loopback) -> (host, port)."""
    v = value.strip()
    if v.isdigit():
        host, port_s = "127.0.0.1", v
    elif v.startswith("["):
        end = v.find("]")
        if end < 0 or not v[end + 1:].startswith(":"):
            raise ValueError(f"bad listen address {value!r} (want [ADDR]:PORT)")
        host, port_s = v[1:end], v[end + 2:]
    elif ":" in v:
        host, port_s = v.rsplit(":", 1)
        host = host or "127.0.0.1"
    else:
        host, port_s = v, str(default_port)
    try:
        port = int(port_s)
    except ValueError:
        raise ValueError(f"bad port in listen address {value!r}") from None
    if not 0 <= port <= 65535 or not host:
        raise ValueError(f"bad listen address {value!r}")
    return host, port


class ProxyPool:
    """The recording proxy as ``workers`` processes sharing one port (SO_REUSEPORT).

    One Python process forwards roughly 25K chunks/s before its core is full (bench/proxy_overhead.py);
    beyond that, latency grows without bound. Each worker runs a ``RecordingProxy`` and sends its
    records to this process as JSON lines on its stdout, where they reach ``emit`` in arrival order
    per worker (records of different workers can be a few milliseconds out of order). Same interface
    as ``RecordingProxy``; ``clock`` must be ``time.monotonic()`` plus a constant (workers use the
    same offset).
    """

    def __init__(self, upstream: str, emit: Emit, clock: Clock, host: str = "127.0.0.1", port: int = 0,
                 cls: str | None = None, workers: int = 2):
        self.upstream = _upstream_url(upstream)
        self.emit = emit
        self.clock = clock
        self.host = host
        self.port = port
        self.cls = cls
        self.workers = max(1, workers)
        self.requests_seen = 0
        self._procs: list[asyncio.subprocess.Process] = []
        self._readers: list[asyncio.Task[None]] = []
        self._pongs: dict[int, int] = {}
        self._pong_event = asyncio.Event()
        self._ping = 0

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        import os
        import socket
        import time

        offset = self.clock() - time.monotonic()
        reserve = None
        if self.port == 0:
            # Hold an ephemeral port (bound, not listening) so every worker can bind the same one.
            family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
            reserve = socket.socket(family, socket.SOCK_STREAM)
            reserve.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            reserve.bind((self.host, 0))
            self.port = reserve.getsockname()[1]
        args = [*worker_command("kvtop.proxy"), "--worker", "--upstream", self.upstream, "--host", self.host,
                "--port", str(self.port), f"--offset={offset!r}"]
        env = dict(os.environ)
        if self.cls:
            args += ["--class", self.cls]
        try:
            for _ in range(self.workers):
                proc = await asyncio.create_subprocess_exec(
                    *args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE, env=env, limit=1 << 20)
                self._procs.append(proc)
            for proc in self._procs:
                assert proc.stdout is not None and proc.stderr is not None
                line = await asyncio.wait_for(proc.stdout.readline(), 60)
                if not line.startswith(b'{"ready"'):
                    err = (await proc.stderr.read()).decode(errors="replace").strip().splitlines()
                    raise OSError(err[-1] if err else "proxy worker failed to start")
            for i, proc in enumerate(self._procs):
                self._readers.append(asyncio.create_task(self._read(i, proc)))
        except BaseException:
            await self._kill()
            raise
        finally:
            if reserve is not None:
                reserve.close()

    async def _read(self, i: int, proc: asyncio.subprocess.Process) -> None:
        from kvtop.model.records import from_dict

        assert proc.stdout is not None
        loads = json.loads
        async for line in proc.stdout:
            try:
                d = loads(line)
            except ValueError:
                continue
            if "pong" in d:
                self._pongs[i] = d["pong"]
                self._pong_event.set()
                continue
            if len(d) == 5 and "n" in d and d.get("kind") == "request":  # a token line: the hot path
                rec: Any = RequestRecord(d["t"], d["id"], d["event"], n=d["n"])
            else:
                rec = from_dict(d)
            if isinstance(rec, RequestRecord):
                if rec.event == "arrive":
                    self.requests_seen += 1
                self.emit(rec)

    async def flush_records(self, timeout_s: float = 10.0) -> None:
        """Wait until every record the workers produced before this call has been emitted here."""
        self._ping += 1
        n = self._ping
        for proc in self._procs:
            if proc.stdin is not None and proc.returncode is None:
                proc.stdin.write(b"ping %d\n" % n)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while any(self._pongs.get(i, 0) < n for i, p in enumerate(self._procs) if p.returncode is None):
            self._pong_event.clear()
            left = deadline - loop.time()
            if left <= 0:
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._pong_event.wait(), left)

    async def stop(self, grace_s: float = 0.0) -> None:
        import signal

        for proc in self._procs:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        if self._readers:
            # the workers record their cut-off streams, then close stdout
            await asyncio.wait(self._readers, timeout=10 + grace_s)
        await self._kill()

    async def _kill(self) -> None:
        for proc in self._procs:
            if proc.returncode is None:
                try:
                    await asyncio.wait_for(proc.wait(), 5)
                except asyncio.TimeoutError:
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
                    await proc.wait()
        for task in self._readers:
            task.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)
        self._procs, self._readers = [], []


def make_proxy(upstream: str, emit: Emit, clock: Clock, host: str = "127.0.0.1", port: int = 0,
               cls: str | None = None, workers: int = 1) -> RecordingProxy | ProxyPool:
    if workers <= 1:
        return RecordingProxy(upstream, emit, clock, host=host, port=port, cls=cls)
    return ProxyPool(upstream, emit, clock, host=host, port=port, cls=cls, workers=workers)


async def _worker(upstream: str, host: str, port: int, offset: float, cls: str | None) -> int:
    import signal
    import sys
    import time

    from kvtop.model.trace import _encode, _request_dict

    out = sys.stdout.buffer
    loop = asyncio.get_running_loop()
    pending: list[bytes] = []
    scheduled = False

    def flush() -> None:
        nonlocal scheduled
        scheduled = False
        if pending:
            out.write(b"".join(pending))
            out.flush()
            pending.clear()

    def emit(rec: RequestRecord) -> None:
        nonlocal scheduled
        pending.append(_encode(_request_dict(rec)).encode() + b"\n")
        if not scheduled:
            scheduled = True
            loop.call_soon(flush)  # one write per loop iteration, not per record

    proxy = RecordingProxy(upstream, emit, lambda: time.monotonic() + offset, host=host, port=port, cls=cls,
                           reuse_port=True)
    try:
        await proxy.start()
    except OSError as e:
        print(f"cannot listen on {host}:{port}: {e.strerror or e}", file=sys.stderr)
        return 1
    out.write(b'{"ready":%d}\n' % proxy.port)
    out.flush()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which stops us in order

    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)

    async def control() -> None:
        while True:
            line = await reader.readline()
            if not line:  # the parent is gone
                stop.set()
                return
            if line.startswith(b"ping "):
                flush()
                out.write(b'{"pong":%d}\n' % int(line[5:]))
                out.flush()

    ctl = asyncio.create_task(control())
    await stop.wait()
    await proxy.stop()
    flush()
    ctl.cancel()
    return 0


def _worker_main() -> int:
    import argparse

    p = argparse.ArgumentParser(prog="kvtop.proxy worker")
    p.add_argument("--worker", action="store_true", required=True)
    p.add_argument("--upstream", required=True)
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--offset", type=float, required=True)
    p.add_argument("--class", dest="cls")
    a = p.parse_args()
    return asyncio.run(_worker(a.upstream, a.host, a.port, a.offset, a.cls))


def worker_command(module: str) -> list[str]:
    """A command line running ``module`` as ``__main__`` in a child Python that cannot import
    files from the current directory.

    ``python -m`` puts the working directory first on the import path, so a ``uuid.py`` there
    would run inside every worker. The child starts isolated (``-I``: no cwd, no PYTHON* variables,
    no user site) and gets this process's import path back minus the working directory, plus the
    folder kvtop itself was imported from.
    """
    import os
    import sys

    import kvtop

    cwd = os.getcwd()
    root = os.path.dirname(os.path.dirname(os.path.abspath(kvtop.__file__)))
    paths = [root] + [p for p in sys.path if p and os.path.abspath(p) not in (cwd, root)]
    code = (f"import sys, runpy; sys.path[:0] = {paths!r}; "
            f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)")
    return [sys.executable, "-I", "-c", code]


if __name__ == "__main__":
    raise SystemExit(_worker_main())
