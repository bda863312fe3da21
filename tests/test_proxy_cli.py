"""`kvtop proxy` as a user runs it: record to a file, stop on Ctrl-C, refuse bad addresses."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from pathlib import Path

import aiohttp
import pytest
from conftest import REPO, run_kvtop
from test_proxy import PROMPT_MARKER, ScriptedUpstream

from kvtop.model.trace import TraceReader
from kvtop.sources.proxy import parse_listen


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("workers", ["1", "2"])
async def test_proxy_command_records_and_stops_on_sigint(tmp_path: Path, workers: str):
    upstream = ScriptedUpstream()
    await upstream.start()
    port = _free_port()
    out = tmp_path / "p.jsonl"
    env = dict(os.environ, PYTHONPATH=str(REPO), XDG_CONFIG_HOME=str(tmp_path))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvtop", "proxy", "--listen", f"127.0.0.1:{port}", "--upstream", upstream.url,
        "--record", str(out), "--workers", workers, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env)
    try:
        for _ in range(200):
            try:
                _, w = await asyncio.open_connection("127.0.0.1", port)
                w.close()
                break
            except OSError:
                await asyncio.sleep(0.05)
        async with aiohttp.ClientSession() as s:
            async with s.post(f"http://127.0.0.1:{port}/v1/completions",
                              json={"model": "m", "prompt": PROMPT_MARKER, "stream": True, "script": "chat"},
                              headers={"X-Request-Id": "cli-1"}) as r:
                assert r.status == 200
                await r.read()
        proc.send_signal(signal.SIGINT)
        rc = await asyncio.wait_for(proc.wait(), 10)
    finally:
        if proc.returncode is None:
            proc.kill()
        await upstream.stop()
    err = (await proc.stderr.read()).decode()
    assert rc == 0, err
    # one summary line per request on stderr: tokens, time to first token, largest gap
    assert "cli-1 finish tokens=2 ttft=" in err
    reader = TraceReader(out)
    assert reader.header["engine"]["url"] == upstream.url
    assert [(r.id, r.event) for r in reader.records()] == [
        ("cli-1", "arrive"), ("cli-1", "first_token"), ("cli-1", "token"), ("cli-1", "finish")]
    assert PROMPT_MARKER not in out.read_text()


def test_proxy_command_bad_input(tmp_path: Path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for args, msg in (
            (["--upstream", "http://127.0.0.1:9", "--listen", f"127.0.0.1:{port}"], "cannot listen"),
            (["--upstream", "http://127.0.0.1:9", "--listen", "127.0.0.1:http"], "port"),
            (["--upstream", "ftp://127.0.0.1:8000"], "takes only http:// and https://"),
            (["--upstream", "http://127.0.0.1:9", "--listen", f"127.0.0.1:{port}", "--workers", "2"],
             "cannot listen"),
            (["--upstream", "http://127.0.0.1:9", "--workers", "0"], "--workers"),
            (["--upstream", "http://127.0.0.1:9", "--record", str(tmp_path / "no" / "x.jsonl")], "cannot write"),
        ):
            r = run_kvtop("proxy", *args, timeout=30)
            # a port already taken is a run failure (1); a wrong command line is usage (2)
            assert r.returncode == (1 if msg == "cannot listen" else 2), (args, r.stderr)
            assert len(r.stderr.strip().splitlines()) == 1 and msg in r.stderr, r.stderr


@pytest.mark.parametrize("text,want", [
    ("127.0.0.1:8001", ("127.0.0.1", 8001)), ("8002", ("127.0.0.1", 8002)), (":8003", ("127.0.0.1", 8003)),
    ("0.0.0.0:9000", ("0.0.0.0", 9000)), ("[::1]:8004", ("::1", 8004)), ("localhost", ("localhost", 8001)),
])
def test_listen_addresses(text: str, want: tuple[str, int]):
    assert parse_listen(text) == want


def test_default_listen_is_loopback():
    from kvtop.cli import build_parser

    args = build_parser().parse_args(["proxy", "--upstream", "http://127.0.0.1:8000"])
    assert parse_listen(args.listen)[0] == "127.0.0.1"
