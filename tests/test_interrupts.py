"""One Ctrl-C behaviour for every long command: stop, write what was gathered, say so on stderr.

Each test runs the real command in a subprocess and sends it a real SIGINT once it is mid-run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
from conftest import REPO
from page_server import PageServer
from pty_reader import PtyReader
from vllm_pages import vllm_page

from kvtop.model.trace import TraceReader


def _spawn(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "XDG_CONFIG_HOME": str(REPO / ".cache" / "no-config")}
    return subprocess.Popen([sys.executable, "-m", "kvtop", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True, env=env)


def _wait(pred, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "timed out waiting"
        time.sleep(0.02)


def _interrupt(p: subprocess.Popen[str]) -> tuple[str, str]:
    p.send_signal(signal.SIGINT)
    try:
        return p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()


def test_simulate_closes_a_valid_trace_and_says_how_far_it_got(tmp_path: Path) -> None:
    out = tmp_path / "t.jsonl"
    p = _spawn("simulate", "--preset", "preemption-storm", "--duration", "80000", "-o", str(out))
    _wait(lambda: out.exists() and out.stat().st_size > 200_000)  # well into the run
    stdout, stderr = _interrupt(p)
    assert p.returncode == 0, stderr
    assert "kvtop simulate: interrupted: stopped at " in stderr and "of 80000 simulated s" in stderr
    stopped = float(stderr.split("stopped at ", 1)[1].split(" ", 1)[0])
    assert 0 < stopped < 80000
    assert f"over {stopped:g} simulated s" in stdout
    # every line is whole JSON (no torn last line) and the records reach the time it stopped at
    lines = out.read_text().splitlines()
    last_t = max(json.loads(line).get("t", 0.0) for line in lines[1:])
    assert abs(last_t - stopped) < 1.0
    reader = TraceReader(str(out))
    n = sum(1 for _ in reader.dicts())
    assert n == len(lines) - 1 and reader.warning() is None


def test_snapshot_prints_the_report_of_the_window_it_sampled() -> None:
    with PageServer() as s:
        route = s.route("/metrics", vllm_page(running=7))
        p = _spawn("snapshot", "--url", s.url, "--duration", "1h", "--interval", "0.1", "--no-gpu", "--no-host",
                   "--format", "json")
        _wait(lambda: len(route.hits) >= 5)  # several samples taken
        stdout, stderr = _interrupt(p)
    assert p.returncode == 0, stderr
    assert "kvtop snapshot: interrupted: the report covers the" in stderr and "(of --duration 3600 s)" in stderr
    doc = json.loads(stdout)
    assert doc["engines"][0]["running"] == 7 and doc["engines"][0]["up"] is True
    assert 0 < doc["window_s"] < 60


def _big_trace(path: Path, blocks: int = 16) -> int:
    """A trace of ~`blocks` x 8 MB: the same 8 MB of token lines repeated, each copy its own streams."""
    from kvtop.model.trace import make_header

    lines = [f'{{"kind":"request","t":{0.01 + i * 1e-4:.6f},"id":"bXX-r{i % 64}","event":"token","n":1,"source":"t"}}\n'
             for i in range(100_000)]
    block = "".join(lines).encode()
    with open(path, "wb") as f:
        f.write((json.dumps(make_header(engine={"adapter": "vllm"})) + "\n").encode())
        for b in range(blocks):
            f.write(block.replace(b"bXX", f"b{b:02d}".encode()))
    return path.stat().st_size


def test_analyze_reports_the_part_it_read(tmp_path: Path) -> None:
    trace = tmp_path / "big.jsonl"
    size = _big_trace(trace)
    p = _spawn("analyze", str(trace), "--format", "json")
    proc = psutil.Process(p.pid)

    def reading() -> bool:
        try:
            return any(f.path == str(trace) for f in proc.open_files())
        except psutil.Error:
            return False

    _wait(reading)
    stdout, stderr = _interrupt(p)
    assert p.returncode == 0, stderr
    assert "kvtop analyze: interrupted: the report below covers the part of the trace read so far" in stderr
    doc = json.loads(stdout)
    note = next(w for w in doc["warnings"] if w.startswith("interrupted: the analysis covers the first"))
    mb = float(note.split("first ", 1)[1].split(" MB", 1)[0])
    assert mb < size / 1e6  # stopped before the end, and said where


def test_headless_demo_stops_on_ctrl_c_and_still_reports() -> None:
    p = _spawn("demo", "--headless", "--duration", "600", "--speed", "20")
    proc = psutil.Process(p.pid)
    _wait(lambda: bool(proc.net_connections(kind="tcp")))
    time.sleep(1.0)
    stdout, stderr = _interrupt(p)
    assert p.returncode == 0, stderr
    assert "kvtop demo: interrupted" in stderr
    assert "engine" in stdout.lower()


def test_headless_replay_stops_on_sigterm_and_still_reports(tmp_path: Path) -> None:
    # it had no handler: SIGTERM ended it with 143 and no report; a SIGINT its shell ignored
    # (a background job of a script) was never seen and the whole trace replayed
    trace = tmp_path / "storm.jsonl"
    sim = subprocess.run([sys.executable, "-m", "kvtop", "simulate", "--preset", "preemption-storm", "--duration",
                          "120", "-o", str(trace)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert sim.returncode == 0, sim.stderr
    import re

    for sig, ignore_sigint in ((signal.SIGTERM, False), (signal.SIGINT, True)):
        setup = "signal.signal(signal.SIGINT, signal.SIG_IGN); " if ignore_sigint else ""
        p = subprocess.Popen([sys.executable, "-c", f"import signal, sys; {setup}from kvtop.cli import main; "
                              "sys.exit(main(sys.argv[1:]))", "replay", str(trace), "--headless", "--speed", "1"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
        time.sleep(3.0)
        p.send_signal(sig)
        try:
            stdout, stderr = p.communicate(timeout=30)  # not the 117 s left of the trace
        finally:
            if p.poll() is None:
                p.kill()
        assert p.returncode == 0, (sig, stderr)
        assert "kvtop replay: interrupted: the report below is as it stood at trace time" in stderr
        m = re.search(r"replayed to ([\d.]+) s", stdout)
        assert m and float(m.group(1)) < 60, stdout[:300]


def _stderr_on_a_terminal(*args: str) -> tuple[int, str, str]:
    """Run kvtop with stderr on a pseudo-terminal and stdout on a pipe: (exit code, stdout, stderr)."""
    import pty

    master, slave = pty.openpty()
    env = {**os.environ, "PYTHONPATH": str(REPO), "XDG_CONFIG_HOME": str(REPO / ".cache" / "no-config")}
    p = subprocess.Popen([sys.executable, "-m", "kvtop", *args], stdout=subprocess.PIPE, stderr=slave,
                         stdin=subprocess.DEVNULL, text=True, env=env)
    os.close(slave)
    reader = PtyReader(master)
    try:
        out, _ = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    return p.returncode, out, reader.text()


def test_progress_shows_on_a_terminal_and_stays_out_of_pipes(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    rc, out, err = _stderr_on_a_terminal("simulate", "--preset", "preemption-storm", "--duration", "20", "-o", str(trace))
    assert rc == 0 and "over 20 simulated s" in out  # the result on stdout, as without a terminal
    assert f"kvtop simulate: {trace}: " in err and "% (" in err and "of 20 simulated s)" in err
    assert err.endswith("\r\x1b[K")  # the line is cleared when done: no half line left on the terminal
    rc, out, err = _stderr_on_a_terminal("analyze", str(trace), "--format", "json")
    assert rc == 0 and json.loads(out)["verdict"]
    assert f"kvtop analyze: {trace}: " in err and " MB of " in err
    with PageServer() as s:
        s.route("/metrics", vllm_page(running=1))
        rc, out, err = _stderr_on_a_terminal("record", "-o", str(tmp_path / "r.jsonl"), "--url", s.url, "--duration", "1.5",
                                             "--interval", "0.2", "--no-gpu", "--no-host")
    assert rc == 0 and " records, " in err and "of 1.5 s" in err
    # without a terminal (a pipe): no progress, no carriage returns
    sim = subprocess.run([sys.executable, "-m", "kvtop", "simulate", "--preset", "preemption-storm", "--duration", "5",
                          "-o", str(tmp_path / "p.jsonl")], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert sim.returncode == 0 and sim.stderr == ""
