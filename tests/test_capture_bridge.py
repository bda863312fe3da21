"""Passive capture of an engine behind a bridge, as on a host whose engine runs in a container.

Docker's default network puts the container's end of a veth pair in its own network namespace and
the host's end on a bridge that holds the host's address on that network. kvtop on the host opens
one packet socket on every interface, so each packet of the engine's traffic passes it twice: once
on the bridge, once on the veth. The Ethernet path also differs from loopback's: a 1500-byte MTU,
segmentation offloads handing over packets larger than the MTU, and no loopback copy to drop.

The test builds that topology (a namespace, a veth pair, a bridge), serves the simulated engine
inside the namespace, streams to it from the host and captures on the host: every stream once,
every token once (not twice), no holes, the cancel seen. Needs root with ``ip netns`` (CI runs as
root); skipped otherwise.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator

import aiohttp
import pytest
from conftest import REPO

from kvtop.sources.capture import CaptureUnavailable, check_capture
from tests.capture_run import capturing

PROMPT = "bridge-capture prompt: never in any record 91c2"
STREAMS = 12
OUTPUT = 300  # several MTU-sized segments' worth of SSE per stream, many chunks per segment at times
TAG = f"kvt{os.getpid() % 100000}"
HOST_IP, ENGINE_IP = "10.213.77.1", "10.213.77.2"


def _why_not() -> str | None:
    if sys.platform != "linux" or os.geteuid() != 0:
        return "needs root on Linux (network namespaces)"
    if shutil.which("ip") is None:
        return "needs iproute2's ip"
    try:
        check_capture(1)
    except CaptureUnavailable as e:
        return str(e)
    return None


pytestmark = pytest.mark.skipif(_why_not() is not None, reason=f"{_why_not()}")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def _kernel_retransmits(ns: str | None) -> int:
    """TCP segments the kernel retransmitted in a network namespace (None: the host's)."""
    cmd = ["cat", "/proc/net/snmp"] if ns is None else ["ip", "netns", "exec", ns, "cat", "/proc/net/snmp"]
    lines = [ln.split() for ln in subprocess.run(cmd, check=True, capture_output=True, text=True,
                                                 timeout=10).stdout.splitlines() if ln.startswith("Tcp:")]
    return int(lines[1][lines[0].index("RetransSegs")])


@pytest.fixture
def bridged_namespace() -> Iterator[str]:
    """A namespace whose veth end is bridged to the host at HOST_IP, as Docker's bridge network does."""
    ns, br, veth_host, veth_ns = TAG, f"{TAG}br", f"{TAG}h", f"{TAG}n"
    try:
        _ip("netns", "add", ns)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot make a network namespace here: {e.stderr.decode().strip()}")
    try:
        _ip("link", "add", br, "type", "bridge")
        _ip("link", "add", veth_host, "type", "veth", "peer", "name", veth_ns)
        _ip("link", "set", veth_ns, "netns", ns)
        _ip("link", "set", veth_host, "master", br)
        _ip("addr", "add", f"{HOST_IP}/24", "dev", br)
        for dev in (br, veth_host):
            _ip("link", "set", dev, "up")
        _ip("netns", "exec", ns, "ip", "addr", "add", f"{ENGINE_IP}/24", "dev", veth_ns)
        _ip("netns", "exec", ns, "ip", "link", "set", veth_ns, "up")
        _ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        yield ns
    finally:
        for args in (("link", "del", veth_host), ("link", "del", br), ("netns", "del", ns)):
            subprocess.run(["ip", *args], capture_output=True, timeout=10)


async def test_capture_counts_each_token_once_across_bridge_and_veth(bridged_namespace: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    sim = await asyncio.create_subprocess_exec(
        "ip", "netns", "exec", bridged_namespace, sys.executable, "-m", "kvtop", "sim-server",
        "--preset", "healthy", "--host", ENGINE_IP, stdout=asyncio.subprocess.PIPE, env=env)
    received: dict[str, int] = {}
    retrans_before = _kernel_retransmits(bridged_namespace) + _kernel_retransmits(None)
    try:
        assert sim.stdout is not None
        line = (await asyncio.wait_for(sim.stdout.readline(), 30)).decode()
        m = re.search(r"at (http://\S+) ", line)
        assert m, line
        url = m[1]
        port = int(url.rsplit(":", 1)[1])
        async with capturing(port, settle_s=0.2) as (got, cap):
            async def one(s: aiohttp.ClientSession, i: int) -> None:
                rid = f"br-{i}"
                body = {"model": "m", "prompt": PROMPT, "stream": True, "max_tokens": OUTPUT,
                        "kvtop": {"prompt_tokens": 200, "output_tokens": OUTPUT}}
                async with s.post(url + "/v1/completions", json=body, headers={"X-Request-Id": rid}) as r:
                    assert r.status == 200
                    n = 0
                    async for raw in r.content:
                        if raw.startswith(b"data: {") and json.loads(raw[6:])["choices"][0].get("text"):
                            n += 1
                            if i == 0 and n == 20:  # the client leaves
                                break
                    received[rid] = n

            async with aiohttp.ClientSession() as s:
                await asyncio.wait_for(asyncio.gather(*(one(s, i) for i in range(STREAMS))), 90)
            await asyncio.sleep(0.5)
        retransmitted = _kernel_retransmits(bridged_namespace) + _kernel_retransmits(None) - retrans_before
    finally:
        sim.terminate()
        await sim.wait()

    ids = {f"br-{i}" for i in range(STREAMS)}
    assert {r.id for r in got} == ids
    arrivals = [r.id for r in got if r.event == "arrive"]
    assert sorted(arrivals) == sorted(ids)  # each request once, though both interfaces carried it
    for rid in ids:
        tokens = sum(r.n or 1 for r in got if r.id == rid and r.event in ("first_token", "token"))
        if rid == "br-0":
            assert received[rid] <= tokens <= received[rid] + 5, (tokens, received[rid])
        else:
            assert tokens == received[rid] == OUTPUT, (rid, tokens, received[rid])
    ends = {r.id: r.event for r in got if r.event in ("finish", "cancel", "error")}
    assert ends == {**{rid: "finish" for rid in ids}, "br-0": "cancel"}
    assert not any(r.event == "resync" or r.incomplete for r in got)
    st = cap.stats
    assert st.kernel_drops == 0 and st.holes == 0
    # the second sighting of every packet is a copy: not a retransmission, not another connection.
    # A loaded host may really retransmit (a tail-loss probe after a late ack), and the kernel counts
    # those: kvtop may call no more segments retransmissions than the two namespaces' kernels sent.
    assert st.connections == STREAMS
    assert st.retransmits <= retransmitted, (st.retransmits, retransmitted)
    assert st.copies > 0.45 * st.packets, st  # (FINs and SYN-ACKs seen twice are not counted)
    assert all(PROMPT not in repr(r) for r in got)
