"""The simulated engine behind an OpenAI-compatible HTTP API with vLLM's /metrics (``kvtop sim-server``).

Simulated time runs ``speed`` times faster than the wall clock (1 = real time): the engine plans a
step, sleeps until the step's end in wall time, then commits it and streams the tokens it produced.
A client that disconnects is cancelled inside the engine. Prompt text is only counted, never kept.

Request extension (optional; real servers ignore it): a JSON field ``"kvtop": {"class": str,
"prompt_tokens": int, "output_tokens": int, "prefix_id": str, "prefix_tokens": int, "priority": int,
"request_id": str}``; the class may also come in an ``X-Kvtop-Class`` header. Without it the prompt
length is the number of whitespace-separated words (or token ids) and the output length is
``max_tokens`` with ``ignore_eos``, else a draw from the preset's output distribution capped at
``max_tokens``.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Mapping
from typing import Any

from aiohttp import web

from kvtop.model.records import Record, RequestRecord, TruthRecord
from kvtop.sim.engine import Seq, Sink
from kvtop.sim.metrics import MetricsPage
from kvtop.sim.simulate import SIM_VERSION, make_engine
from kvtop.sim.workload import RequestSpec, Workload

MAX_BODY = 8 << 20  # 8 MiB of JSON is plenty for a 100K-word prompt

# what the engine tells a request's handler: ("token", t), ("finish", reason) or ("shutdown", None)
Stream = asyncio.Queue[tuple[str, float | str | None]]


class _ServerSink(Sink):
    def __init__(self, record: Callable[[Record], None] | None):
        self.record = record

    def on_tokens(self, t: float, seqs: list[Seq]) -> None:
        for s in seqs:
            q = s.user
            if isinstance(q, asyncio.Queue):
                q.put_nowait(("token", t))
        if self.record is not None:
            for s in seqs:
                self.record(RequestRecord(t, s.id, "first_token" if s.generated == 1 else "token", n=1,
                                          source="sim"))

    def on_finish(self, t: float, seq: Seq, reason: str) -> None:
        if isinstance(seq.user, asyncio.Queue):
            seq.user.put_nowait(("finish", reason))
        if self.record is not None:
            self.record(RequestRecord(t, seq.id, "finish" if reason != "error" else "error", source="sim",
                                      finish_reason=reason, completion_tokens=seq.generated))

    def on_cancel(self, t: float, seq: Seq) -> None:
        if self.record is not None:
            self.record(RequestRecord(t, seq.id, "cancel", source="sim", completion_tokens=seq.generated))

    def on_truth(self, rec: TruthRecord) -> None:
        if self.record is not None:
            self.record(rec)


class SimServer:
    """One simulated engine served over HTTP on ``host:port`` (port 0: an ephemeral one)."""

    def __init__(self, workload: Workload, speed: float = 1.0, seed: int = 1, host: str = "127.0.0.1",
                 port: int = 0, record: Callable[[Record], None] | None = None):
        if speed <= 0:
            raise ValueError("speed must be > 0")
        self.workload = workload
        self.speed = speed
        self.host = host
        self.port = port
        self.record = record
        self.engine = make_engine(workload, _ServerSink(record))
        self.page = MetricsPage(self.engine)
        self.rng = random.Random(f"sim-server/{seed}")
        self._classes = {c.name: c for c in workload.classes}
        self._wall0 = time.monotonic()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._runner: web.AppRunner | None = None
        self._streams: set[Stream] = set()
        self._n = 0
        self.url = ""

    # --- clock ---------------------------------------------------------------------------------

    def sim_now(self) -> float:
        return (time.monotonic() - self._wall0) * self.speed

    def wall_of(self, t_sim: float) -> float:
        """Monotonic wall time at which simulated time ``t_sim`` happens."""
        return self._wall0 + t_sim / self.speed

    # --- lifecycle -----------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        app.router.add_get("/version", self._version)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        return app

    async def start(self) -> str:
        self._wall0 = time.monotonic()
        self.engine.t = 0.0
        # shutdown_timeout: a handler still running at stop() is cancelled after this long
        self._runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None, shutdown_timeout=2.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        sock = site._server.sockets[0]  # type: ignore[union-attr]
        self.port = sock.getsockname()[1]
        host = self.host if ":" not in self.host else f"[{self.host}]"
        self.url = f"http://{host}:{self.port}"
        self._task = asyncio.create_task(self._run())
        return self.url

    async def stop(self) -> None:
        # Streams in flight end now (their clients see the stream close) rather than wait on an
        # engine that is about to stop.
        for q in list(self._streams):
            q.put_nowait(("shutdown", None))
        if self._streams:
            await asyncio.sleep(0)
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> SimServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # --- the engine loop -----------------------------------------------------------------------

    async def _run(self) -> None:
        eng = self.engine
        idle = True
        while True:
            now = self.sim_now()
            # Back-to-back steps keep the simulated timeline (timer slack is not engine time);
            # after idling, or when this process fell far behind, the next step starts now.
            if eng.t < now and (idle or now - eng.t > 0.25 * self.speed):
                eng.t = now
            plan = eng.plan()
            idle = plan is None
            if plan is None:
                self._wake.clear()
                nxt = eng.next_internal_event()
                timeout = None if nxt is None else max(0.0, (nxt - now) / self.speed)
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout)
                except asyncio.TimeoutError:
                    pass
                continue
            if plan.t_end is None:
                continue
            delay = self.wall_of(plan.t_end) - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            eng.commit(plan)

    # --- requests ------------------------------------------------------------------------------

    def _spec(self, body: dict[str, Any], prompt_words: int, headers: Mapping[str, str]) -> RequestSpec:
        raw = body.get("kvtop")
        ext: dict[str, Any] = raw if isinstance(raw, dict) else {}
        cls_name = str(ext.get("class") or headers.get("X-Kvtop-Class") or self.workload.classes[0].name)
        tc = self._classes.get(cls_name, self.workload.classes[0])
        max_tokens = body.get("max_tokens")
        if max_tokens is None:
            max_tokens = body.get("max_completion_tokens")
        if max_tokens is None:
            max_tokens = 16  # max_tokens 0 is refused, as vLLM refuses it, not read as unset
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise web.HTTPBadRequest(text=_err("max_tokens must be a positive integer"),
                                     content_type="application/json")
        prompt = ext.get("prompt_tokens", prompt_words)
        if not isinstance(prompt, int) or prompt < 1:
            raise web.HTTPBadRequest(text=_err("prompt is empty"), content_type="application/json")
        out = ext.get("output_tokens")
        if not isinstance(out, int) or out < 1:
            out = max_tokens if body.get("ignore_eos") else tc.output.sample(self.rng)
        out = min(out, max_tokens)
        self._n += 1
        rid = str(ext.get("request_id") or f"cmpl-sim-{self._n}")
        if rid in self.engine.seqs:
            rid = f"{rid}-{self._n}"
        prefix_id = ext.get("prefix_id") if isinstance(ext.get("prefix_id"), str) else None
        prefix_tokens = ext.get("prefix_tokens", 0) if prefix_id else 0
        hdr = headers.get("X-Kvtop-Prefix")
        if prefix_id is None and hdr:
            # `kvtop load` names a request's prefix group in a header (an engine ignores it; its prompt's
            # leading token ids are the group's): "GROUP:TOKENS"
            gid, _, n = hdr.rpartition(":")
            if gid and n.isdigit():
                prefix_id, prefix_tokens = gid[:128], int(n)
        if not isinstance(prefix_tokens, int) or prefix_tokens < 0 or prefix_tokens >= prompt:
            prefix_id, prefix_tokens = None, 0
        priority = ext.get("priority", tc.priority)
        return RequestSpec(rid, 0.0, tc.name, prompt, out, max_tokens, None,
                           priority if isinstance(priority, int) else 0, prefix_id, prefix_tokens)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list):
            words = sum(_count(p) for p in prompt) if prompt and not isinstance(prompt[0], int) else len(prompt)
        elif isinstance(prompt, str):
            words = len(prompt.split())
        else:
            words = 0
        if "prompt" not in body and not (isinstance(body.get("kvtop"), dict) and body["kvtop"].get("prompt_tokens")):
            raise web.HTTPBadRequest(text=_err("prompt is required"), content_type="application/json")
        return await self._serve(request, body, words, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request)
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise web.HTTPBadRequest(text=_err("messages must be a non-empty list"), content_type="application/json")
        words = 0
        for m in msgs:
            c = m.get("content") if isinstance(m, dict) else None
            if isinstance(c, str):
                words += len(c.split())
            elif isinstance(c, list):
                texts = [p.get("text", "") for p in c if isinstance(p, dict)]
                if not all(isinstance(x, str) for x in texts):
                    raise web.HTTPBadRequest(text=_err("a content part's text must be a string"),
                                             content_type="application/json")
                words += sum(len(x.split()) for x in texts)
        return await self._serve(request, body, words, chat=True)

    async def _serve(self, request: web.Request, body: dict[str, Any], words: int, chat: bool) -> web.StreamResponse:
        # everything read of the body is checked before the engine takes the request: an error after
        # it left the request generating in the engine behind a 500
        stream = bool(body.get("stream"))
        opts = body.get("stream_options")
        if opts is not None and not isinstance(opts, dict):
            raise web.HTTPBadRequest(text=_err("stream_options must be an object"), content_type="application/json")
        include_usage = bool((opts or {}).get("include_usage")) if stream else True
        spec = self._spec(body, words, request.headers)
        if spec.prompt_tokens + 1 > self.workload.engine.max_model_len:
            raise web.HTTPBadRequest(text=_err(
                f"prompt has {spec.prompt_tokens} tokens, more than max_model_len {self.workload.engine.max_model_len}"),
                content_type="application/json")
        q: Stream = asyncio.Queue()
        t_arrive = self.sim_now()
        if self.record is not None:
            self.record(RequestRecord(t_arrive, spec.id, "arrive", prompt_tokens=spec.prompt_tokens, cls=spec.cls,
                                      source="sim"))
        seq = self.engine.add(spec, max(t_arrive, self.engine.t), user=q)
        if seq.state == "done":  # rejected at admission: it could never fit in the KV cache
            raise web.HTTPBadRequest(text=_err(
                f"prompt of {spec.prompt_tokens} tokens does not fit in the KV cache "
                f"({self.workload.engine.capacity_tokens} tokens)"), content_type="application/json")
        self._streams.add(q)
        self._wake.set()
        model = self.workload.engine.model
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        done = False
        n = 0
        reason = "length"
        resp: web.StreamResponse | None = None
        try:
            if stream:
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
                await resp.prepare(request)
                if chat:
                    await resp.write(_sse({"id": spec.id, "object": obj, "created": created, "model": model,
                                           "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                        "logprobs": None, "finish_reason": None}]}))
            while True:
                kind, val = await q.get()
                if kind == "token":
                    n += 1
                    if stream:
                        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": None}
                        if chat:
                            choice["delta"] = {"content": " tok"}
                        else:
                            choice["text"] = " tok"
                        await resp.write(_sse({"id": spec.id, "object": obj, "created": created, "model": model,  # type: ignore[union-attr]
                                               "choices": [choice]}))
                    continue
                if kind == "shutdown":
                    if resp is not None:
                        await resp.write_eof()
                        return resp
                    raise web.HTTPServiceUnavailable(text=_err("server shutting down"),
                                                     content_type="application/json")
                reason = str(val)
                break
            done = True
            usage = {"prompt_tokens": spec.prompt_tokens, "completion_tokens": n,
                     "total_tokens": spec.prompt_tokens + n}
            if reason == "error":
                raise web.HTTPBadRequest(text=_err("request does not fit in the KV cache"),
                                         content_type="application/json")
            if not stream:
                choice = {"index": 0, "logprobs": None, "finish_reason": reason}
                if chat:
                    choice["message"] = {"role": "assistant", "content": " tok" * n}
                else:
                    choice["text"] = " tok" * n
                return web.json_response({"id": spec.id, "object": "chat.completion" if chat else "text_completion",
                                          "created": created, "model": model, "choices": [choice], "usage": usage})
            assert resp is not None
            last: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": reason}
            if chat:
                last["delta"] = {}
            else:
                last["text"] = ""
            await resp.write(_sse({"id": spec.id, "object": obj, "created": created, "model": model, "choices": [last]}))
            if include_usage:
                await resp.write(_sse({"id": spec.id, "object": obj, "created": created, "model": model,
                                       "choices": [], "usage": usage}))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        except ConnectionError:
            # The client hung up between two tokens (aiohttp raises ClientConnectionResetError,
            # a ConnectionResetError, before it cancels the handler): an ordinary end of a
            # stream, not a server error to log. aiohttp finishes a dead response quietly.
            return resp if resp is not None else web.Response(status=499)
        finally:
            self._streams.discard(q)
            if not done:
                # the client went away (handler cancelled or a write failed): abort in the engine
                self.engine.cancel(seq, max(self.sim_now(), self.engine.t))
                self._wake.set()

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.page.render().encode("utf-8"),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def _version(self, request: web.Request) -> web.Response:
        # vLLM's /version; the advisor takes the simulator's flags as those of the vLLM V1 it models
        return web.json_response({"version": SIM_VERSION})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _models(self, request: web.Request) -> web.Response:
        e = self.workload.engine
        return web.json_response({"object": "list", "data": [{
            "id": e.model, "object": "model", "created": int(time.time()), "owned_by": "kvtop-sim",
            "root": e.model, "max_model_len": e.max_model_len}]})


def _count(p: object) -> int:
    return len(p.split()) if isinstance(p, str) else (len(p) if isinstance(p, list) else 0)


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _err(msg: str) -> str:
    return json.dumps({"error": {"message": msg, "type": "BadRequestError", "code": 400}})


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError):
        raise web.HTTPBadRequest(text=_err("body is not valid JSON"), content_type="application/json") from None
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text=_err("body must be a JSON object"), content_type="application/json")
    return body
