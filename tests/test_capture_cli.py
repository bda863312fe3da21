"""`--capture` as a user meets it: the one-line answer without privileges, bad ports, and (with a
packet socket) a recorder that runs capture and proxy together without counting a request twice."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import aiohttp
import jsonschema
import pytest
from conftest import REPO

from testkit.privileges import can_capture, readable_kvtop


def _kvtop(*args: str, env_dir: Path, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), XDG_CONFIG_HOME=str(env_dir))
    return subprocess.run([*prefix, sys.executable, "-m", "kvtop", *args], capture_output=True, text=True,
                          env=env, timeout=60)


def _unprivileged() -> tuple[str, ...] | None:
    """A command prefix that runs without CAP_NET_RAW: as is for a normal user, else setpriv."""
    if os.geteuid() != 0 and not can_capture():
        return ()
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return None
    return (setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all", "--bounding-set=-net_raw")


def _readable_copy(shared: Path, prefix: tuple[str, ...]) -> str | None:
    """PYTHONPATH for `prefix`'s user: kvtop and its plugins copied into `shared`, which that user can
    read (a clone in a private folder, mode 0700 like many homes, is not), or None with the reason."""
    readable_kvtop(shared)
    probe = subprocess.run([*prefix, sys.executable, "-c", "import aiohttp, kvtop.cli"], capture_output=True, text=True,
                           env=dict(os.environ, PYTHONPATH=str(shared)), timeout=60)
    return str(shared) if probe.returncode == 0 else None


@pytest.mark.parametrize("command", [["record", "-o", "{tmp}/t.jsonl"], ["snapshot", "--duration", "1"]])
def test_without_privileges_one_line_how_to_grant_and_exit_2(tmp_path: Path, command: list[str]) -> None:
    prefix = _unprivileged()
    if prefix is None:
        pytest.skip("running as root without setpriv: cannot drop CAP_NET_RAW to test this")
    # a folder the unprivileged user can reach (pytest's own is private to root)
    shared = Path(tempfile.mkdtemp(prefix="kvtop-capture-"))
    try:
        os.chmod(shared, 0o777)
        path = _readable_copy(shared, prefix) if prefix else str(REPO)
        if path is None:
            pytest.skip(f"uid 65534 cannot run {sys.executable} (a virtual environment inside a private folder): "
                        "clone into a folder others can read (chmod o+rx on it and its parents) to run this test")
        args = [a.replace("{tmp}", str(shared)) for a in command]
        env = dict(os.environ, PYTHONPATH=path, XDG_CONFIG_HOME=str(shared))
        r = subprocess.run([*prefix, sys.executable, "-m", "kvtop", *args, "--url", "http://127.0.0.1:9", "--capture",
                            "--no-gpu", "--no-host"], capture_output=True, text=True, env=env, timeout=60)
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    assert r.returncode == 1, r.stderr  # the host refuses the capture: a run failure, not a usage error
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr
    assert "CAP_NET_RAW" in lines[0] and "setcap cap_net_raw" in lines[0] and "--proxy-listen" in lines[0]


@pytest.mark.parametrize("value", ["70000", "0", "http"])
def test_bad_capture_port_is_a_usage_error(tmp_path: Path, value: str) -> None:
    r = _kvtop("snapshot", "--url", "http://127.0.0.1:9", "--capture", value, env_dir=tmp_path)
    assert r.returncode == 2 and "--capture" in r.stderr and "Traceback" not in r.stderr


def test_capture_without_port_or_url_is_a_usage_error(tmp_path: Path) -> None:
    r = _kvtop("snapshot", "--no-gpu", "--capture", env_dir=tmp_path)
    assert r.returncode == 2 and "--capture without a PORT needs the engine's --url" in r.stderr


@pytest.mark.skipif(not can_capture(), reason="no packet capture here (needs root or CAP_NET_RAW)")
async def test_record_with_capture_and_proxy_counts_each_request_once(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO), XDG_CONFIG_HOME=str(tmp_path))
    out = tmp_path / "t.jsonl"
    sim = await asyncio.create_subprocess_exec(sys.executable, "-m", "kvtop", "sim-server", "--seed", "1",
                                               stdout=asyncio.subprocess.PIPE, env=env)
    rec = None
    try:
        assert sim.stdout is not None
        line = (await asyncio.wait_for(sim.stdout.readline(), 30)).decode()
        url = re.search(r"at (http://\S+) ", line)[1]  # type: ignore[index]
        rec = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvtop", "record", "-o", str(out), "--url", url, "--capture",
            "--proxy-listen", "127.0.0.1:0", "--no-gpu", "--no-host", "--interval", "0.5",
            stderr=asyncio.subprocess.PIPE, env=env)
        assert rec.stderr is not None
        what = (await asyncio.wait_for(rec.stderr.readline(), 30)).decode()
        purl = re.search(r"proxy (http://\S+) ", what)[1]  # type: ignore[index]
        await asyncio.sleep(0.3)
        body = {"model": "m", "prompt": "hello", "stream": True, "max_tokens": 12,
                "kvtop": {"prompt_tokens": 50, "output_tokens": 12}}
        async with aiohttp.ClientSession() as s:
            async def one(base: str, rid: str) -> None:
                async with s.post(base + "/v1/completions", json=body, headers={"X-Request-Id": rid}) as r:
                    assert r.status == 200
                    await r.read()

            await asyncio.gather(*(one(purl, f"via-proxy-{i}") for i in range(3)),
                                 *(one(url, f"direct-{i}") for i in range(2)))
        await asyncio.sleep(0.5)
        rec.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(rec.wait(), 20) == 0
        err = (await rec.stderr.read()).decode()
    finally:
        for p in (rec, sim):
            if p is not None and p.returncode is None:
                p.kill()
                await p.wait()
    assert "capture :" in err and "0 kernel drop(s), 0 hole(s)" in err
    recs = [json.loads(x) for x in out.read_text().splitlines()[1:]]
    reqs = [d for d in recs if d["kind"] == "request"]
    arrives = {d["id"]: d["source"] for d in reqs if d["event"] == "arrive"}
    # each request once: the proxied ones by the proxy (it recorded the arrive first), the direct
    # ones by the capture; nothing else (no scrape of /metrics is a request)
    assert arrives == {**{f"via-proxy-{i}": "proxy" for i in range(3)}, **{f"direct-{i}": "capture" for i in range(2)}}
    for rid in arrives:
        mine = [d for d in reqs if d["id"] == rid]
        assert [d["event"] for d in mine].count("finish") == 1
        assert sum(d.get("n", 0) for d in mine if d["event"] in ("first_token", "token")) == 12


def _has_packet_socket(pid: int) -> bool:
    """Whether process ``pid`` holds a packet socket that receives (its capture is listening: the
    R column; the socket exists unbound while its filter and ring are set up)."""
    try:
        rows = [ln.split() for ln in Path("/proc/net/packet").read_text().splitlines()[1:]]
        inodes = {f"socket:[{r[-1]}]" for r in rows if len(r) >= 9 and r[5] == "1"}
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(fd) in inodes:
                return True
        except OSError:
            continue
    return False


@pytest.mark.skipif(not can_capture(), reason="no packet capture here (needs root or CAP_NET_RAW)")
async def test_snapshot_with_capture_reports_the_live_requests(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO), XDG_CONFIG_HOME=str(tmp_path))
    sim = await asyncio.create_subprocess_exec(sys.executable, "-m", "kvtop", "sim-server", "--seed", "2",
                                               stdout=asyncio.subprocess.PIPE, env=env)
    try:
        assert sim.stdout is not None
        line = (await asyncio.wait_for(sim.stdout.readline(), 30)).decode()
        url = re.search(r"at (http://\S+) ", line)[1]  # type: ignore[index]
        snap = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvtop", "snapshot", "--url", url, "--capture", "--duration", "8",
            "--interval", "0.5", "--format", "json", "--no-gpu", "--no-host",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env)
        # send once its capture listens (a busy machine starts Python slowly; the deadline bounds a hang)
        held = 0  # on two polls in a row: not the short-lived socket its privilege check opens
        for _ in range(300):
            held = held + 1 if _has_packet_socket(snap.pid) else 0
            if held >= 2 or snap.returncode is not None:
                break
            await asyncio.sleep(0.1)
        assert _has_packet_socket(snap.pid), "the snapshot's capture never opened"
        body = {"model": "m", "prompt": "hello", "stream": True, "max_tokens": 20,
                "kvtop": {"prompt_tokens": 50, "output_tokens": 20}}
        async with aiohttp.ClientSession() as s:
            async def one(rid: str) -> None:
                async with s.post(url + "/v1/completions", json=body, headers={"X-Request-Id": rid}) as r:
                    await r.read()

            await asyncio.gather(*(one(f"snap-{i}") for i in range(3)))
        out, err = await asyncio.wait_for(snap.communicate(), 30)
    finally:
        if sim.returncode is None:
            sim.kill()
            await sim.wait()
    assert snap.returncode == 0, err.decode()
    doc = json.loads(out)
    jsonschema.validate(doc, json.loads((REPO / "kvtop" / "schemas" / "snapshot.schema.json").read_text()))
    cap = doc["capture"]
    assert cap["status"] == "ok" and cap["requests"] == 3 and cap["kernel_drops"] == 0, (cap, err.decode()[-1500:])
    seen = {r["id"]: r for r in doc["requests"]}
    assert set(seen) == {f"snap-{i}" for i in range(3)}
    assert all(r["source"] == "capture" and r["tokens"] == 20 and r["state"] == "finished" for r in seen.values())
