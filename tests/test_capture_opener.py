"""Privilege separation of the capture: an unprivileged kvtop gets its packet socket from
``kvtop-capture-python`` (a copy of the interpreter holding cap_net_raw as a file capability) running
``kvtop/sources/capture/opener.py``, which passes the descriptor back and exits; the process that
parses the engine's bytes holds no capability at all, and still captures every token.

Needs root (to set the file capability and drop to uid 65534), setpriv and setcap."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import REPO, wait_for_line

from testkit.privileges import NOBODY, SETPRIV, SYSTEM_PY, can_setcap, capture_interpreter, readable_install

pytestmark = pytest.mark.skipif(
    not can_setcap(),
    reason="needs Linux, root (to setcap a copy of the interpreter and drop to uid 65534), setpriv, setcap and "
           f"{SYSTEM_PY}")


def _unprivileged(*extra: str) -> list[str]:
    """uid 65534 with no capability in any set it could use (NET_RAW stays only in the bounding
    set, as in a pod that adds NET_RAW: the file capability of the copy needs it there)."""
    assert SETPRIV is not None
    return [SETPRIV, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--inh-caps=-all",
            "--ambient-caps=-all", "--bounding-set=-all,+net_raw", *extra]


# how each deployment starts the capture: (command prefix, needs the copy on PATH)
#  spawn: a user's shell; unprivileged kvtop runs kvtop-capture-python to open the socket for it
#  sidecar: the pod's no_new_privs (allowPrivilegeEscalation: false) keeps a child of an unprivileged
#    process from gaining a file capability, so the copy is the entrypoint: opener --exec, then kvtop
#  unit: systemd's AmbientCapabilities=CAP_NET_RAW + NoNewPrivileges: the plain interpreter runs
#    opener --exec, which drops the capability before it becomes kvtop
MODES = ["spawn", "sidecar", "unit"]


def _start(mode: str, bin_dir: Path, app: Path) -> list[str]:
    py = str(SYSTEM_PY)
    opener = str(app / "kvtop" / "sources" / "capture" / "opener.py")
    if mode == "spawn":
        return [*_unprivileged(), py, "-m", "kvtop"]
    if mode == "sidecar":
        return [*_unprivileged("--no-new-privs"), str(bin_dir / "kvtop-capture-python"), "-I", opener, "--exec",
                "{port}", "--", py, "-m", "kvtop"]
    assert SETPRIV is not None
    return [SETPRIV, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--inh-caps=-all,+net_raw",
            "--ambient-caps=-all,+net_raw", "--bounding-set=-all,+net_raw", "--no-new-privs", py, "-I", opener,
            "--exec", "{port}", "--", py, "-m", "kvtop"]


@pytest.fixture(scope="module")
def install() -> Iterator[tuple[Path, str]]:
    """(folder holding kvtop-capture-python, PYTHONPATH whose first entry holds kvtop), all readable
    by uid 65534."""
    root = Path(tempfile.mkdtemp(prefix="kvtop-opener-"))
    try:
        os.chmod(root, 0o755)
        path = readable_install(root)
        bin_dir = root / "bin"
        bin_dir.mkdir(mode=0o755)
        capture_interpreter(bin_dir / "kvtop-capture-python")
        probe = subprocess.run([*_unprivileged(), str(SYSTEM_PY), "-c", "import aiohttp, kvtop.cli"],
                               env={"PYTHONPATH": path}, capture_output=True, text=True, timeout=60)
        if probe.returncode != 0:
            pytest.skip(f"uid {NOBODY} cannot import kvtop's dependencies from {path} (a private clone or "
                        f"virtual environment: make it readable to others): {probe.stderr[-300:]}")
        yield bin_dir, path
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _status(pid: int) -> dict[str, str]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        out[k] = v.strip()
    return out


def _packet_socket_inodes(pid: int) -> set[str]:
    """The packet sockets ``pid`` holds that receive (the R column: one exists unbound while its
    filter and ring are set up)."""
    rows = [ln.split() for ln in Path("/proc/net/packet").read_text().splitlines()[1:]]
    inodes = {f"socket:[{r[-1]}]" for r in rows if len(r) >= 9 and r[5] == "1"}
    held = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link in inodes:
            held.add(link)
    return held


@pytest.mark.parametrize("mode", MODES)
def test_an_unprivileged_parser_captures_every_token_through_the_opener(install: tuple[Path, str], mode: str) -> None:
    bin_dir, path = install
    app = Path(path.split(os.pathsep)[0])
    if mode == "spawn" and _status(os.getpid()).get("NoNewPrivs") == "1":
        pytest.skip("this test runs under no_new_privs (a container started with it?): a child of the "
                    "unprivileged kvtop cannot gain the copy's file capability; the sidecar and unit modes cover --exec")
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    sim = subprocess.Popen([sys.executable, "-m", "kvtop", "sim-server", "--port", "0", "--seed", "5"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    snap = None
    try:
        m = wait_for_line(sim.stdout, r"at (http://127\.0\.0\.1:(\d+))")
        url, port = m.group(1), m.group(2)
        start = [a.replace("{port}", port) for a in _start(mode, bin_dir, app)]
        snap = subprocess.Popen(
            [*start, "snapshot", "--url", url, "--capture", "--duration", "10",
             "--interval", "0.5", "--format", "json", "--no-gpu", "--no-host"],
            env={"PYTHONPATH": path, "PATH": f"{bin_dir}:/usr/bin:/bin", "XDG_CONFIG_HOME": "/nonexistent",
                 "PYTHONUNBUFFERED": "1"},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        held: set[str] = set()
        # held twice in a row: not the short-lived socket of its privilege check. A start-up on a
        # loaded box can take tens of seconds; the bound only stops a hung run.
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and snap.poll() is None:
            now = _packet_socket_inodes(snap.pid)
            if now and now == held:
                break
            held = now
            time.sleep(0.1)
        assert snap.poll() is None, f"the snapshot exited ({snap.returncode}): {snap.stderr.read() if snap.stderr else ''}"
        assert held, "the snapshot never held a packet socket"
        st = _status(snap.pid)
        # the process that reads and parses the engine's bytes: no capability, not root
        assert st["CapEff"] == st["CapPrm"] == st["CapInh"] == st["CapAmb"] == "0" * 16, st
        assert st["Uid"].split()[:2] == [str(NOBODY)] * 2
        body = {"model": "m", "prompt": "hello", "stream": True, "max_tokens": 15,
                "kvtop": {"prompt_tokens": 40, "output_tokens": 15}}
        with httpx.Client(timeout=30) as c:
            for i in range(3):
                with c.stream("POST", url + "/v1/completions", json=body, headers={"X-Request-Id": f"sep-{i}"}) as r:
                    assert r.status_code == 200
                    r.read()
        out, err = snap.communicate(timeout=60)
    finally:
        for p in (snap, sim):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    assert snap.returncode == 0, err[-1500:]
    doc = json.loads(out)
    cap = doc["capture"]
    assert cap["status"] == "ok" and cap["requests"] == 3 and cap["kernel_drops"] == 0, cap
    seen = {r["id"]: r for r in doc["requests"]}
    assert set(seen) == {f"sep-{i}" for i in range(3)}
    assert all(r["source"] == "capture" and r["tokens"] == 15 and r["state"] == "finished" for r in seen.values())


def test_an_opener_without_the_capability_says_so_and_runs_nothing(install: tuple[Path, str]) -> None:
    _, path = install
    opener = Path(path.split(os.pathsep)[0]) / "kvtop" / "sources" / "capture" / "opener.py"
    r = subprocess.run([*_unprivileged("--no-new-privs"), str(SYSTEM_PY), "-I", str(opener), "--exec", "8000", "--",
                        "/bin/echo", "ran"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "ran" not in r.stdout
    [line] = r.stderr.strip().splitlines()
    assert "cannot open the packet socket for port 8000" in line and "CAP_NET_RAW" in line


def test_without_the_privileged_copy_the_one_line_how_to_grant(install: tuple[Path, str]) -> None:
    _, path = install
    r = subprocess.run([*_unprivileged(), str(SYSTEM_PY), "-m", "kvtop", "record", "-o", "/dev/null", "--url",
                        "http://127.0.0.1:9", "--capture", "--no-gpu", "--no-host"],
                       env={"PYTHONPATH": path, "PATH": "/usr/bin:/bin", "XDG_CONFIG_HOME": "/nonexistent"},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    [line] = r.stderr.strip().splitlines()
    assert "CAP_NET_RAW" in line and "setcap cap_net_raw+ep /usr/local/bin/kvtop-capture-python" in line


def test_a_copy_that_lacks_the_capability_gives_the_same_line(install: tuple[Path, str], tmp_path: Path) -> None:
    """An interpreter named kvtop-capture-python without the file capability: the opener cannot open
    the socket, says so over the socket pair, and kvtop prints the how-to line (exit 1)."""
    _, path = install
    plain = tmp_path / "bin"
    plain.mkdir()
    shutil.copy2(SYSTEM_PY, plain / "kvtop-capture-python")
    os.chmod(tmp_path, 0o755)
    os.chmod(plain, 0o755)
    r = subprocess.run([*_unprivileged(), str(SYSTEM_PY), "-m", "kvtop", "snapshot", "--url", "http://127.0.0.1:9",
                        "--capture", "--no-gpu", "--no-host", "--duration", "1"],
                       env={"PYTHONPATH": path, "PATH": f"{plain}:/usr/bin:/bin", "XDG_CONFIG_HOME": "/nonexistent"},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    [line] = r.stderr.strip().splitlines()
    assert "CAP_NET_RAW" in line and "kvtop-capture-python" in line


def test_the_passed_socket_cannot_be_widened_to_other_ports(install: tuple[Path, str]) -> None:
    """The opener locks the port's filter: the unprivileged holder of the descriptor cannot detach
    or replace it to read the rest of the host's traffic."""
    bin_dir, path = install
    if _status(os.getpid()).get("NoNewPrivs") == "1":
        pytest.skip("this test runs under no_new_privs: a child cannot gain the copy's file capability")
    code = (
        "import socket\n"
        "from kvtop.sources.capture.packets import PacketSocket\n"
        "s = PacketSocket(8000, ring=False)\n"
        "assert s.opened_by == 'kvtop-capture-python', s.opened_by\n"
        "for opt, val in ((27, 0), (26, bytes(16))):  # SO_DETACH_FILTER, SO_ATTACH_FILTER\n"
        "    try:\n"
        "        s.sock.setsockopt(socket.SOL_SOCKET, opt, val)\n"
        "    except PermissionError:\n"
        "        print('refused', opt)\n"
    )
    r = subprocess.run([*_unprivileged(), str(SYSTEM_PY), "-c", code],
                       env={"PYTHONPATH": path, "PATH": f"{bin_dir}:/usr/bin:/bin"},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert re.findall(r"refused (\d+)", r.stdout) == ["27", "26"]


def test_an_exec_opener_for_another_port_is_named_in_the_error(install: tuple[Path, str]) -> None:
    bin_dir, path = install
    app = Path(path.split(os.pathsep)[0])
    start = [a.replace("{port}", "8001") for a in _start("sidecar", bin_dir, app)]
    r = subprocess.run([*start, "snapshot", "--url", "http://127.0.0.1:9", "--capture", "8002", "--no-gpu", "--no-host",
                        "--duration", "1"], env={"PYTHONPATH": path, "PATH": "/usr/bin:/bin",
                                                 "XDG_CONFIG_HOME": "/nonexistent"},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    [line] = r.stderr.strip().splitlines()
    assert "opened port 8001, not 8002" in line

