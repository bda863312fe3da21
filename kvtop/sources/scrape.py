"""Engine scraping: async GET of an engine's /metrics (and the adapter's extra paths), normalised
through its adapter into ``EngineRecord``s (docs/design.md §4).

``scrape`` never raises. A failed scrape is a record with ``up=False`` and a one-line reason, and
the scraper backs off (1, 2, 4 … 30 s) so a dead engine costs nothing while the rest keep running.
A page that is too big is cut at the size limit and what was read is still used, with a warning.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any

import httpx

from kvtop.model.records import EngineRecord
from kvtop.model.sanitize import printable, redact_url, sanitize_record
from kvtop.plugin import EngineAdapter, PluginError, detect_adapter, load_adapter
from kvtop.sources.prom import Page, parse_page

BACKOFF_MAX_S = 30.0
_NOT_METRICS = "not a metrics endpoint"


# the fields an engine's page gives on every scrape (idle or busy); a page that gives none of them
# is no engine's page
_READ_FIELDS = ("running", "waiting", "kv_usage", "preemptions_total", "prompt_tokens_total",
                "generation_tokens_total", "requests_finished_total", "itl", "ttft")


class ScrapeError(Exception):
    """One-line reason a scrape gave nothing usable."""


def split_url(url: str) -> tuple[str, str]:
    """(base URL for extra paths, the /metrics URL) from what the user typed.

    Accepts ``host:port``, a base URL, or a URL already ending in ``/metrics``; a query string
    (llama.cpp router mode wants ``?model=``) is kept on the metrics URL.
    """
    u = url.strip()
    if "://" not in u:
        u = "http://" + u
    parsed = httpx.URL(u)
    path = parsed.path.rstrip("/")
    if path.endswith("/metrics"):
        base_path = path[: -len("/metrics")]
        metrics = parsed
    else:
        base_path = path
        metrics = parsed.copy_with(path=path + "/metrics")
    base = str(parsed.copy_with(path=base_path or "/", query=None)).rstrip("/")
    return base, str(metrics)


def _one_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return (msg[0] if msg else type(e).__name__)[:160]


class EngineScraper:
    """Scrapes one engine URL. Not thread-safe: one ``scrape`` at a time per instance."""

    def __init__(
        self,
        url: str,
        adapter: str | None = None,
        timeout_s: float = 2.0,
        max_bytes: int = 16 << 20,
        token: str | None = None,
        client: httpx.AsyncClient | None = None,
        clock: Callable[[], float] | None = None,
    ):
        """``clock`` (the run clock): when given, records are stamped when the response arrived
        rather than with the ``t`` passed to ``scrape`` (connection set-up or a slow engine would
        otherwise skew rates computed between scrapes)."""
        self.url = url.strip().rstrip("/")
        # What records, traces and messages carry: user-info (user:pass@) never leaves this object.
        self.shown_url = redact_url(self.url)
        self.base_url, self.metrics_url = split_url(url)
        # llama.cpp router mode selects the model by query string: extra paths need it too.
        self._query = httpx.URL(self.metrics_url).query.decode()
        # Extra paths the server does not have (HTTP 404): said once, then no longer fetched.
        self._absent_paths: set[str] = set()
        # what the engine says once per start: (restart token it was asked under, version, limits)
        self._started: tuple[float | None, str | None, dict[str, int]] | None = None
        self.adapter_name = adapter
        self._forced_note: str | None = None  # --adapter names an engine whose metrics the page lacks
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self._headers = {"Accept": "text/plain;version=0.0.4, */*;q=0.1"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._client = client
        self.clock = clock  # the run clock (a feed sets it to its own)
        self._resp_t: float | None = None
        self._own_client = client is None
        self.adapter_cls: type[EngineAdapter] | None = None
        self._adapter: EngineAdapter | None = None
        self.last_ok_t: float | None = None
        self.consecutive_failures = 0
        self.last_error: str | None = None
        self._retry_at = -math.inf
        self.requests = 0  # HTTP requests sent (tests check that backoff really skips them)

    # -- public -----------------------------------------------------------------------------
    async def scrape(self, t: float) -> list[EngineRecord]:
        if t < self._retry_at and self.last_error is not None:
            return [self._down(t, self.last_error)]
        try:
            recs = await self._scrape(t)
        except ScrapeError as e:
            return self._failed(t, str(e))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # never let one engine's oddity escape into the runner
            return self._failed(t, f"scrape failed: {_one_line(e)}")
        self.consecutive_failures = 0
        self.last_error = None
        self._retry_at = -math.inf
        self.last_ok_t = recs[0].t if recs else t
        return recs

    async def aclose(self) -> None:
        if self._own_client and self._client is not None:
            await self._client.aclose()
            self._client = None

    @property
    def backoff_s(self) -> float:
        """Delay before the next attempt after the current run of failures (0 when healthy)."""
        if not self.consecutive_failures:
            return 0.0
        return min(BACKOFF_MAX_S, 2.0 ** (self.consecutive_failures - 1))

    # -- internals --------------------------------------------------------------------------
    def _down(self, t: float, reason: str) -> EngineRecord:
        name = self.adapter_cls.name if self.adapter_cls else (self.adapter_name or "unknown")
        return EngineRecord(t=t, adapter=name, url=self.shown_url, up=False, warnings=[reason])

    def _failed(self, t: float, reason: str) -> list[EngineRecord]:
        # a reason may quote the page (a label value's control characters): shown on terminals
        reason = printable(reason, 500)
        self._started = None  # the engine that answers next may be another start of it
        self.consecutive_failures += 1
        self.last_error = reason
        self._retry_at = t + self.backoff_s
        return [self._down(t, reason)]

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(follow_redirects=True)
        return self._client

    async def _get(self, url: str) -> tuple[str, str, list[str]]:
        """(body text cut at ``max_bytes``, content type, warnings); ScrapeError on transport/HTTP failure."""
        # No asyncio.wait_for here: cancelling an in-flight httpx request can leave the task stuck
        # in httpcore's shielded connection clean-up. httpx's own per-phase timeouts bound each
        # phase and _get_inner enforces the total deadline between body chunks.
        try:
            return await self._get_inner(url)
        except httpx.ConnectError as e:
            raise ScrapeError(f"cannot connect to {redact_url(url)}: {_one_line(e)}") from None
        except httpx.TimeoutException:
            raise ScrapeError(f"timed out after {self.timeout_s:g}s ({redact_url(url)})") from None
        except httpx.HTTPError as e:
            raise ScrapeError(f"HTTP error from {redact_url(url)}: {_one_line(e)}") from None

    async def _get_inner(self, url: str) -> tuple[str, str, list[str]]:
        warnings: list[str] = []
        self.requests += 1
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        async with self._http().stream("GET", url, headers=self._headers, timeout=self.timeout_s) as resp:
            if self.clock is not None and url == self.metrics_url:
                self._resp_t = self.clock()
            if resp.status_code != 200:
                hint = " (wrong or missing --token?)" if resp.status_code in (401, 403) else ""
                raise ScrapeError(f"HTTP {resp.status_code} from {redact_url(url)}{hint}")
            ctype = resp.headers.get("content-type", "").lower()
            chunks: list[bytes] = []
            size = 0
            async for chunk in resp.aiter_bytes():
                if loop.time() > deadline:  # a server dripping bytes must not hold the scrape forever
                    raise ScrapeError(f"timed out after {self.timeout_s:g}s ({redact_url(url)})")
                chunks.append(chunk)
                size += len(chunk)
                if size >= self.max_bytes:
                    warnings.append(
                        f"page larger than {self.max_bytes / (1 << 20):g} MiB: read only the first part"
                    )
                    break
        body = b"".join(chunks)
        if size >= self.max_bytes:
            body = body[: self.max_bytes]
            cut = body.rfind(b"\n")  # a half line would only add a parse warning
            body = body[: cut + 1] if cut >= 0 else b""
        return body.decode("utf-8", errors="replace"), ctype, warnings

    def _resolve(self, page: Page) -> EngineAdapter:
        if self._adapter is not None:
            return self._adapter
        cls: type[EngineAdapter] | None
        if self.adapter_name:
            try:
                cls = load_adapter(self.adapter_name)
            except PluginError as e:
                raise ScrapeError(str(e)) from None
            if cls.detect(page.names) < 0.3:
                # a forced adapter that recognises nothing on the page reads every field as n/a: say
                # whose page it looks like, once
                seen = detect_adapter(page.names)
                if seen is not None and seen is not cls:
                    self._forced_note = (f"--adapter {self.adapter_name}: the page at {redact_url(self.metrics_url)} "
                                         f"looks like {seen.name}'s (leave --adapter out to detect it)")
        else:
            cls = detect_adapter(page.names)
            if cls is None:
                raise ScrapeError(f"{_NOT_METRICS}: no installed adapter recognises the metrics at {redact_url(self.metrics_url)}")
        self.adapter_cls = cls
        self._adapter = cls()
        return self._adapter

    def normalize(self, text: str, t: float) -> tuple[EngineAdapter, list[EngineRecord]]:
        """Parse one page through the adapter (detecting it on first use); ScrapeError if unusable."""
        head = text.lstrip()[:1]
        if head in ("<", "{", "["):
            raise ScrapeError(f"{_NOT_METRICS}: {redact_url(self.metrics_url)} returned {'HTML' if head == '<' else 'JSON'}")
        adapter = self._adapter
        if adapter is None:
            # First good page: detect the engine from its metric names (one extra parse, once).
            page = parse_page(text)
            if not page.samples:
                raise ScrapeError(f"{_NOT_METRICS}: no metric samples at {redact_url(self.metrics_url)}")
            adapter = self._resolve(page)
        try:
            recs = adapter.parse(text, t)
        except Exception as e:
            raise ScrapeError(f"adapter {adapter.name} failed on {redact_url(self.metrics_url)}: {_one_line(e)}") from None
        if isinstance(recs, EngineRecord):  # lenient with third-party adapters returning one record
            recs = [recs]
        if not recs:
            raise ScrapeError(f"adapter {adapter.name} found no engine at {redact_url(self.metrics_url)}")
        if all(all(getattr(r, f) is None for f in _READ_FIELDS) for r in recs):
            # an empty or garbled page (a proxy's error body served as 200, a cut connection): no
            # engine answered there, and a record of it would be an engine of its own, all n/a
            why = self._forced_note or next((w for r in recs for w in r.warnings), "")
            raise ScrapeError(f"{_NOT_METRICS}: nothing kvtop reads at {redact_url(self.metrics_url)}"
                              + (f" ({why})" if why else ""))
        for r in recs:
            sanitize_record(r)
            if self._forced_note:
                r.warnings.append(self._forced_note)
        return adapter, recs

    async def _scrape(self, t: float) -> list[EngineRecord]:
        self._resp_t = None
        text, ctype, warnings = await self._get(self.metrics_url)
        if self._resp_t is not None:
            t = self._resp_t
        if "html" in ctype or "json" in ctype:
            raise ScrapeError(f"{_NOT_METRICS}: {redact_url(self.metrics_url)} returned {ctype.split(';')[0]}")
        # Parsing a large page takes milliseconds: keep it off the event loop (the proxy shares it).
        adapter, recs = await asyncio.to_thread(self.normalize, text, t)
        for r in recs:
            r.url = self.shown_url
            r.adapter = r.adapter or adapter.name
            if warnings:
                r.warnings = [*warnings, *r.warnings]
        for path in adapter.extra_paths:
            if path in self._absent_paths:
                continue
            url = self.base_url + (path if path.startswith("/") else "/" + path)
            if self._query:
                url += "?" + self._query
            try:
                body, _, w = await self._get(url)
                adapter.parse_extra(path, body, recs)
            except ScrapeError as e:
                w = [f"{path}: {e}"]
                if str(e).startswith("HTTP 404"):
                    self._absent_paths.add(path)
                    w = [f"{path}: not served here (HTTP 404); not asked again"]
            except Exception as e:  # an adapter's extra parser must not lose the main record
                w = [f"{path}: adapter failed: {_one_line(e)}"]
            if w:
                for r in recs:
                    r.warnings.extend(w)
        if adapter.extra_paths:
            for r in recs:  # parse_extra may have written new values
                sanitize_record(r)
        if adapter.version_path or adapter.limits_path:
            await self._per_start(adapter, recs)
        return recs

    async def _per_start(self, adapter: EngineAdapter, recs: list[EngineRecord]) -> None:
        """Put what the engine says once per start (its version, its limits) on its records: asked on
        the first scrape, and again when the engine restarted (its restart token moved, or a scrape
        failed in between: it may have been upgraded or restarted with other flags); a failed ask is
        one warning, not a failed scrape."""
        token = recs[0].restart_token
        if self._started is None or self._started[0] != token:
            version = limits = None
            if adapter.version_path:
                version = await self._ask(adapter.version_path, adapter.parse_version, recs, "version",
                                          "the engine's version stays unknown until it restarts")
            if adapter.limits_path:
                limits = await self._ask(adapter.limits_path, adapter.parse_limits, recs, "limits",
                                         "its limits stay unknown until it restarts")
            self._started = (token, version, limits or {})
        _, version, limits = self._started
        for r in recs:
            if r.version is None:
                r.version = version
            for k, v in limits.items():
                r.limits.setdefault(k, v)  # what the adapter read from the page itself comes first

    async def _ask(self, path: str, parse: Callable[[str], Any], recs: list[EngineRecord], what: str,
                   unknown: str) -> Any:
        url = self.base_url + (path if path.startswith("/") else "/" + path)
        try:
            body, _, _ = await self._get(url)
            out = parse(body)
            if out is None:
                recs[0].warnings.append(f"{path}: no {what} in the reply")
            return out
        except ScrapeError as e:
            if not str(e).startswith("HTTP 404"):  # not served (a router, an old engine): nothing to say
                recs[0].warnings.append(f"{path}: {e} ({unknown})")
        except Exception as e:  # an adapter's parser must not lose the main record
            recs[0].warnings.append(f"{path}: adapter failed: {_one_line(e)}")
        return None
