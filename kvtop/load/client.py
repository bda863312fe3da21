"""The load client: sends a ``Plan`` to an OpenAI-compatible ``/v1/completions`` on its schedule.

Each request streams with ``max_tokens`` = the planned output and ``ignore_eos`` (so an engine that
honours it produces exactly that many tokens), ``stream_options.include_usage`` (the recorder reads
the prompt and output lengths from the usage block) and the plan's id as ``X-Request-Id`` (the
recording proxy keeps it, so both traces name a request alike). Tokens are counted with the
recorder's own stream parser (``kvtop.sources.sse.StreamRecorder``), so a cancel "after k tokens"
means k as the recorder counts them.

Prompts are token ids (vLLM, SGLang and the simulated server accept ``prompt`` as a list of ints)
drawn per request from a seeded generator, so unrelated requests share no prefix-cache blocks;
requests of one prefix group start with the group's ids. ``prompt_mode="text"`` sends one filler
word per token instead, for engines that refuse token ids (a tokenizer may count them differently).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvtop.load.plan import LoadRequest, Plan
from kvtop.model.records import RequestRecord
from kvtop.sources.sse import StreamRecorder

TOKEN_ID_LO = 1000  # past the special and byte tokens of common vocabularies (Gemma's turn markers: 106-107)
# inside any vocabulary of 2,048 tokens or more: an id past a model's vocabulary is a 400 for every
# request (vLLM), so a small model (the real-engine tier's has 2,048) must be covered too; a thousand
# distinct ids keep random prompts from sharing cached prefixes all the same
TOKEN_ID_HI = 2048
LATE_S = 0.01  # a send this far behind its planned time is late (an event loop's jitter is well under)


@dataclass
class LoadStats:
    planned: int = 0
    sent: int = 0
    finished: int = 0
    cancelled: int = 0  # hung up as planned (the trace's client cancelled there)
    errors: int = 0
    cut_off: int = 0  # still streaming when the run stopped (--duration, Ctrl-C)
    in_flight: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)
    # how far behind the plan's schedule sends went out (an open-loop client that falls behind
    # offers less than the plan, and a request's TTFT counts from when it reached the engine, not
    # from when it was due: the lateness is the generator's, said so rather than hidden)
    late_max_s: float = 0.0
    late_n: int = 0  # sends over LATE_S behind their planned time
    capped: int = 0  # sends that waited for a stream to end (max_concurrency streams open)
    first_sent_t: float | None = None
    last_sent_t: float | None = None

    def error(self, kind: str) -> None:
        self.errors += 1
        self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1


def prompt_ids(req: LoadRequest, seed: int) -> list[int]:
    rng = random.Random(f"{seed}/{req.id}")
    head: list[int] = []
    if req.shared_prefix:
        g = random.Random(f"{seed}/prefix/{req.prefix_id}")
        head = [g.randrange(TOKEN_ID_LO, TOKEN_ID_HI) for _ in range(req.shared_prefix)]
    return head + [rng.randrange(TOKEN_ID_LO, TOKEN_ID_HI) for _ in range(req.prompt_tokens - len(head))]


def prompt_text(req: LoadRequest) -> str:
    head: list[str] = []
    if req.shared_prefix and req.prefix_id is not None:
        head = [req.prefix_id] * req.shared_prefix
    # a request-unique word right after the shared part: no prefix sharing beyond it
    return " ".join([*head, req.id, *(["tok"] * (req.prompt_tokens - len(head) - 1))])


async def model_name(session: aiohttp.ClientSession, url: str) -> str | None:
    try:
        async with session.get(f"{url}/v1/models") as r:
            if r.status == 200:
                data = await r.json()
                model = data["data"][0]["id"]
                return model if isinstance(model, str) else None
    except (aiohttp.ClientError, KeyError, IndexError, TypeError, ValueError, asyncio.TimeoutError):
        pass
    return None


class LoadClient:
    """Sends one plan; ``run`` returns when every request ended or ``stop`` is set."""

    def __init__(self, url: str, plan: Plan, *, model: str, seed: int = 1, prompt_mode: str = "ids",
                 ignore_eos: bool = True, max_concurrency: int = 4096):
        self.url = url.rstrip("/")
        self.plan = plan
        self.model = model
        self.seed = seed
        self.prompt_mode = prompt_mode
        self.ignore_eos = ignore_eos
        self.max_concurrency = max_concurrency
        self.stats = LoadStats(planned=len(plan.requests))
        self.t0 = time.monotonic()
        self.stopped = False  # the run was stopped: streams that end now were cut off, not finished
        self._stop: asyncio.Event | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    async def run(self, session: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        """Send the plan until it is done or ``stop`` is set; streams still open then stay open until
        ``close`` (the recorder stops first, so it records them as cut off by kvtop, not by a client)."""
        self.t0 = time.monotonic()
        self._stop = stop
        sem = asyncio.Semaphore(self.max_concurrency)
        tasks = self._tasks
        try:
            for req in self.plan.requests:
                # the body is built before the wait: encoding a long token-id prompt must not delay the send
                payload = json.dumps(self._body(req), separators=(",", ":")).encode()
                delay = self.t0 + req.t - time.monotonic()
                if delay > 0:
                    try:
                        await asyncio.wait_for(stop.wait(), delay)
                    except asyncio.TimeoutError:
                        pass
                if stop.is_set():
                    break
                if sem.locked():
                    self.stats.capped += 1
                await sem.acquire()
                self._schedule(req.t)
                task = asyncio.create_task(self._one(session, req, payload))
                task.add_done_callback(lambda _t: sem.release())
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            while tasks and not stop.is_set():
                waiter = asyncio.create_task(stop.wait())
                await asyncio.wait([*tasks, waiter], return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
        finally:
            self.stopped = stop.is_set()

    def _schedule(self, planned_t: float) -> None:
        st = self.stats
        now = time.monotonic() - self.t0
        late = now - planned_t
        if late > LATE_S:
            st.late_n += 1
            st.late_max_s = max(st.late_max_s, late)
        st.first_sent_t = now if st.first_sent_t is None else st.first_sent_t
        st.last_sent_t = now

    async def close(self, wait_s: float = 5.0) -> None:
        """Let the streams cut off by the stop end, then hang up on any still open."""
        tasks = list(self._tasks)
        if tasks:
            await asyncio.wait(tasks, timeout=wait_s)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    def _body(self, req: LoadRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt_ids(req, self.seed) if self.prompt_mode == "ids" else prompt_text(req),
            "max_tokens": req.max_tokens, "stream": True, "stream_options": {"include_usage": True},
            "temperature": 0,
        }
        if self.ignore_eos:
            body["ignore_eos"] = True
        return body

    async def _one(self, session: aiohttp.ClientSession, req: LoadRequest, payload: bytes) -> None:
        st = self.stats
        st.sent += 1
        st.in_flight += 1
        headers = {"X-Request-Id": req.id, "Content-Type": "application/json"}
        if req.cls:
            headers["X-Kvtop-Class"] = req.cls  # the simulated server's class; real engines ignore it
        if req.shared_prefix and req.prefix_id is not None:
            # the simulated server's prefix group (its prompts are lengths, not ids: it cannot see the
            # shared leading ids a real engine's prefix cache finds); real engines ignore it
            headers["X-Kvtop-Prefix"] = f"{req.prefix_id}:{req.shared_prefix}"
        ends: list[RequestRecord] = []

        def keep_end(rec: RequestRecord) -> None:
            if rec.event in ("finish", "error", "cancel"):
                ends.append(rec)

        counter = StreamRecorder(req.id, keep_end, 200, sse=True)
        pauses = list(req.pauses)
        try:
            async with session.post(f"{self.url}/v1/completions", data=payload, headers=headers) as resp:
                if resp.status != 200:
                    st.error(f"http_{resp.status}")
                    return
                t_sent = time.monotonic()
                if req.cancel_after_tokens is None and req.cancel_after_s is None and not pauses:
                    await self._drain(resp, req, st, counter, ends)
                    return
                while True:
                    wait = req.patience_s
                    if req.cancel_after_s is not None and counter.tokens == 0:
                        left = t_sent + req.cancel_after_s - time.monotonic()
                        wait = left if wait is None else min(wait, left)
                    try:
                        chunk = await asyncio.wait_for(resp.content.readany(), None if wait is None else max(0.0, wait))
                    except asyncio.TimeoutError:
                        st.cancelled += 1
                        resp.close()  # hang up: the recorder sees the client go away
                        return
                    if not chunk:
                        break
                    counter.feed(chunk, 0.0)
                    if req.cancel_after_tokens is not None and counter.tokens >= req.cancel_after_tokens:
                        st.cancelled += 1
                        resp.close()
                        return
                    if counter.ended:
                        break
                    while pauses and counter.tokens >= pauses[0][0]:
                        await asyncio.sleep(pauses.pop(0)[1])  # a slow reader: the stream waits in the buffers
                self._ended(st, counter, ends)
        except (aiohttp.ClientError, OSError) as e:
            if self._was_stopped():
                st.cut_off += 1
            else:
                st.error(type(e).__name__)
        finally:
            st.in_flight -= 1

    def _was_stopped(self) -> bool:
        # the stop event, not only `stopped`: the proxy may cut a stream before `run` has returned
        return self.stopped or (self._stop is not None and self._stop.is_set())

    def _ended(self, st: LoadStats, counter: StreamRecorder, ends: list[RequestRecord]) -> None:
        """A stream's outcome as the recorder writes it in the trace (one owner): an error event in
        the stream is an error here too (vLLM reports an engine failure mid-stream with status 200)."""
        if not counter.ended:
            counter.finish(0.0)
        end = ends[-1] if ends else None
        if self._was_stopped():
            st.cut_off += 1
        elif end is not None and end.event == "error":
            st.error(end.error or "stream_error")
        elif counter.tokens or end is not None:
            st.finished += 1
        else:
            st.error("empty_stream")

    async def _drain(self, resp: aiohttp.ClientResponse, req: LoadRequest, st: LoadStats,
                     counter: StreamRecorder, ends: list[RequestRecord]) -> None:
        """A stream nobody cancels or pauses: read it to the end, through the recorder's parser."""
        while True:
            try:
                chunk = await asyncio.wait_for(resp.content.readany(), req.patience_s)
            except asyncio.TimeoutError:
                st.cancelled += 1  # the workload's patience ran out: the client hangs up
                resp.close()
                return
            if not chunk:
                break
            counter.feed(chunk, 0.0)
        self._ended(st, counter, ends)


def schedule_line(st: LoadStats, plan: Plan, max_concurrency: int) -> str | None:
    """What the run offered against the plan, where it fell behind (None where it kept up)."""
    if not (st.late_n or st.capped):
        return None
    reqs = plan.requests[:st.sent]
    span_plan = reqs[-1].t - reqs[0].t if len(reqs) > 1 else 0.0
    span_sent = (st.last_sent_t or 0.0) - (st.first_sent_t or 0.0)
    rates = ""
    if span_plan > 0 and span_sent > 0:
        rates = (f"offered {(len(reqs) - 1) / span_sent:.3g} requests/s against the plan's "
                 f"{(len(reqs) - 1) / span_plan:.3g}; ")
    capped = (f"; {st.capped} waited for a stream to end ({max_concurrency} open at once, the client's limit: "
              "past it the load is no longer open-loop)") if st.capped else ""
    return (f"behind schedule: {rates}{st.late_n} of {st.sent} send(s) went out over {LATE_S * 1e3:.0f} ms late, "
            f"up to {st.late_max_s * 1e3:.0f} ms{capped}; the trace's TTFT counts from when a request reached the "
            "engine, so this lateness is in none of its figures")


def progress_line(st: LoadStats, elapsed: float, duration: float | None) -> str:
    bound = f"/{duration:g}" if duration is not None else ""
    errs = f" errors {st.errors}" if st.errors else ""
    return (f"kvtop load: {elapsed:6.1f}{bound} s  sent {st.sent}/{st.planned}  in flight {st.in_flight}  "
            f"finished {st.finished}  cancelled {st.cancelled}{errs}")


ProgressSink = Callable[[str], None]
