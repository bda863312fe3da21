"""Drive concurrent streaming completions at an OpenAI-compatible server and time each token.

Client-side timings are an independent witness: the tests compare what kvtop recorded through its
proxy with what the client itself saw. Only counts and timings are kept, never the text.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx

WORDS = (
    "cache token block stream engine latency memory request batch prefill decode queue slot page "
    "swap offload recompute admission kernel tensor layer head vector budget window schedule"
).split()


def prompt(i: int, n_words: int = 12, seed: int = 0) -> str:
    """A distinct prompt per stream: shared prefixes would let prefix caching share KV blocks."""
    rng = random.Random(seed * 1000 + i)
    return f"Request {i} {rng.randint(0, 10**9)}: " + " ".join(rng.choice(WORDS) for _ in range(n_words))


def long_prompt(n_words: int, seed: int = 1) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) + str(rng.randint(0, 99)) for _ in range(n_words))


def llama_prompt_of(base_url: str, target: int) -> tuple[str, int]:
    """A prompt of about ``target`` tokens in a llama-server's tokenizer (its /tokenize endpoint)."""
    def count(text: str) -> int:
        r = httpx.post(base_url.rstrip("/") + "/tokenize", json={"content": text}, timeout=30)
        r.raise_for_status()
        return len(r.json()["tokens"])

    words = target // 2
    for _ in range(6):
        text = long_prompt(words)
        n = count(text)
        if abs(n - target) <= target * 0.03:
            break
        words = max(1, int(words * target / n))
    return text, n


@dataclass
class StreamResult:
    index: int
    status: int | None = None
    t_start: float = 0.0
    token_times: list[float] = field(default_factory=list)  # one per content event (time.monotonic)
    completion_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    done: bool = False  # saw [DONE]

    @property
    def gaps(self) -> list[float]:
        tt = self.token_times
        return [b - a for a, b in zip(tt, tt[1:], strict=False)]


async def stream_one(client: httpx.AsyncClient, url: str, body: dict, index: int,
                     delay: float = 0.0, res: StreamResult | None = None) -> StreamResult:
    if delay:
        await asyncio.sleep(delay)
    res = res or StreamResult(index=index)
    res.t_start = time.monotonic()
    try:
        async with client.stream("POST", url, json=body) as r:
            res.status = r.status_code
            if r.status_code != 200:
                raw = await r.aread()
                res.error = _error_type(raw.decode("utf-8", "replace"))
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    res.done = True
                    break
                try:
                    ev = json.loads(data)
                except ValueError:
                    continue
                if "error" in ev:
                    res.error = _error_type(json.dumps(ev))
                    continue
                usage = ev.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    res.completion_tokens = usage["completion_tokens"]
                for ch in ev.get("choices") or []:
                    text = ch.get("text")
                    if text is None:
                        text = (ch.get("delta") or {}).get("content")
                    if text:
                        res.token_times.append(time.monotonic())
                    if ch.get("finish_reason"):
                        res.finish_reason = ch["finish_reason"]
    except httpx.HTTPError as e:
        res.error = type(e).__name__
    return res


def _error_type(body: str) -> str:
    try:
        err = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return "unparseable"
    if isinstance(err, dict):
        return str(err.get("type") or err.get("code") or "error")
    return "error"


async def run_streams(base_url: str, model: str, n: int, max_tokens: int, *, ignore_eos: bool = True,
                      seed: int = 0, prompts: list[str] | None = None, delays: list[float] | None = None,
                      extra: dict | None = None, timeout: float = 600) -> list[StreamResult]:
    """n concurrent streams at ``/v1/completions``; returns one result per stream, in order."""
    url = base_url.rstrip("/") + "/v1/completions"
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10), limits=limits) as client:
        tasks = []
        for i in range(n):
            body = {
                "model": model,
                "prompt": prompts[i] if prompts else prompt(i, seed=seed),
                "max_tokens": max_tokens,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if ignore_eos:
                body["ignore_eos"] = True
            if extra:
                body.update(extra)
            tasks.append(stream_one(client, url, body, i, delays[i] if delays else 0.0))
        return list(await asyncio.gather(*tasks))


def body(model: str, prompt_text: str, max_tokens: int, ignore_eos: bool = True) -> dict:
    b = {"model": model, "prompt": prompt_text, "max_tokens": max_tokens, "temperature": 0, "stream": True,
         "stream_options": {"include_usage": True}}
    if ignore_eos:
        b["ignore_eos"] = True
    return b


async def run_interference(base_url: str, model: str, n_decoders: int, decode_tokens: int, long_text: str,
                           after_tokens: int = 20, seed: int = 0,
                           timeout: float = 600) -> tuple[list[StreamResult], StreamResult]:
    """``n_decoders`` streams decode; once each has ``after_tokens`` events, a long prompt arrives."""
    url = base_url.rstrip("/") + "/v1/completions"
    limits = httpx.Limits(max_connections=n_decoders + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10), limits=limits) as client:
        decs = [StreamResult(index=i) for i in range(n_decoders)]
        tasks = [asyncio.create_task(stream_one(client, url, body(model, prompt(i, seed=seed), decode_tokens), i,
                                                res=decs[i])) for i in range(n_decoders)]
        deadline = time.monotonic() + timeout
        while any(len(d.token_times) < after_tokens for d in decs) and time.monotonic() < deadline:
            if any(t.done() for t in tasks):
                break
            await asyncio.sleep(0.01)
        longres = await stream_one(client, url, body(model, long_text, 8), n_decoders)
        return list(await asyncio.gather(*tasks)), longres


def drive(base_url: str, model: str, n: int, max_tokens: int, **kw) -> list[StreamResult]:
    return asyncio.run(run_streams(base_url, model, n, max_tokens, **kw))


def stalls(results: list[StreamResult], factor: float = 25.0, floor_s: float = 0.5) -> list[tuple[int, float, float]]:
    """Client-seen stalls: gaps above ``factor`` x the typical gap of all streams (mean of the gaps
    below the 95th percentile), and at least ``floor_s`` -> (stream, t_start, gap)."""
    gaps = sorted(g for r in results for g in r.gaps)
    if not gaps:
        return []
    body = gaps[: max(1, int(len(gaps) * 0.95))]
    limit = max(floor_s, factor * sum(body) / len(body))
    return [(r.index, r.token_times[i], x) for r in results for i, x in enumerate(r.gaps) if x > limit]
