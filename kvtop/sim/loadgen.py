"""Load generator: drives any OpenAI-compatible server with a workload's traffic.

Arrivals, classes and lengths come from ``Workload.requests(seed, duration)`` (the same draws
``kvtop simulate`` uses). Each request streams from ``/v1/completions`` with ``max_tokens`` = its
output length and ``ignore_eos`` (so a real vLLM produces exactly that many tokens); a client whose
stream stays silent longer than its class's patience disconnects. ``extensions=True`` adds the
``kvtop`` request field the simulated server reads (class, exact lengths, shared prefix); real
servers ignore or reject unknown fields, so turn it off for them.

Prompts are filler words: a request-unique first word (so a real engine's prefix cache does not
share blocks between unrelated requests), the class's shared prefix words, then filler.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvtop.model.records import RequestRecord
from kvtop.sim.workload import RequestSpec, Workload


@dataclass
class LoadResult:
    sent: int = 0
    finished: int = 0
    cancelled: int = 0
    errors: int = 0
    tokens: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)


def _prompt(spec: RequestSpec) -> str:
    n = spec.prompt_tokens
    if spec.prefix_id:
        head = [f"{spec.prefix_id}"] * min(spec.prefix_tokens, n - 1)
        return " ".join([*head, spec.id, *(["tok"] * (n - len(head) - 1))])
    return " ".join([spec.id, *(["tok"] * (n - 1))])


async def _model_name(session: aiohttp.ClientSession, url: str) -> str | None:
    try:
        async with session.get(f"{url}/v1/models") as r:
            if r.status == 200:
                data = await r.json()
                model = data["data"][0]["id"]
                return model if isinstance(model, str) else None
    except (aiohttp.ClientError, KeyError, IndexError, ValueError, asyncio.TimeoutError):
        pass
    return None


async def run_load(url: str, workload: Workload, duration_s: float, seed: int,
                   on_record: Callable[[RequestRecord], None] | None = None, *, speed: float = 1.0,
                   extensions: bool = True, clock: Callable[[], float] | None = None,
                   model: str | None = None, max_concurrency: int = 2000) -> LoadResult:
    """Send the workload's requests to ``url`` for ``duration_s`` workload seconds.

    ``speed`` compresses the schedule (and patience) for a server running faster than real time.
    ``on_record`` gets client-side request records; ``clock`` gives their ``t`` (default: seconds
    since this call started).
    """
    url = url.rstrip("/")
    start = time.monotonic()
    now = clock or (lambda: time.monotonic() - start)
    emit = on_record or (lambda r: None)
    res = LoadResult()
    sem = asyncio.Semaphore(max_concurrency)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    connector = aiohttp.TCPConnector(limit=max_concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        if model is None:
            model = await _model_name(session, url) or workload.engine.model
        tasks: set[asyncio.Task[None]] = set()
        try:
            for spec in workload.requests(seed, duration_s):
                delay = start + spec.t / speed - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                await sem.acquire()
                task = asyncio.create_task(_one(session, url, model, spec, speed, extensions, emit, now, res))
                task.add_done_callback(lambda _t: sem.release())
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            rest = start + duration_s / speed - time.monotonic()
            if rest > 0:
                await asyncio.sleep(rest)
        finally:
            # the run is over (or was cancelled): hang up on what is still streaming
            for t in list(tasks):
                t.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
    return res


async def _one(session: aiohttp.ClientSession, url: str, model: str, spec: RequestSpec, speed: float,
               extensions: bool, emit: Callable[[RequestRecord], None], now: Callable[[], float],
               res: LoadResult) -> None:
    body: dict[str, Any] = {
        "model": model, "prompt": _prompt(spec), "max_tokens": spec.output_tokens, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0,
    }
    headers = {}
    if extensions:
        # the simulated server stops at output_tokens ("stop") below the class's max_tokens, as simulate does
        body["max_tokens"] = spec.max_tokens
        body["kvtop"] = {"class": spec.cls, "prompt_tokens": spec.prompt_tokens, "output_tokens": spec.output_tokens,
                         "request_id": spec.id, "priority": spec.priority}
        if spec.prefix_id:
            body["kvtop"].update(prefix_id=spec.prefix_id, prefix_tokens=spec.prefix_tokens)
        headers["X-Kvtop-Class"] = spec.cls
    patience = spec.patience_s / speed if spec.patience_s is not None else None
    res.sent += 1
    emit(RequestRecord(now(), spec.id, "arrive", prompt_tokens=spec.prompt_tokens, cls=spec.cls, source="sim"))
    n = 0
    finish_reason = None
    try:
        async with session.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
            if resp.status != 200:
                res.errors += 1
                kind = f"http_{resp.status}"
                res.error_kinds[kind] = res.error_kinds.get(kind, 0) + 1
                emit(RequestRecord(now(), spec.id, "error", status=resp.status, error=kind, source="sim"))
                return
            completion = None
            while True:
                try:
                    line = await asyncio.wait_for(resp.content.readline(), patience)
                except asyncio.TimeoutError:
                    resp.close()  # the client gives up: the server sees a disconnect
                    res.cancelled += 1
                    emit(RequestRecord(now(), spec.id, "cancel", completion_tokens=n, source="sim"))
                    return
                if not line:
                    break
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                try:
                    ev = json.loads(data)
                except ValueError:
                    continue
                if ev.get("usage"):
                    completion = ev["usage"].get("completion_tokens")
                for ch in ev.get("choices") or ():
                    text = ch.get("text")
                    if text is None:
                        text = (ch.get("delta") or {}).get("content")
                    if text:
                        n += 1
                        emit(RequestRecord(now(), spec.id, "first_token" if n == 1 else "token", n=1, source="sim"))
                    if ch.get("finish_reason"):
                        finish_reason = ch["finish_reason"]
            res.finished += 1
            res.tokens += n
            emit(RequestRecord(now(), spec.id, "finish", finish_reason=finish_reason,
                               completion_tokens=completion if completion is not None else n, source="sim"))
    except asyncio.CancelledError:
        emit(RequestRecord(now(), spec.id, "cancel", completion_tokens=n, source="sim"))
        raise
    except (aiohttp.ClientError, OSError) as e:
        res.errors += 1
        kind = type(e).__name__
        res.error_kinds[kind] = res.error_kinds.get(kind, 0) + 1
        emit(RequestRecord(now(), spec.id, "error", error=kind, source="sim"))
