"""The workloads the witness judges inference on (real-engine tier and bench/witness_runs.py).

Each drives an OpenAI-compatible ``/v1/completions`` (kvtop's recording proxy in front of vLLM) and
returns when every stream ended:

- ``storm``: streams that together outgrow the tiny KV cache: preemptions and recompute;
- ``prefill_heavy``: a few decoders while long prompts arrive, on an engine with chunked prefill and
  room for all of them (``PREFILL_SERVER``): prefill interference, no preemption;
- ``mixed``: staggered arrivals on the small cache, some clients cancelling mid-stream, some reading
  slowly (their stalls are outside the engine).

``round_of(seed)`` is one round of variants of them with other prompts and shapes (docs/real-engines.md
§7.1 scores five such rounds): two storms (8 x 900, 10 x 500), a denser mixed load (also with half its
clients past kvtop's proxy: ``mixedhalf``) and a prefill load with more, shorter-spaced prompts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx

from testkit.engines.load import long_prompt, prompt, run_streams

# vLLM arguments for the prefill-heavy run: 16 Ki KV tokens (nothing is preempted), prompts of ~1,500
# tokens split into 256-token chunks, each chunk step several decode steps long
PREFILL_SERVER = {"kv_bytes": 16 * 1024 * 1024, "max_model_len": 2048,
                  "extra": ("--max-num-batched-tokens", "256", "--enable-chunked-prefill")}


def storm(url: str, model: str, n: int = 8, tokens: int = 600, seed: int = 11) -> None:
    asyncio.run(run_streams(url, model, n, tokens, seed=seed))


async def _one(client: httpx.AsyncClient, url: str, body: dict, delay: float, cancel_after: int | None = None,
               read_pause: float = 0.0) -> None:
    await asyncio.sleep(delay)
    seen = 0
    try:
        async with client.stream("POST", url, json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                seen += 1
                if cancel_after is not None and seen >= cancel_after:
                    return  # leaving the block closes the connection: the engine aborts the request
                if read_pause:
                    await asyncio.sleep(read_pause)
    except httpx.HTTPError:
        pass


def _body(model: str, text: str, max_tokens: int) -> dict:
    return {"model": model, "prompt": text, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}


async def _prefill_heavy(url: str, model: str, decoders: int, long_prompts: int, every_s: float,
                         fresh: int = 0) -> None:
    u = url.rstrip("/") + "/v1/completions"
    async with httpx.AsyncClient(timeout=httpx.Timeout(900, connect=10),
                                 limits=httpx.Limits(max_connections=decoders + long_prompts + 4)) as client:
        tasks = [asyncio.create_task(_one(client, u, _body(model, prompt(i, seed=5 + 1000 * fresh), 500), 0.0))
                 for i in range(decoders)]
        tasks += [asyncio.create_task(_one(client, u, _body(model, long_prompt(280, seed=20 + k + 1000 * fresh), 4),
                                           1.0 + every_s * k)) for k in range(long_prompts)]
        await asyncio.gather(*tasks)


def prefill_heavy(url: str, model: str, decoders: int = 4, long_prompts: int = 6, every_s: float = 1.5,
                  fresh: int = 0) -> None:
    """``fresh``: another set of prompts of the same lengths (an engine that served the first set holds
    them in its prefix cache and would prefill them in a few ms)."""
    asyncio.run(_prefill_heavy(url, model, decoders, long_prompts, every_s, fresh))


async def _mixed(url: str, model: str, n: int, seed: int = 9, every_s: float = 0.4, cancel_after: int = 120,
                 pause: float = 0.05, tokens: tuple[int, ...] = (350,), unseen_via: str | None = None) -> None:
    """``unseen_via``: the engine's own URL, to which every other client goes past kvtop's proxy."""
    u = url.rstrip("/") + "/v1/completions"
    direct = unseen_via.rstrip("/") + "/v1/completions" if unseen_via else u
    async with httpx.AsyncClient(timeout=httpx.Timeout(900, connect=10),
                                 limits=httpx.Limits(max_connections=n + 4)) as client:
        tasks = []
        for i in range(n):
            cancel = cancel_after if i % 5 == 1 else None  # every fifth client gives up mid-stream
            slow = pause if i % 5 == 3 else 0.0  # and another reads slowly
            body = _body(model, prompt(i, seed=seed), tokens[i % len(tokens)])
            to = direct if i % 2 else u
            tasks.append(asyncio.create_task(_one(client, to, body, every_s * i, cancel_after=cancel,
                                                  read_pause=slow)))
        await asyncio.gather(*tasks)


def mixed(url: str, model: str, n: int = 10) -> None:
    asyncio.run(_mixed(url, model, n))


async def _prefill_round(url: str, model: str, seed: int, decoders: int, long_prompts: int, every_s: float) -> None:
    u = url.rstrip("/") + "/v1/completions"
    async with httpx.AsyncClient(timeout=httpx.Timeout(900, connect=10),
                                 limits=httpx.Limits(max_connections=decoders + long_prompts + 4)) as client:
        tasks = [asyncio.create_task(_one(client, u, _body(model, prompt(i, seed=seed), 500), 0.0))
                 for i in range(decoders)]
        tasks += [asyncio.create_task(_one(client, u, _body(model, long_prompt(200 + 40 * (k % 3), seed=seed * 10 + k),
                                                             4), 1.0 + every_s * k)) for k in range(long_prompts)]
        await asyncio.gather(*tasks)


# room for every stream of ``short_prompts`` (nothing preempted), the tiny model
SHORT_PROMPTS_SERVER = {"kv_bytes": 16 * 1024 * 1024, "max_model_len": 2048}


async def _short_prompts(url: str, model: str, seed: int, decoders: int, tokens: int, stagger_s: float,
                         prompts: int, every_s: float, words: tuple[int, ...]) -> None:
    u = url.rstrip("/") + "/v1/completions"
    async with httpx.AsyncClient(timeout=httpx.Timeout(900, connect=10),
                                 limits=httpx.Limits(max_connections=decoders + prompts + 4)) as client:
        tasks = [asyncio.create_task(_one(client, u, _body(model, prompt(i, seed=seed), tokens), stagger_s * i))
                 for i in range(decoders)]
        tasks += [asyncio.create_task(_one(client, u, _body(model, prompt(decoders + k, n_words=words[k % len(words)],
                                                                          seed=seed), 3), 0.5 + every_s * k))
                  for k in range(prompts)]
        await asyncio.gather(*tasks)


def short_prompts(url: str, model: str, seed: int = 3, decoders: int = 16, tokens: int = 600, stagger_s: float = 0.4,
                  prompts: int = 80, every_s: float = 0.15, words: tuple[int, ...] = (0, 1, 2)) -> None:
    """Decoders joining one by one (each step longer than the last as the batch grows) while
    chat-turn-sized prompts (about ten tokens) arrive every ``every_s``: a prompt's step is a decode
    step plus a part of a few ms, so late in the run, with the decode-only steps near the tight target,
    that part may decide whether a step misses it (``SHORT_PROMPTS_SERVER``; docs/real-engines.md §7.9)."""
    asyncio.run(_short_prompts(url, model, seed, decoders, tokens, stagger_s, prompts, every_s, words))


# a workload: (kvtop's proxy URL, the model, the engine's own URL) -> when every stream ended
Drive = Callable[[str, str, str], None]


def short_prompts_of(seed: int) -> Drive:
    """A round's ``short_prompts`` (``SHORT_PROMPTS_SERVER``): its own prompts, batch and arrival rate."""
    def drive(url: str, model: str, _engine: str) -> None:
        short_prompts(url, model, seed=seed, decoders=14 + seed % 3, every_s=0.12 + 0.02 * (seed % 3))
    return drive


def round_of(seed: int) -> tuple[list[tuple[str, Drive]], list[tuple[str, Drive]]]:
    """One round of variant workloads, named ``<workload>-<seed>``: those for the small-cache server
    and those for ``PREFILL_SERVER``. ``mixedhalf`` is ``mixed`` with every other client going to the
    engine past kvtop's proxy: kvtop sees half the traffic (as behind one of two frontends), the
    witness all of it."""
    def storm_of(s: int, n: int, tokens: int) -> Drive:
        return lambda url, model, _engine: asyncio.run(run_streams(url, model, n, tokens, seed=s))

    def mixed_of(half: bool) -> Drive:
        def drive(url: str, model: str, engine: str) -> None:
            asyncio.run(_mixed(url, model, 14, seed=seed, every_s=0.3, cancel_after=100 + 20 * (seed % 3),
                               pause=0.04, tokens=(300, 310, 320, 330), unseen_via=engine if half else None))
        return drive

    def prefill_of(url: str, model: str, _engine: str) -> None:
        asyncio.run(_prefill_round(url, model, seed, decoders=5, long_prompts=8, every_s=0.8))

    small = [(f"storm8x900-{seed}", storm_of(seed, 8, 900)), (f"storm10x500-{seed}", storm_of(seed + 1, 10, 500)),
             (f"mixed-{seed}", mixed_of(False)), (f"mixedhalf-{seed}", mixed_of(True))]
    return small, [(f"prefill-{seed}", prefill_of)]


async def _beside_decoders(url: str, model: str, long_texts: list[str], decoders: int, decode_tokens: int,
                           every_s: float, seed: int) -> None:
    u = url.rstrip("/") + "/v1/completions"
    async with httpx.AsyncClient(timeout=httpx.Timeout(900, connect=10),
                                 limits=httpx.Limits(max_connections=decoders + len(long_texts) + 4)) as client:
        tasks = [asyncio.create_task(_one(client, u, _body(model, prompt(i, seed=seed), decode_tokens), 0.0))
                 for i in range(decoders)]
        tasks += [asyncio.create_task(_one(client, u, _body(model, text, 4), 1.0 + every_s * k))
                  for k, text in enumerate(long_texts)]
        await asyncio.gather(*tasks)


def prompts_beside_decoders(url: str, model: str, long_texts: list[str], decoders: int = 3,
                            decode_tokens: int = 500, every_s: float = 2.5, seed: int = 5) -> None:
    """``decoders`` streams decode while the long prompts arrive one by one (``every_s`` apart, from
    1 s): on a llama-server with one slot more than the decoders, each prompt is prefilled in the
    decoders' batch (the llama.cpp prescription loop's traffic; not a witness round)."""
    asyncio.run(_beside_decoders(url, model, long_texts, decoders, decode_tokens, every_s, seed))
