"""The capture deployments' privileges, reproduced on this host. The sidecar
(deploy/kubernetes/kvtop-sidecar.yaml): its own arguments, uid 10001's stand-in 65534, no_new_privs,
a bounding set of NET_RAW alone, exec'ing a copy of the interpreter that carries cap_net_raw as a
file capability (the Containerfile's kvtop-capture-python). The systemd capture unit
(deploy/systemd/kvtop-agent-capture.service): its ExecStart arguments, a dynamic user's stand-in
65534, no_new_privs, NET_RAW as the ambient and only bounding capability, the plain interpreter.
Each captures a simulated vLLM on loopback (the pod's shared network namespace, or the host's), and
a preemption storm must come out as non-zero spike counters. The probing DaemonSet runs with no
capability at all and must observe its canaries. Needs root (to set the file capability and drop to
another user)."""

from __future__ import annotations

import asyncio
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from conftest import REPO, wait_for_line
from prometheus_client.parser import text_string_to_metric_families

from kvtop.sim.loadgen import run_load
from kvtop.sim.workload import load_preset
from testkit.privileges import NOBODY, SETPRIV, SYSTEM_PY, can_setcap, capture_interpreter, readable_install

pytestmark = pytest.mark.skipif(
    not can_setcap(),
    reason="needs Linux, root, setpriv, setcap and a system python of this version")


def _sidecar_args() -> list[str]:
    [dep] = [d for d in yaml.safe_load_all((REPO / "deploy" / "kubernetes" / "kvtop-sidecar.yaml").read_text()) if d]
    [c] = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "kvtop-agent"]
    return list(c["args"])


def _sidecar_command() -> list[str]:
    [dep] = [d for d in yaml.safe_load_all((REPO / "deploy" / "kubernetes" / "kvtop-sidecar.yaml").read_text()) if d]
    [c] = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "kvtop-agent"]
    return list(c["command"])


def _unit_command() -> list[str]:
    unit = (REPO / "deploy" / "systemd" / "kvtop-agent-capture.service").read_text()
    [line] = [ln for ln in unit.splitlines() if ln.startswith("ExecStart=")]
    argv = shlex.split(line.split("=", 1)[1])
    return argv[:argv.index("agent")]


def _opener_here(command: list[str], port: str, cap: Path, plain: Path, path: str) -> list[str]:
    """A deployment's command (the opener --exec, then kvtop) on this host: its interpreter (the
    image's kvtop-capture-python, the unit's plain one), the opener by path (``-I`` ignores the
    PYTHONPATH that stands in for the installed package here), this engine's port, kvtop run by the
    plain interpreter."""
    exe, *rest = command
    assert rest[:5] == ["-I", "-m", "kvtop.sources.capture.opener", "--exec", "8000"] and rest[5] == "--", command
    here = cap if exe == "kvtop-capture-python" else plain
    opener = Path(path.split(os.pathsep)[0]) / "kvtop" / "sources" / "capture" / "opener.py"
    assert rest[6].endswith("kvtop") and len(rest) == 7, command
    return [str(here), "-I", str(opener), "--exec", port, "--", str(plain), "-m", "kvtop"]


def _unit_args() -> list[str]:
    unit = (REPO / "deploy" / "systemd" / "kvtop-agent-capture.service").read_text()
    [line] = [ln for ln in unit.splitlines() if ln.startswith("ExecStart=")]
    argv = shlex.split(line.split("=", 1)[1])
    return argv[argv.index("agent"):]


def _here(args: list[str], url: str, port: str) -> list[str]:
    """A deployment's agent arguments pointed at this test's engine: its URL and port for the
    engine's 8000, loopback port 0 for /metrics, no trace directory (the pod's emptyDir, the unit's
    StateDirectory)."""
    out: list[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
            continue
        if a == "--trace-dir":
            skip = True
            continue
        if a.startswith("--trace-dir="):
            continue
        a = a.replace("http://127.0.0.1:8000", url).replace("0.0.0.0:9470", "127.0.0.1:0")
        out.append(port if a == "8000" else a.replace("--capture=8000", f"--capture={port}"))
    assert url in " ".join(out) and port in [x.split("=")[-1] for x in out]  # the deployment's shape, this engine
    return out


def _as_sidecar(bounding: str) -> list[str]:
    assert SETPRIV is not None
    return [SETPRIV, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--inh-caps=-all",
            f"--bounding-set={bounding}", "--no-new-privs"]


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path, str]]:
    """(capture interpreter, plain interpreter, PYTHONPATH), all readable by uid 65534."""
    root = Path(tempfile.mkdtemp(prefix="kvtop-sidecar-"))
    try:
        os.chmod(root, 0o755)
        path = readable_install(root)
        cap = root / "kvtop-capture-python"
        capture_interpreter(cap)
        probe = subprocess.run([*_as_sidecar("-all,+net_raw"), str(cap), "-c", "import aiohttp, kvtop.cli"],
                               env={"PYTHONPATH": path}, capture_output=True, text=True, timeout=60)
        if probe.returncode != 0:
            # the dependencies stay where this environment has them (a clone's venv), unreadable to
            # uid 65534 inside a private folder; copying them all would cost more than the test
            pytest.skip(f"uid {NOBODY} cannot import kvtop's dependencies from {path}: run the suite from a clone "
                        f"other users can read (CI's clone folder is mode 755) to test the deployments' privileges "
                        f"({probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else 'no error text'})")
        yield cap, SYSTEM_PY, path
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_the_capture_interpreter_needs_net_raw_in_the_bounding_set(image: tuple[Path, Path, str]) -> None:
    """Why it is not the image's entrypoint: where the pod does not add NET_RAW the kernel refuses
    to run it at all (the probing DaemonSet uses the plain interpreter)."""
    cap, _, path = image
    r = subprocess.run([*_as_sidecar("-all"), str(cap), "-c", "print('ran')"], env={"PYTHONPATH": path},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "ran" not in r.stdout and "Operation not permitted" in r.stderr


def test_without_the_file_capability_the_sidecar_cannot_capture(image: tuple[Path, Path, str], tmp_path: Path) -> None:
    _, plain, path = image
    args = [a for a in _sidecar_args() if not a.startswith(("--trace-dir", "--listen"))]
    r = subprocess.run([*_as_sidecar("-all,+net_raw"), str(plain), "-m", "kvtop", *args, "--listen=127.0.0.1:0",
                        "--duration=1"], env={"PYTHONPATH": path, "XDG_CONFIG_HOME": "/nonexistent"},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "CAP_NET_RAW" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("deployment", ["kubernetes-sidecar", "systemd-capture-unit"])
def test_the_capture_deployments_count_spikes_in_the_streams_they_capture(image: tuple[Path, Path, str],
                                                                          deployment: str) -> None:
    cap, plain, path = image
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    sim = subprocess.Popen([sys.executable, "-m", "kvtop", "sim-server", "--preset", "preemption-storm", "--port", "0",
                            "--seed", "3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    agent = None
    try:
        sim_url = wait_for_line(sim.stdout, r"at (http://127\.0\.0\.1:(\d+))")
        url, port = sim_url.group(1), sim_url.group(2)
        if deployment == "kubernetes-sidecar":
            run = [*_as_sidecar("-all,+net_raw"), *_opener_here(_sidecar_command(), port, cap, plain, path),
                   *_here(_sidecar_args(), url, port)]
        else:  # AmbientCapabilities=CAP_NET_RAW, CapabilityBoundingSet=CAP_NET_RAW, NoNewPrivileges=yes
            assert SETPRIV is not None
            run = [SETPRIV, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--inh-caps=-all,+net_raw",
                   "--ambient-caps=-all,+net_raw", "--bounding-set=-all,+net_raw", "--no-new-privs",
                   *_opener_here(_unit_command(), port, cap, plain, path), *_here(_unit_args(), url, port), "--no-gpu"]
        agent = subprocess.Popen([*run, "--no-host", "--interval=0.5"],
                                 env={"PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "XDG_CONFIG_HOME": "/nonexistent",
                                      "POD_NAME": "vllm-0", "POD_NAMESPACE": "inference"},
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        metrics = wait_for_line(agent.stderr, r"metrics (http://[\d.:]+/metrics).*capture port", 60).group(1)
        load = asyncio.run(run_load(url, load_preset("preemption-storm"), 12.0, seed=3))
        fams: dict[str, list] = {}
        for _ in range(40):  # spikes wait for their evidence window before they are counted
            asyncio.run(asyncio.sleep(0.5))
            text = httpx.get(metrics, timeout=5).text
            fams = {f.name: f.samples for f in text_string_to_metric_families(text)}
            if any(s.value > 0 and s.labels["cause"] == "preemption" for s in fams["kvtop_token_gap_spikes"]
                   if s.name.endswith("_total")):
                break
    finally:
        for p in (agent, sim):
            if p is not None and p.poll() is None:
                p.terminate()
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
    captured = sum(s.value for s in fams["kvtop_streams_observed"]
                   if s.name.endswith("_total") and s.labels["observer"] == "capture")
    spikes = {s.labels["cause"]: s.value for s in fams["kvtop_token_gap_spikes"] if s.name.endswith("_total")}
    # every request the load sent went past the capture, none twice
    assert load.sent >= 10 and captured == load.sent, (captured, load.sent)
    assert sum(spikes.values()) > 0 and spikes["preemption"] > 0, spikes
    [info] = fams["kvtop_agent_info"]
    assert (info.labels["pod"], info.labels["namespace"]) == ("vllm-0", "inference")


def _daemonset_args() -> list[str]:
    docs = [d for d in yaml.safe_load_all((REPO / "deploy" / "kubernetes" / "kvtop-daemonset.yaml").read_text()) if d]
    [ds] = [d for d in docs if d["kind"] == "DaemonSet"]
    [c] = [c for c in ds["spec"]["template"]["spec"]["containers"] if c["name"] == "kvtop-agent"]
    return list(c["args"])


@pytest.mark.slow
def test_the_probing_daemonset_observes_its_canaries_without_any_capability(image: tuple[Path, Path, str]) -> None:
    """The DaemonSet's arguments (the node-local Service replaced by this engine's address) with no
    capability at all, as uid 65534: its canary streams are observed and timed."""
    _, plain, path = image
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    sim = subprocess.Popen([sys.executable, "-m", "kvtop", "sim-server", "--port", "0", "--seed", "4"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    agent = None
    try:
        url = wait_for_line(sim.stdout, r"at (http://127\.0\.0\.1:\d+)").group(1)
        args = []
        for a in _daemonset_args():
            if a.startswith("--trace-dir"):
                continue
            if a.startswith("--url="):
                a = f"--url={url}"
            args.append(a.replace("0.0.0.0:9470", "127.0.0.1:0"))
        assert any(a.startswith("--probe=") for a in args)
        agent = subprocess.Popen([*_as_sidecar("-all"), str(plain), "-m", "kvtop", *args, "--no-host", "--no-gpu",
                                  "--interval=0.5"],
                                 env={"PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "XDG_CONFIG_HOME": "/nonexistent"},
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        metrics = wait_for_line(agent.stderr, r"metrics (http://[\d.:]+/metrics).*probe", 60).group(1)
        probed = 0.0
        gaps = 0.0
        for _ in range(60):  # --probe=0.2: one canary every 5 s
            asyncio.run(asyncio.sleep(0.5))
            fams = {f.name: f.samples for f in text_string_to_metric_families(httpx.get(metrics, timeout=5).text)}
            probed = sum(x.value for x in fams.get("kvtop_streams_observed", [])
                         if x.name.endswith("_total") and x.labels["observer"] == "probe")
            gaps = sum(x.value for x in fams["kvtop_stream_inter_token_gap_seconds"] if x.name.endswith("_count"))
            if probed >= 2 and gaps > 0:
                break
    finally:
        for p in (agent, sim):
            if p is not None and p.poll() is None:
                p.terminate()
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
    assert probed >= 2 and gaps > 0, (probed, gaps)
