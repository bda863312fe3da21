"""Probe: low-rate canary streams kvtop sends itself, for ITL measurement with zero setup (docs/design.md §5.2).

Each probe is a small streaming completion (short fixed prompt, bounded ``max_tokens``) recorded
exactly like a proxied request (class ``probe``, source ``probe``). Starts are paced by a token
bucket of depth one, so over any window of T seconds at most ``rate * T + 1`` probes start, and
at most ``max_in_flight`` run at once: a stalled engine is never piled onto.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import uuid
from collections.abc import Callable

import aiohttp

from kvtop.model.records import RequestRecord
from kvtop.model.sanitize import redact_url
from kvtop.sources.sse import StreamRecorder

PROBE_PROMPT = "Count from one to one hundred in words, separated by commas:"


def probe_rate(text: str) -> float:
    """argparse type for ``--probe RATE``: canary streams per second, bounded so a probe never loads an engine."""
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--probe takes streams per second, not {text!r}") from None
    if not 0 < rate <= 100:
        raise argparse.ArgumentTypeError(f"--probe must be > 0 and at most 100 per second, not {rate:g}")
    return rate


class Probe:
    def __init__(
        self,
        url: str,
        rate_per_s: float,
        emit: Callable[[RequestRecord], None],
        clock: Callable[[], float],
        max_tokens: int = 32,
        model: str | None = None,
        max_in_flight: int = 4,
        request_timeout_s: float = 120.0,
    ):
        if rate_per_s < 0:
            raise ValueError("probe rate must be >= 0")
        self.url = url.rstrip("/")
        self._engine = redact_url(self.url)
        self.rate_per_s = rate_per_s
        self.emit = emit
        self.clock = clock
        self.max_tokens = max_tokens
        self.model = model
        self.max_in_flight = max(1, max_in_flight)
        self.request_timeout_s = request_timeout_s
        self.started = 0
        self.skipped = 0  # ticks dropped because max_in_flight probes were still running
        self._path = "/v1/completions"
        self._tasks: set[asyncio.Task[None]] = set()

    async def run(self, stop: asyncio.Event) -> None:
        if self.rate_per_s <= 0:
            return
        timeout = aiohttp.ClientTimeout(total=self.request_timeout_s, connect=5)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            try:
                await self._loop(session, stop)
            finally:
                for task in list(self._tasks):
                    task.cancel()
                if self._tasks:
                    await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _loop(self, session: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        period = 1.0 / self.rate_per_s
        loop = asyncio.get_running_loop()
        next_start = loop.time()
        while not stop.is_set():
            if self.model is None:
                self.model = await self._discover(session)
                if self.model is None:
                    # Engine not up yet (or no /v1/models): try again later, never faster than the rate.
                    if await _wait(stop, max(period, 2.0)):
                        return
                    next_start = loop.time()
                    continue
            now = loop.time()
            if now < next_start:
                if await _wait(stop, next_start - now):
                    return
            # Depth-one bucket: a late tick never earns a burst of catch-up probes.
            next_start = max(next_start + period, loop.time())
            if len(self._tasks) >= self.max_in_flight:
                self.skipped += 1
                continue
            task = asyncio.create_task(self._one(session))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _discover(self, session: aiohttp.ClientSession) -> str | None:
        try:
            async with session.get(self.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=5)) as r:
                if r.status != 200:
                    return None
                d = await r.json(content_type=None)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError):
            return None
        data = d.get("data") if isinstance(d, dict) else None
        if isinstance(data, list):
            for m in data:
                model = m.get("id") if isinstance(m, dict) else None
                if isinstance(model, str):
                    return model
        return None

    def _body(self) -> dict[str, object]:
        # usage on the last chunk: exact token counts, and the engine's per-request times where it
        # sends them (vLLM --enable-per-request-metrics rides on that chunk)
        body: dict[str, object] = {"model": self.model, "max_tokens": self.max_tokens, "stream": True,
                                   "temperature": 0, "stream_options": {"include_usage": True}}
        if self._path == "/v1/completions":
            body["prompt"] = PROBE_PROMPT
        else:
            body["messages"] = [{"role": "user", "content": PROBE_PROMPT}]
        return body

    async def _one(self, session: aiohttp.ClientSession) -> None:
        rid = "probe-" + uuid.uuid4().hex[:16]
        self.started += 1
        self.emit(RequestRecord(self.clock(), rid, "arrive", cls="probe", source="probe", engine=self._engine))
        rec: StreamRecorder | None = None
        try:
            async with session.post(self.url + self._path, json=self._body(),
                                    headers={"X-Request-Id": rid}) as r:
                if r.status == 404 and self._path == "/v1/completions":
                    self._path = "/v1/chat/completions"  # chat-only server: use chat from now on
                rec = StreamRecorder(rid, self.emit, r.status,
                                     r.headers.get("Content-Type", "").lower().startswith("text/event-stream"))
                async for chunk in r.content.iter_any():
                    rec.feed(chunk, self.clock())
                rec.finish(self.clock())
        except asyncio.CancelledError:
            self._end(rec, rid, "cancel", "probe_stopped")
            raise
        except asyncio.TimeoutError:
            self._end(rec, rid, "error", "timeout")
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError):
            self._end(rec, rid, "error", "upstream_disconnected")
        except (aiohttp.ClientError, OSError):
            self._end(rec, rid, "error", "upstream_unreachable")

    def _end(self, rec: StreamRecorder | None, rid: str, event: str, reason: str) -> None:
        if rec is not None:
            if event == "cancel":
                rec.cancel(self.clock(), reason)
            else:
                rec.error(self.clock(), reason)
        else:
            self.emit(RequestRecord(self.clock(), rid, event, error=reason))


async def _wait(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep up to ``seconds``; True when ``stop`` was set meanwhile."""
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    return stop.is_set()
