"""Run kvtop itself (as a user would, in subprocesses) against the real engines.

``Recorder`` wraps ``kvtop record --url ENGINE --proxy-listen 127.0.0.1:PORT``; ``analyze`` wraps
``kvtop analyze TRACE --format json``; ``read_trace`` reads a trace as plain JSON lines so the tests
check kvtop's output against an independent reading, not through kvtop's own reader.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def kvtop_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("XDG_CONFIG_HOME", str(REPO / ".cache" / "no-config"))
    return env


def kvtop(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvtop", *args], capture_output=True, text=True,
                          timeout=timeout, env=kvtop_env())


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Recorder:
    """``kvtop record`` with its recording proxy in front of ``engine_url``."""

    def __init__(self, trace: Path, engine_url: str, interval_s: float = 0.5, extra: tuple[str, ...] = ()):
        self.trace = trace
        self.engine_url = engine_url
        self.proxy_port = free_port()
        self.interval_s = interval_s
        self.extra = extra
        self.proc: subprocess.Popen | None = None
        self.returncode: int | None = None
        self.stderr_path = trace.with_suffix(".stderr")

    @property
    def proxy_url(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"

    def start(self, timeout: float = 60) -> Recorder:
        cmd = [sys.executable, "-m", "kvtop", "record", "-o", str(self.trace), "--url", self.engine_url,
               "--proxy-listen", f"127.0.0.1:{self.proxy_port}", "--no-gpu",
               # preemptions resolve within a second or two: poll faster than the default 1 s
               "--interval", str(self.interval_s), *self.extra]
        err = open(self.stderr_path, "wb")  # noqa: SIM115 - the child owns it
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=kvtop_env(),
                                     start_new_session=True)
        err.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"kvtop record exited {self.proc.returncode}: {self.stderr()}")
            if _port_open(self.proxy_port) and self.trace.exists() and self.trace.stat().st_size > 0:
                return self
            time.sleep(0.2)
        self.stop()
        raise AssertionError(f"kvtop record's proxy did not listen within {timeout:.0f} s: {self.stderr()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 60) -> int:
        """SIGINT, as a user's Ctrl-C; the recorder must flush and exit by itself."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
                raise AssertionError(f"kvtop record ignored SIGINT for {timeout:.0f} s") from None
        self.returncode = self.proc.returncode
        return self.returncode

    def stderr(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def __enter__(self) -> Recorder:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.stop()


def analyze(trace: Path, *args: str, timeout: float = 300) -> dict:
    r = kvtop("analyze", str(trace), "--format", "json", *args, timeout=timeout)
    assert r.returncode == 0, f"kvtop analyze exited {r.returncode}: {r.stderr[-2000:]}"
    return json.loads(r.stdout)


def read_trace(path: Path) -> list[dict]:
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # a torn last line is allowed
    return out


def timelines(records: list[dict]) -> dict[str, dict[str, list]]:
    """Per request id: event -> list of (t, n) in file order."""
    tl: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        if r.get("kind") == "request":
            tl[r["id"]][r["event"]].append((r["t"], r.get("n")))
    return tl


def token_times(records: list[dict]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = defaultdict(list)
    for r in records:
        if r.get("kind") == "request" and r.get("event") in ("first_token", "token"):
            out[r["id"]].append(r["t"])
    return out


def slo_target_ms(records: list[dict], factor: float = 25.0, floor_ms: float = 500.0) -> float:
    """An ITL target that only real stalls exceed: ``factor`` x the run's typical token gap, at least
    ``floor_ms``. The typical gap is the mean of all gaps below the 95th percentile, read from the
    trace here (not by kvtop). On a busy 2-core box the proxy reads tokens in bursts and routine
    scheduling hiccups that stall every stream reach ~0.4 s; a preempted vLLM stream is silent for
    0.7-6 s (docs/real-engines.md), seconds more on a busy box."""
    gaps = sorted(b - a for ts in token_times(records).values() for a, b in zip(ts, ts[1:], strict=False))
    if not gaps:
        return floor_ms
    body = gaps[: max(1, int(len(gaps) * 0.95))]
    return max(floor_ms, factor * 1e3 * sum(body) / len(body))


def cause_count(report: dict, cause: str) -> int:
    """Spikes given ``cause``: the report's tally (the spike list itself may be truncated)."""
    causes = report.get("causes")
    if isinstance(causes, dict) and cause in causes:
        c = causes[cause]
        return int(c["count"] if isinstance(c, dict) else c)
    return sum(1 for s in report.get("spikes", []) if s.get("cause") == cause)


def spikes_total(report: dict) -> int:
    return int(report.get("spikes_total", len(report.get("spikes", []))))


def replay_events(trace: Path) -> list[dict]:
    """The console's event log after replaying the trace headless (engine down/up/restart ...)."""
    r = kvtop("replay", str(trace), "--headless", "--format", "json")
    assert r.returncode == 0, f"kvtop replay exited {r.returncode}: {r.stderr[-2000:]}"
    return json.loads(r.stdout).get("events", [])


def engine_records(records: list[dict]) -> list[dict]:
    return [r for r in records if r.get("kind") == "engine"]
