"""A real Prometheus server (Debian's `prometheus` package) on loopback for the `prometheus` tier.

``PrometheusServer(targets={"job": ["127.0.0.1:PORT", ...]})`` writes a config with a 1 s scrape
interval into a temporary directory, starts /usr/bin/prometheus on a free loopback port with its
TSDB there, and waits until it answers. Nothing is fixed: other test runs use their own ports.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrometheusServer:
    def __init__(self, targets: dict[str, list[str]], scrape_interval: str = "1s",
                 rule_files: list[str | Path] | None = None, metrics_paths: dict[str, str] | None = None):
        self.targets = targets
        self.scrape_interval = scrape_interval
        self.rule_files = [str(p) for p in rule_files or []]
        self.metrics_paths = metrics_paths or {}
        self.dir = Path(tempfile.mkdtemp(prefix="kvtop-prom-"))
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    def config(self) -> str:
        lines = ["global:", f"  scrape_interval: {self.scrape_interval}", f"  evaluation_interval: {self.scrape_interval}"]
        if self.rule_files:
            lines.append("rule_files:")
            lines += [f"  - {p}" for p in self.rule_files]
        lines.append("scrape_configs:")
        for job, tg in self.targets.items():
            lines += [f"  - job_name: {job}", f"    metrics_path: {self.metrics_paths.get(job, '/metrics')}",
                      "    static_configs:", "      - targets: [" + ", ".join(f'"{t}"' for t in tg) + "]"]
        return "\n".join(lines) + "\n"

    def start(self, timeout_s: float = 60.0) -> PrometheusServer:
        cfg = self.dir / "prometheus.yml"
        cfg.write_text(self.config())
        for _ in range(5):
            port = free_port()
            self.url = f"http://127.0.0.1:{port}"
            log = open(self.dir / "prometheus.log", "wb")
            self.proc = subprocess.Popen(
                [PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={self.dir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{port}", "--web.enable-lifecycle"],
                stdout=log, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break  # lost the port race (or a bad config): try again / report below
                try:
                    if httpx.get(self.url + "/-/ready", timeout=1.0).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            self.stop()
        raise RuntimeError(f"prometheus did not start: {(self.dir / 'prometheus.log').read_text()[-2000:]}")

    def wait_for(self, expr: str, ok, timeout_s: float = 30.0):  # noqa: ANN001
        """Poll an instant query until ``ok(result)`` holds; returns the result."""
        deadline = time.monotonic() + timeout_s
        res = None
        while time.monotonic() < deadline:
            r = httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=5.0).json()
            res = r["data"]["result"]
            if ok(res):
                return res
            time.sleep(0.5)
        raise AssertionError(f"{expr}: condition not met within {timeout_s}s (last result {res})")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
