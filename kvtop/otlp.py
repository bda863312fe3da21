"""OpenTelemetry export (``--otlp-endpoint URL``): one span per observed request, one event per
token-gap stall on it, sent as OTLP/HTTP protobuf (``ExportTraceServiceRequest``).

Attribute names follow the OpenTelemetry GenAI semantic conventions where one exists
(``gen_ai.request.model``, ``gen_ai.usage.input_tokens``, ``gen_ai.usage.output_tokens``,
``server.address``); kvtop's own findings are ``kvtop.*``. A stall event carries its cause, the
rule that decided it and its confidence. Nothing private is exported: kvtop never holds prompt or
completion text or request headers, and a span carries only times, counts and findings.

The messages are the official ``opentelemetry-proto`` package's (the ``otlp`` extra); it is loaded
only when an endpoint is given.
"""

from __future__ import annotations

import os
import queue
import socket
import sys
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit, urlunsplit

from kvtop import __version__

if TYPE_CHECKING:
    from kvtop.analysis.analyzer import Analyzer
    from kvtop.picture import Picture

INSTALL_HINT = "pip install 'kvtop-console[otlp]'"
CONTENT_TYPE = "application/x-protobuf"
BATCH = 512  # spans per export request
MAX_EVENTS = 128  # stall events per span (a stream with more says how many were left out)
STALL_EVENT = "kvtop.stall"


class OtlpError(Exception):
    """An export that did not reach the receiver or was refused (one line). ``retry``: the OTLP/HTTP
    specification makes it worth another try (no connection, a timeout, or HTTP 429, 502, 503, 504);
    ``retry_after_s``: how long the receiver asked to wait (its ``Retry-After``)."""

    def __init__(self, msg: str, retry: bool = False, retry_after_s: float | None = None):
        super().__init__(msg)
        self.retry = retry
        self.retry_after_s = retry_after_s


# OTLP/HTTP "Failures": these statuses are retryable, with exponential backoff, honouring Retry-After
RETRYABLE = frozenset({429, 502, 503, 504})
RETRY_DELAYS_S = (1.0, 2.0, 4.0)
RETRY_AFTER_MAX_S = 30.0


@dataclass(frozen=True, slots=True)
class Stall:
    t_start: float
    t_end: float
    gap_s: float
    cause: str
    rule: str | None
    confidence: float | None
    ended_by: str | None


@dataclass(frozen=True, slots=True)
class RequestSpan:
    """One request as a span: its times on the run clock (seconds), its counts and its stalls."""

    request_id: str
    start: float
    end: float
    first_token: float | None
    tokens: int
    prompt_tokens: int | None
    ended_by: str | None
    engine: str | None  # host:port of the engine that served it, when known
    stalls: tuple[Stall, ...] = ()
    stalls_dropped: int = 0


def endpoint(url: str) -> str:
    """The traces URL for ``--otlp-endpoint``: as given when it has a path, else with OTLP/HTTP's
    ``/v1/traces`` (the way ``OTEL_EXPORTER_OTLP_ENDPOINT`` is read). ValueError when not http(s)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--otlp-endpoint {url!r}: give an http:// or https:// URL (OTLP/HTTP), "
                         "e.g. http://127.0.0.1:4318")
    path = parts.path if parts.path not in ("", "/") else "/v1/traces"
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


def require_proto() -> None:
    """ValueError with the install line when the ``otlp`` extra is missing."""
    try:
        import opentelemetry.proto.collector.trace.v1.trace_service_pb2  # noqa: F401
    except ImportError:
        raise ValueError(f"--otlp-endpoint needs the opentelemetry-proto package: {INSTALL_HINT}") from None


def _kv(key: str, value: Any) -> Any:
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

    if isinstance(value, bool):
        v = AnyValue(bool_value=value)
    elif isinstance(value, int):
        v = AnyValue(int_value=value)
    elif isinstance(value, float):
        v = AnyValue(double_value=value)
    else:
        v = AnyValue(string_value=str(value))
    return KeyValue(key=key, value=v)


# the downward-API variables kvtop's Kubernetes manifests set, as OpenTelemetry's resource keys
_K8S_ENV = (("k8s.pod.name", "POD_NAME"), ("k8s.namespace.name", "POD_NAMESPACE"), ("k8s.node.name", "NODE_NAME"))


def resource_attributes(service: str = "kvtop", env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Who sent the spans: ``service.name`` (``OTEL_SERVICE_NAME`` where set), ``service.version``,
    ``host.name`` and the pod, namespace and node where the agent runs in Kubernetes, then
    ``OTEL_RESOURCE_ATTRIBUTES`` (``key=value,...``, values percent-encoded) over them, as the
    OpenTelemetry SDKs read it (``OTEL_SERVICE_NAME`` still wins for the service's name). Without them
    every sidecar's spans carried ``server.address=127.0.0.1`` and nothing else to tell nodes apart."""
    env = os.environ if env is None else env
    out = {"service.name": service, "service.version": __version__, "host.name": socket.gethostname()}
    for key, var in _K8S_ENV:
        if env.get(var):
            out[key] = env[var]
    for pair in (env.get("OTEL_RESOURCE_ATTRIBUTES") or "").split(","):
        k, eq, v = pair.partition("=")
        if eq and k.strip():
            out[k.strip()] = unquote(v.strip())
    if env.get("OTEL_SERVICE_NAME"):
        out["service.name"] = env["OTEL_SERVICE_NAME"]
    return out


def _ns(clock0_unix: float, t: float) -> int:
    return int(round((clock0_unix + t) * 1e9))


def encode(spans: Sequence[RequestSpan], clock0_unix: float, model: str | None = None,
           adapter: str | None = None, service: str = "kvtop") -> bytes:
    """An ``ExportTraceServiceRequest`` holding ``spans``; ``clock0_unix`` is the run clock's
    origin in Unix seconds. Each span gets its own trace id (a request is its own trace)."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope
    from opentelemetry.proto.resource.v1.resource_pb2 import Resource
    from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status

    out = []
    for s in spans:
        attrs = [_kv("kvtop.request.id", s.request_id), _kv("kvtop.request.tokens", s.tokens),
                 _kv("gen_ai.usage.output_tokens", s.tokens), _kv("kvtop.stalls", len(s.stalls) + s.stalls_dropped)]
        if model:
            attrs.append(_kv("gen_ai.request.model", model))
        if adapter:
            attrs.append(_kv("kvtop.engine.adapter", adapter))
        if s.prompt_tokens is not None:
            attrs.append(_kv("gen_ai.usage.input_tokens", s.prompt_tokens))
        if s.first_token is not None:
            # the span's share of gen_ai.client.operation.time_to_first_chunk
            attrs.append(_kv("kvtop.time_to_first_chunk_s", round(s.first_token - s.start, 6)))
        if s.ended_by:
            attrs.append(_kv("kvtop.request.ended_by", s.ended_by))
        if s.stalls:
            attrs.append(_kv("kvtop.max_gap_s", max(x.gap_s for x in s.stalls)))
        if s.stalls_dropped:
            attrs.append(_kv("kvtop.stalls_dropped", s.stalls_dropped))
        if s.engine:
            host, _, port = s.engine.rpartition(":")
            attrs.append(_kv("server.address", host or s.engine))
            if port.isdigit():
                attrs.append(_kv("server.port", int(port)))
        events = []
        for x in s.stalls:
            ev_attrs = [_kv("kvtop.stall.cause", x.cause), _kv("kvtop.stall.gap_s", x.gap_s),
                        _kv("kvtop.stall.end_offset_s", round(x.t_end - x.t_start, 6))]
            if x.rule:
                ev_attrs.append(_kv("kvtop.stall.rule", x.rule))
            if x.confidence is not None:
                ev_attrs.append(_kv("kvtop.stall.confidence", float(x.confidence)))
            if x.ended_by:
                ev_attrs.append(_kv("kvtop.stall.ended_by", x.ended_by))
            events.append(Span.Event(time_unix_nano=_ns(clock0_unix, x.t_start), name=STALL_EVENT,
                                     attributes=ev_attrs))
        status = Status(code=Status.STATUS_CODE_ERROR, message="error") if s.ended_by == "error" else Status()
        out.append(Span(trace_id=os.urandom(16), span_id=os.urandom(8),
                        name=f"kvtop.stream {model}" if model else "kvtop.stream",
                        kind=Span.SPAN_KIND_CLIENT, start_time_unix_nano=_ns(clock0_unix, s.start),
                        end_time_unix_nano=_ns(clock0_unix, max(s.end, s.start)), attributes=attrs, events=events,
                        status=status))
    resource = Resource(attributes=[_kv(k, v) for k, v in resource_attributes(service).items()])
    scope = InstrumentationScope(name="kvtop", version=__version__)
    req = ExportTraceServiceRequest(resource_spans=[ResourceSpans(resource=resource,
                                                                  scope_spans=[ScopeSpans(scope=scope, spans=out)])])
    body: bytes = req.SerializeToString()
    return body


def post(url: str, body: bytes, timeout_s: float = 10.0) -> None:
    """One export request; OtlpError when the receiver is unreachable or refuses it."""
    import httpx

    try:
        r = httpx.post(url, content=body, headers={"Content-Type": CONTENT_TYPE}, timeout=timeout_s)
    except httpx.HTTPError as e:
        raise OtlpError(f"OTLP export to {url} failed: {type(e).__name__}: {e}",
                        retry=isinstance(e, httpx.TransportError)) from None
    if r.status_code >= 300:
        after = None
        try:
            after = min(RETRY_AFTER_MAX_S, max(0.0, float(r.headers.get("Retry-After", ""))))
        except ValueError:
            pass  # absent, or an HTTP date: the backoff's own delay
        raise OtlpError(f"OTLP export to {url} refused: HTTP {r.status_code}", retry=r.status_code in RETRYABLE,
                        retry_after_s=after)


def batches(spans: Sequence[RequestSpan], size: int = BATCH) -> Iterable[Sequence[RequestSpan]]:
    for i in range(0, len(spans), size):
        yield spans[i:i + size]


def stall_of(sp: Any) -> Stall:
    """A judged spike (``SpikeView`` of a report, or the analyzer's ``Spike``) as a stall event."""
    if hasattr(sp, "finding"):
        return Stall(sp.t_start, sp.t_end, round(sp.candidate.gap, 6), str(sp.cause), sp.finding.kind,
                     round(sp.finding.confidence, 3), sp.ended_by)
    return Stall(sp.t_start, sp.t_end, sp.gap_s, sp.cause, sp.rule, sp.confidence, sp.ended_by)


def clock0(header: dict[str, Any]) -> float | None:
    """A trace clock's origin in Unix seconds: the header's clock_t0_unix, else an agent segment's
    agent_wall_t0 (the agent's run began then; its segments share that clock, so a later segment's
    started_at, the moment the segment opened, is minutes after it), else its started_at."""
    for key in ("clock_t0_unix", "agent_wall_t0"):
        c = header.get(key)
        if isinstance(c, (int, float)) and not isinstance(c, bool) and c == c:
            return float(c)
    started = header.get("started_at")
    if isinstance(started, str):
        try:
            return datetime.fromisoformat(started.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return None
    return None


def picture_spans(pic: Picture) -> list[RequestSpan]:
    """Every stream of an analysed trace as a span, its listed spikes as its stalls."""
    stalls: dict[str, list[Stall]] = {}
    for sp in pic.report.spikes:
        stalls.setdefault(sp.request_id, []).append(stall_of(sp))
    spans = []
    for s in pic.streams:
        end = s.end_t if s.end_t is not None else s.last_t
        start = s.arrive_t if s.arrive_t is not None else s.first_t
        if start is None or end is None:
            continue  # arrived and never streamed nor ended: nothing to time
        mine = stalls.get(s.id, [])
        spans.append(RequestSpan(s.id, start, end, s.first_t, s.tokens, s.prompt_tokens, s.ended_by, s.engine,
                                 tuple(mine[:MAX_EVENTS]), max(0, len(mine) - MAX_EVENTS)))
    return spans


def export_picture(url: str, pic: Picture) -> tuple[int, int]:
    """``kvtop analyze --otlp-endpoint``: (spans, stall events) sent. ValueError when the trace's
    times cannot be placed on the wall clock; OtlpError when the receiver fails."""
    c0 = clock0(pic.header)
    if c0 is None:
        raise ValueError("the trace header has neither clock_t0_unix nor a readable started_at: "
                         "its times cannot be placed on the wall clock")
    spans = picture_spans(pic)
    h_eng = pic.header.get("engine")
    eng: dict[str, Any] = h_eng if isinstance(h_eng, dict) else {}
    for part in batches(spans):
        post(url, encode(part, c0, eng.get("model"), eng.get("adapter")))
    return len(spans), sum(len(s.stalls) for s in spans)


class LiveSpans:
    """Spans of a live analysis (``kvtop agent``): a stream's span goes out once it has ended and
    its last gap has had its evidence window judged; each judged spike joins its stream's span."""

    def __init__(self, max_pending: int = 20_000):
        self._seen_spikes = 0
        self._stalls: OrderedDict[str, list[Stall]] = OrderedDict()
        self._dropped: dict[str, int] = {}
        self._done: OrderedDict[str, None] = OrderedDict()
        self.max_pending = max_pending
        self.lost_spikes = 0  # judged and pushed out of the analyzer's list before they were read

    def collect(self, an: Analyzer, now: float) -> list[RequestSpan]:
        new = an.n_spikes - self._seen_spikes
        if new > 0:
            listed = list(an.spikes)[-new:] if new <= len(an.spikes) else list(an.spikes)
            self.lost_spikes += max(0, new - len(listed))
            for sp in listed:
                lst = self._stalls.setdefault(sp.request_id, [])
                if len(lst) < MAX_EVENTS:
                    lst.append(stall_of(sp))
                else:
                    self._dropped[sp.request_id] = self._dropped.get(sp.request_id, 0) + 1
            while len(self._stalls) > self.max_pending:
                old, _ = self._stalls.popitem(last=False)
                self._dropped.pop(old, None)
            self._seen_spikes = an.n_spikes
        settle = an.settle + 1.0
        pending_ids = {p.gap.request_id for p in an.gaps.pending}
        out = []
        for r in an.gaps.reqs.values():
            if r.end_t is None or r.end_t + settle > now or r.id in self._done or r.id in pending_ids:
                continue
            start = r.arrive_t if r.arrive_t is not None else (r.first_t if r.first_t is not None else r.end_t)
            out.append(RequestSpan(r.id, start, r.end_t, r.first_t, r.tokens, r.prompt_tokens, r.ended_by, r.engine,
                                   tuple(self._stalls.pop(r.id, ())), self._dropped.pop(r.id, 0)))
            self._done[r.id] = None
            if len(self._done) > self.max_pending:
                self._done.popitem(last=False)
        return out


class Sender:
    """Posts encoded batches from a thread of its own, so a slow receiver never stalls the run;
    a full queue drops the batch (counted) rather than grow without bound."""

    def __init__(self, url: str, timeout_s: float = 10.0, max_queue: int = 64,
                 delays_s: Sequence[float] = RETRY_DELAYS_S):
        self.url = url
        self.timeout_s = timeout_s
        self.delays_s = tuple(delays_s)
        self.sent = 0
        self.dropped = 0
        self.failures = 0  # batches given up on (after their retries)
        self.retries = 0
        self.last_error: str | None = None
        self._stopping = threading.Event()
        self._q: queue.Queue[bytes | None] = queue.Queue(maxsize=max_queue)
        self._t = threading.Thread(target=self._run, name="kvtop-otlp", daemon=True)
        self._t.start()

    def submit(self, body: bytes) -> None:
        try:
            self._q.put_nowait(body)
        except queue.Full:
            self.dropped += 1

    def _run(self) -> None:
        while True:
            body = self._q.get()
            if body is None:
                return
            self._send(body)

    def _send(self, body: bytes) -> None:
        last = False
        for attempt in range(len(self.delays_s) + 1):
            try:
                post(self.url, body, self.timeout_s)
                self.sent += 1
                return
            except OtlpError as e:
                if not e.retry or attempt == len(self.delays_s) or last:
                    self.failures += 1
                    if str(e) != self.last_error:  # one line per new kind of failure, not one per batch
                        sys.stderr.write(f"kvtop: warning: {e}\n")
                    self.last_error = str(e)
                    return
                self.retries += 1
                wait = e.retry_after_s if e.retry_after_s is not None else self.delays_s[attempt]
                # stopping: one last try now rather than a wait the run's end cannot afford
                last = self._stopping.is_set() or self._stopping.wait(wait)

    def summary(self) -> str | None:
        """One line on what did not reach the receiver, where anything did not."""
        if not (self.failures or self.dropped):
            return None
        return (f"kvtop: warning: OTLP export to {self.url}: {self.sent} batch(es) sent, {self.failures} failed "
                f"after retries, {self.dropped} dropped (queue full)")

    def close(self, wait_s: float = 5.0) -> None:
        """Send what is queued (up to ``wait_s``; a batch waiting to be retried gets one last try),
        then stop, saying what did not reach the receiver."""
        try:
            self._q.put(None, timeout=wait_s)
        except queue.Full:
            self.dropped += self._q.qsize()
        else:
            self._stopping.set()
            self._t.join(wait_s)
        line = self.summary()
        if line:
            sys.stderr.write(line + "\n")


class LiveExport:
    """``kvtop agent --otlp-endpoint``: each tick, the streams that ended and settled go out as spans."""

    def __init__(self, url: str, clock0_unix: float):
        self.clock0_unix = clock0_unix
        self.spans = LiveSpans()
        self.sender = Sender(url)
        self.exported = 0

    def tick(self, an: Analyzer, now: float, model: str | None, adapter: str | None) -> None:
        ready = self.spans.collect(an, now)
        for part in batches(ready):
            self.sender.submit(encode(part, self.clock0_unix, model, adapter))
        self.exported += len(ready)

    def final(self, an: Analyzer, model: str | None, adapter: str | None) -> None:
        """At the end of a run: judge what is pending (as ``kvtop analyze`` does at a trace's end)
        and send every request that ended; one still streaming has no end to report."""
        an.finish()
        self.tick(an, float("inf"), model, adapter)

    def close(self) -> None:
        self.sender.close()
