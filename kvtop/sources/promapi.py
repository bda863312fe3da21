"""A small client for the Prometheus HTTP API (``/api/v1/query``, ``/api/v1/query_range``).

Every failure is one line in a ``PromError``: unreachable server, timeout, HTTP 4xx/5xx (with
the server's own error text), a body that is not the API's JSON, or a result larger than the
caller allowed (a selector that matches a whole fleet's worth of series must not eat memory).
The body is streamed and cut at ``max_bytes`` before it is parsed.

``PromAuth`` is what a Prometheus-compatible API behind a gateway asks for: a bearer token or basic
auth, a CA bundle for its TLS certificate, and extra headers (``X-Scope-OrgID`` for a multi-tenant
Mimir / Cortex / Thanos). None of it ever appears in an error, a log line or a record.
"""

from __future__ import annotations

import json
import math
import ssl
from dataclasses import dataclass
from typing import Any

import httpx

Labels = dict[str, str]


class PromError(Exception):
    """One-line reason a Prometheus query gave nothing usable."""


@dataclass(frozen=True)
class PromAuth:
    token: str | None = None  # Authorization: Bearer
    username: str | None = None  # basic auth (with password); never together with token
    password: str | None = None
    ca_file: str | None = None  # PEM bundle that signs the server's certificate (else the system's)
    headers: tuple[tuple[str, str], ...] = ()  # sent with every query, e.g. ("X-Scope-OrgID", "team-a")

    def __repr__(self) -> str:  # a traceback or a debug print must not show the secrets
        return (f"PromAuth(token={'***' if self.token else None}, username={self.username!r}, "
                f"password={'***' if self.password else None}, ca_file={self.ca_file!r}, "
                f"headers={[k for k, _ in self.headers]})")


def tls_context(ca_file: str | None) -> ssl.SSLContext | bool:
    if ca_file is None:
        return True
    try:
        return ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError, ValueError) as e:
        raise PromError(f"cannot use CA file {ca_file}: {getattr(e, 'strerror', None) or _one_line(e)}") from None


def _one_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return (msg[0] if msg else type(e).__name__)[:160]


def _value(v: Any) -> float:
    try:
        return float(v)  # the API sends "NaN", "+Inf" as strings; float() reads them
    except (TypeError, ValueError):
        return math.nan


class PromClient:
    def __init__(self, url: str, timeout_s: float = 5.0, max_bytes: int = 32 << 20, max_series: int = 20_000,
                 token: str | None = None, client: httpx.Client | None = None, auth: PromAuth | None = None):
        u = url.strip().rstrip("/")
        if "://" not in u:
            u = "http://" + u
        self.url = u
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self.max_series = max_series
        auth = auth or PromAuth()
        self._headers = {"Accept": "application/json", **dict(auth.headers)}
        token = token or auth.token
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        basic = httpx.BasicAuth(auth.username, auth.password or "") if auth.username is not None else None
        # redirects stay on: a query frontend may redirect; httpx drops Authorization on a cross-origin hop
        self._client = client or httpx.Client(timeout=timeout_s, follow_redirects=True, verify=tls_context(auth.ca_file),
                                              auth=basic)
        self.queries = 0

    def close(self) -> None:
        self._client.close()

    def _get(self, path: str, params: dict[str, Any]) -> Any:
        url = self.url + path
        self.queries += 1
        try:
            with self._client.stream("GET", url, params=params, headers=self._headers,
                                     timeout=self.timeout_s) as resp:
                chunks: list[bytes] = []
                size = 0
                for chunk in resp.iter_bytes():
                    chunks.append(chunk)
                    size += len(chunk)
                    if size > self.max_bytes:
                        raise PromError(f"Prometheus answer larger than {self.max_bytes >> 20} MiB for "
                                        f"{params.get('query', path)!r}: narrow it with --selector")
                status = resp.status_code
        except httpx.ConnectError as e:
            hint = " (--prometheus-ca-file?)" if "CERTIFICATE_VERIFY_FAILED" in str(e) else ""
            raise PromError(f"cannot connect to Prometheus at {self.url}: {_one_line(e)}{hint}") from None
        except httpx.TimeoutException:
            raise PromError(f"Prometheus at {self.url} timed out after {self.timeout_s:g}s") from None
        except httpx.HTTPError as e:
            raise PromError(f"HTTP error from Prometheus at {self.url}: {_one_line(e)}") from None
        body = b"".join(chunks)
        try:
            doc = json.loads(body)
        except ValueError:
            doc = None
        if status != 200:
            why = doc.get("error") if isinstance(doc, dict) else None
            hint = (" (wrong or missing credentials: --token, --prometheus-user or --prometheus-header?)"
                    if status in (401, 403) else "")
            raise PromError(f"Prometheus HTTP {status} for {params.get('query', path)!r}"
                            + (f": {str(why).splitlines()[0][:160]}" if why else "") + hint)
        if not isinstance(doc, dict) or doc.get("status") != "success" or not isinstance(doc.get("data"), dict):
            why = doc.get("error") if isinstance(doc, dict) else "not JSON"
            raise PromError(f"{self.url} is not a Prometheus API ({why})")
        return doc["data"]

    def _result(self, data: dict[str, Any], want: str) -> list[Any]:
        rtype, result = data.get("resultType"), data.get("result")
        if rtype != want or not isinstance(result, list):
            raise PromError(f"unexpected Prometheus result type {rtype!r} (wanted {want})")
        if len(result) > self.max_series:
            raise PromError(f"query matched {len(result)} series (limit {self.max_series}): narrow it with --selector")
        return result

    def query(self, expr: str, at: float | None = None) -> list[tuple[Labels, float, float]]:
        """Instant vector: (labels incl. __name__, sample time, value) per series."""
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        out = []
        try:
            for s in self._result(self._get("/api/v1/query", params), "vector"):
                ts, v = s.get("value", (math.nan, "NaN"))
                out.append((dict(s.get("metric") or {}), float(ts), _value(v)))
        except (TypeError, ValueError, AttributeError):
            raise PromError(f"malformed Prometheus answer for {expr!r}") from None
        return out

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[tuple[Labels, list[tuple[float, float]]]]:
        """Range matrix: (labels, [(t, value), ...]) per series."""
        params = {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{max(step, 0.001):g}"}
        out = []
        try:
            for s in self._result(self._get("/api/v1/query_range", params), "matrix"):
                out.append((dict(s.get("metric") or {}), [(float(t), _value(v)) for t, v in s.get("values") or ()]))
        except (TypeError, ValueError, AttributeError):
            raise PromError(f"malformed Prometheus answer for {expr!r}") from None
        return out
