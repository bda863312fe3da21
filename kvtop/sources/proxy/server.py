"""Recording reverse proxy for OpenAI-compatible servers: the aiohttp server (docs/design.md §5.1).

Bytes are forwarded to the client as soon as each upstream read returns; a ``StreamRecorder``
parses a copy of the stream on the side and emits records timestamped when the bytes arrived from
upstream. Nothing the user wrote or the model generated is ever recorded, and no header.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import uuid
from typing import Any

import aiohttp
from aiohttp import web
from yarl import URL

from kvtop.log import ServerLog
from kvtop.model.records import RequestRecord
from kvtop.model.sanitize import redact_url
from kvtop.sources.sse import RECORDED_PATHS, Clock, Emit, StreamRecorder, prompt_tokens_from_request

# RFC 9110 §7.6.1 hop-by-hop headers, plus the ones aiohttp must compute itself.
_HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "Proxy-Connection",
        "TE", "Trailer", "Trailers", "Transfer-Encoding", "Upgrade",
    )
)
_REQUEST_BODY_CAP = 256 << 20


def upstream_url(upstream: str) -> str:
    u = URL(upstream)
    if u.scheme not in ("http", "https") or not u.host:
        raise ValueError(f"upstream must be an http(s) URL, got {upstream!r}")
    return upstream.rstrip("/")


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
_RESP_DROP: frozenset[str] = frozenset()



_SAFE_REQUEST_ID = re.compile(r"[\x20-\x7e]{1,256}")


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
        self.upstream = upstream_url(upstream)
        self._engine = redact_url(self.upstream)  # which engine served the recorded requests
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
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None, logger=ServerLog())
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True,
                           reuse_port=self.reuse_port or None)
        try:
            await site.start()
        except OSError:
            await self._runner.cleanup()
            await self._session.close()
            raise
        sockets = getattr(site._server, "sockets", None)
        if sockets:
            self.port = sockets[0].getsockname()[1]

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
                                    source="proxy", engine=self._engine))
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
                    rec = StreamRecorder(rid, self.emit, up.status, ctype.lower().startswith("text/event-stream"))
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
    try:
        # a host that names no address is the command line's mistake (exit 2), said before anything runs
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError):
        raise ValueError(f"bad listen address {value!r}: no such host {host!r}") from None
    return host, port
