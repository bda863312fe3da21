"""`kvtop record` as a user runs it: a subprocess against a fake vLLM engine, killed or stopped.

The fake engine serves the real vLLM 0.32.0 capture (with a rising generation counter) and a
streaming /v1/completions; it can go down and come back with reset counters.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import jsonschema
import numpy as np
import pytest
from aiohttp import web
from conftest import REPO, run_kvtop
from local_server import serve
from replay_server import PROM, replay_server
from vllm_pages import vllm_page

from kvtop.analysis import fastscan
from kvtop.model import token_columns as TC
from kvtop.model.trace import TraceReader

TOKENS_PER_STREAM = 10
TOKEN_EVERY_S = 0.02


class FakeEngine:
    def __init__(self) -> None:
        self.generation = 1000.0
        self.down = False
        self.scrapes: list[tuple[float, float]] = []  # (monotonic time served, generation counter)
        self.refused = 0  # scrapes answered 503 while down
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._complete)
        self._runner, self.port = await serve(app)

    async def stop(self) -> None:
        if self._runner:
            await self._runner.cleanup()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _metrics(self, request: web.Request) -> web.Response:
        if self.down:
            self.refused += 1
            return web.Response(status=503, text="engine restarting")
        self.generation += 50
        self.scrapes.append((time.monotonic(), self.generation))
        return web.Response(text=vllm_page(generation=self.generation, running=1), content_type="text/plain")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "tiny-llama"}]})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = int(body.get("max_tokens", TOKENS_PER_STREAM))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i in range(n):
                await asyncio.sleep(TOKEN_EVERY_S)
                await resp.write(b'data: {"choices":[{"index":0,"text":"secret-completion-%d",'
                                 b'"finish_reason":null}]}\n\n' % i)
            await resp.write(b'data: {"choices":[{"index":0,"text":"","finish_reason":"length"}]}\n\n'
                             b'data: [DONE]\n\n')
            await resp.write_eof()
        except ConnectionResetError:
            pass  # the recorder was killed mid-stream
        return resp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _start_recorder(out: Path, engine: FakeEngine, proxy_port: int, *extra: str
                          ) -> asyncio.subprocess.Process:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["XDG_CONFIG_HOME"] = str(REPO / ".cache" / "no-config")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvtop", "record", "-o", str(out), "--url", engine.url, "--no-gpu", "--no-host",
        "--proxy-listen", f"127.0.0.1:{proxy_port}", *extra,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env)
    # ready once the proxy accepts connections
    for _ in range(200):
        try:
            _, w = await asyncio.open_connection("127.0.0.1", proxy_port)
            w.close()
            return proc
        except OSError:
            if proc.returncode is not None:
                raise AssertionError((await proc.stderr.read()).decode()) from None
            await asyncio.sleep(0.05)
    raise AssertionError("recorder did not start")


async def _client_loop(proxy_port: int, done: list[tuple[str, float]], stop: asyncio.Event) -> None:
    """Streams one request after another through the proxy; notes when each one fully arrived."""
    i = 0
    async with aiohttp.ClientSession() as s:
        while not stop.is_set():
            rid = f"client-{i}"
            i += 1
            try:
                async with s.post(f"http://127.0.0.1:{proxy_port}/v1/completions",
                                  json={"model": "tiny-llama", "prompt": "secret-prompt", "stream": True,
                                        "max_tokens": TOKENS_PER_STREAM},
                                  headers={"X-Request-Id": rid, "Authorization": "Bearer secret-auth"}) as r:
                    await r.read()
                done.append((rid, time.monotonic()))
            except aiohttp.ClientError:
                return


async def _until(done: Callable[[], bool], what: str, deadline_s: float = 30.0) -> None:
    """Wait for ``done()``; the deadline bounds a hang only (a busy machine is merely slower)."""
    end = time.monotonic() + deadline_s
    while not done():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def _read(path: Path) -> tuple[list[dict], TraceReader]:
    reader = TraceReader(path)
    return list(reader.dicts()), reader


async def test_sigkill_loses_nothing_before_the_last_flush(tmp_path: Path):
    engine = FakeEngine()
    await engine.start()
    out = tmp_path / "trace.jsonl"
    port = _free_port()
    proc = await _start_recorder(out, engine, port, "--interval", "0.1")
    done: list[tuple[str, float]] = []
    stop = asyncio.Event()
    client = asyncio.create_task(_client_loop(port, done, stop))

    def on_disk() -> tuple[int, set[str]]:
        recs = [json.loads(x) for x in out.read_text().splitlines()[1:] if x.endswith("}")]
        return (sum(r["kind"] == "engine" and r["up"] for r in recs),
                {r["id"] for r in recs if r["kind"] == "request" and r["event"] == "finish"})

    try:
        await _until(lambda: len(done) >= 3, "3 streams")
        early = [rid for rid, _ in done]
        # the recorder writes on its own while it runs (at least once a second), with no stop to
        # flush it: wait until the file holds 10 scrapes and those streams (the deadline bounds a hang
        # only) ...
        await _until(lambda: on_disk()[0] >= 10 and set(early) <= on_disk()[1], "the periodic flush")
        flushed = out.read_bytes()
        flushed = flushed[: flushed.rfind(b"\n") + 1]
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
    finally:
        stop.set()
        await asyncio.gather(client, return_exceptions=True)
        await engine.stop()
    assert proc.returncode == -signal.SIGKILL

    # ... and a SIGKILL after that loses none of it: every line that was on disk, every stream whole
    assert out.read_bytes().startswith(flushed)
    recs, reader = _read(out)
    assert reader.header["engine"]["adapter"] == "vllm" and reader.header["engine"]["model"] == "tiny-llama"
    served = {g for _, g in engine.scrapes}
    engine_gens = [r["generation_tokens_total"] for r in recs if r["kind"] == "engine" and r["up"]]
    assert len(engine_gens) >= 10 and set(engine_gens) <= served  # what the engine said, nothing made up
    finished = {r["id"]: r for r in recs if r["kind"] == "request" and r["event"] == "finish"}
    for rid in early:
        assert rid in finished
        toks = [r for r in recs if r["kind"] == "request" and r["id"] == rid and r["event"] in ("first_token", "token")]
        assert sum(r["n"] for r in toks) == TOKENS_PER_STREAM
    text = out.read_text()
    assert "secret" not in text
    _same_with_and_without_sidecar(out, whole=False)

    # A crash that lands mid-line leaves a torn last line: skipped with a warning, the rest intact.
    torn = tmp_path / "torn.jsonl"
    raw = out.read_bytes().rstrip(b"\n")
    torn.write_bytes(raw[: raw.rfind(b"\n") + 1] + raw[raw.rfind(b"\n") + 1:][:25])
    recs2, reader2 = _read(torn)
    assert reader2.skipped == 1 and len(recs2) == len(recs) - 1
    r = run_kvtop("replay", str(torn), "--headless", "--format", "json")
    assert r.returncode == 0, r.stderr
    assert "skipped 1 malformed line" in r.stderr
    snap = json.loads(r.stdout)
    assert snap["engines"][0]["model"] == "tiny-llama"


@pytest.mark.parametrize("workers", ["1", "2"])
async def test_sigterm_stops_cleanly_with_everything_flushed(tmp_path: Path, workers: str):
    engine = FakeEngine()
    await engine.start()
    out = tmp_path / "trace.jsonl"
    port = _free_port()
    proc = await _start_recorder(out, engine, port, "--interval", "0.1", "--proxy-workers", workers)
    async with aiohttp.ClientSession() as s:
        try:
            await _until(lambda: len(engine.scrapes) >= 3, "3 scrapes")
            engine.down = True  # the engine restarts: scrapes fail ...
            await _until(lambda: engine.refused >= 2, "2 refused scrapes")
            engine.generation = 0  # ... and it comes back with its counters reset
            engine.down = False
            back = len(engine.scrapes)
            await _until(lambda: len(engine.scrapes) >= back + 3, "3 scrapes after the restart")
            # a long stream is still running when the recorder is told to stop
            r = await s.post(f"http://127.0.0.1:{port}/v1/completions",
                             json={"model": "m", "prompt": "p", "stream": True, "max_tokens": 500},
                             headers={"X-Request-Id": "inflight"})
            await r.content.readany()
            await asyncio.sleep(0.1)
            proc.send_signal(signal.SIGTERM)
            rc = await asyncio.wait_for(proc.wait(), 10)
            r.close()
        finally:
            if proc.returncode is None:
                proc.kill()
            await engine.stop()
    assert rc == 0, (await proc.stderr.read()).decode()
    assert out.read_bytes().endswith(b"\n")
    recs, reader = _read(out)
    assert reader.skipped == 0
    # every line is strict JSON (no NaN/Infinity) and valid against the documented schema
    schema = json.loads((REPO / "kvtop" / "schemas" / "trace.schema.json").read_text())
    validator = jsonschema.Draft202012Validator(schema)
    for line in out.read_text().splitlines():
        d = json.loads(line, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
        assert not list(validator.iter_errors(d)), d
    eng = [r for r in recs if r["kind"] == "engine"]
    up_gens = [r["generation_tokens_total"] for r in eng if r["up"]]
    # every scrape the engine answered is in the trace (the one in flight at SIGTERM may not be)
    assert len(up_gens) >= len(engine.scrapes) - 1
    assert [g for _, g in engine.scrapes][: len(up_gens)] == up_gens
    # the engine-down and counter-reset evidence is in the trace
    assert any(not r["up"] for r in eng)
    assert any(b < a for a, b in zip(up_gens, up_gens[1:], strict=False))
    # the stream cut off by the stop is closed in the trace, not left open
    inflight = [r["event"] for r in recs if r["kind"] == "request" and r["id"] == "inflight"]
    assert inflight[0] == "arrive" and inflight[-1] == "cancel" and "first_token" in inflight
    _same_with_and_without_sidecar(out, whole=True)


def _same_with_and_without_sidecar(out: Path, whole: bool) -> None:
    """The token sidecar written beside the trace is read (all of it after a clean stop; up to its
    last flush after a SIGKILL) and `kvtop analyze` prints the same with it as without it."""
    cols, note = fastscan.open_columns(str(out))
    assert cols is not None and note is None
    assert cols.covered == out.stat().st_size if whole else 0 < cols.covered <= out.stat().st_size
    with open(cols.side, "rb") as g:
        assert int(np.count_nonzero(fastscan._records(g.fileno(), 0, cols.count)["kind"] == TC.TOKEN)) > 0
    with_it = run_kvtop("analyze", str(out), "--format", "json")
    Path(str(out) + TC.SUFFIX).unlink()
    without = run_kvtop("analyze", str(out), "--format", "json")
    assert with_it.returncode == 0 and without.returncode == 0, with_it.stderr + without.stderr
    assert with_it.stdout == without.stdout


async def test_idle_recorder_still_flushes(tmp_path: Path):
    engine = FakeEngine()
    await engine.start()
    out = tmp_path / "trace.jsonl"
    port = _free_port()
    proc = await _start_recorder(out, engine, port, "--interval", "30")
    try:
        # the first scrape reaches the file with no second scrape and no stop to push it out (30 s
        # interval; the flush is due within a second, the deadline only bounds a hang)
        await _until(lambda: '"kind":"engine"' in out.read_text().replace(" ", ""), "the first scrape on disk")
        kinds = [json.loads(x)["kind"] for x in out.read_text().splitlines()]
        assert kinds[0] == "header" and "engine" in kinds
    finally:
        proc.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
        await engine.stop()


def test_record_bad_arguments(tmp_path: Path):
    existing = tmp_path / "old.jsonl"
    existing.write_text('{"kind":"header","format":"kvtop-trace","version":1}\n')
    for args, msg in (
        (["-o", str(tmp_path / "t.jsonl")], "--url"),
        (["-o", str(tmp_path / "no" / "dir" / "t.jsonl"), "--url", "http://127.0.0.1:9", "--no-gpu",
          "--no-host", "--timeout", "0.2"], "cannot write"),
        (["-o", str(tmp_path / "t.jsonl"), "--url", "http://127.0.0.1:9", "--proxy-listen", "x:y"], "port"),
        (["-o", str(tmp_path / "t.jsonl"), "--url", "http://127.0.0.1:9", "--proxy-listen", "nonsense"], "no such host"),
        (["-o", str(tmp_path / "t.jsonl"), "--url", "ftp://h", "--no-gpu"], "http"),
        (["-o", str(tmp_path / "t.jsonl"), "--url", "http://127.0.0.1:9", "--probe", "-1"], "--probe"),
        (["-o", str(existing), "--url", "http://127.0.0.1:9"], "already exists"),
    ):
        r = run_kvtop("record", *args, timeout=30)
        assert r.returncode == 2, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and msg in r.stderr, r.stderr


def test_a_proxy_port_in_use_fails_the_run_and_leaves_no_trace_to_block_the_retry(tmp_path: Path):
    """The engine answers, the proxy's port is taken: exit 1 in one line, and neither the trace (its
    header and first scrape) nor its token sidecar is left, so the same command runs once the port
    is free, without --force."""
    out = tmp_path / "t.jsonl"
    with replay_server({"/metrics": (vllm_page(generation=5), PROM)}) as (base, _), socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = run_kvtop("record", "-o", str(out), "--url", base, "--duration", "0.5", "--no-gpu", "--no-host",
                      "--proxy-listen", f"127.0.0.1:{port}", timeout=60)
        assert r.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert not out.exists() and not Path(str(out) + ".tokens").exists()


def test_a_device_as_output_gets_no_sidecar_beside_it(tmp_path: Path):
    # -o /dev/null (a run only for its OTLP export, say): the token sidecar was created beside the
    # device (/dev/null.tokens, as root) and the closing fsync of a device failed the run
    link = tmp_path / "sink"
    link.symlink_to("/dev/null")
    with replay_server({"/metrics": (vllm_page(generation=5), PROM)}) as (base, _):
        r = run_kvtop("record", "-o", str(link), "--url", base, "--duration", "0.4", "--interval", "0.2",
                      "--no-gpu", "--no-host", timeout=60)
    assert r.returncode == 0 and "record(s) written" in r.stderr, r.stderr
    assert not Path(str(link) + ".tokens").exists()
