"""Install, start and stop the real inference servers used by the real-engine tier.

Used by tests/integration/ and bench/real_engines.py. Standard library only, so the
bench script and the tests share it without extra dependencies.

The engines live in a cache (``$KVTOP_ENGINE_CACHE``, default ``~/.cache/kvtop-engines``) built by
``setup_vllm.sh`` and ``setup_llamacpp.sh`` beside this file: the first run installs/builds (minutes),
later runs reuse it (seconds).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
CACHE = Path(os.environ.get("KVTOP_ENGINE_CACHE", Path.home() / ".cache" / "kvtop-engines"))

VLLM_MODEL_NAME = "tiny-llama"
# 33 blocks x 32 tokens x 1 KiB/token (2 layers x K,V x 2 KV heads x 32 x fp32): 1,056 token slots.
VLLM_KV_BYTES = 1_081_344
VLLM_BLOCK_SIZE = 32
VLLM_KV_CAPACITY_TOKENS = 1056
VLLM_MAX_MODEL_LEN = 1024
VLLM_MAX_NUM_SEQS = 16


class EngineSetupError(RuntimeError):
    """A real engine could not be installed/built/started. The message says why, in one line."""


def _run_setup(script: str, timeout: float) -> list[str]:
    """Run a setup script; its stdout lines are the paths it made. Its progress goes to a log."""
    path = HERE / script
    CACHE.mkdir(parents=True, exist_ok=True)
    log_path = CACHE / f"{Path(script).stem}.log"
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(["bash", str(path)], stdout=subprocess.PIPE, stderr=log, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            raise EngineSetupError(f"{script} did not finish within {timeout:.0f} s (log: {log_path})") from None
    # pip's warnings about the machine's local index folders are noise; keep the script's own lines.
    noise = ("is ignored: it is neither a file nor a directory",)
    err = [ln for ln in log_path.read_text(errors="replace").splitlines()
           if ln.strip() and not any(s in ln for s in noise)]
    if proc.returncode != 0:
        raise EngineSetupError(f"{script} failed (exit {proc.returncode}):\n" + "\n".join(err[-12:]))
    for ln in err:
        print(ln, flush=True)
    print(f"[real-engines] {script}: {time.monotonic() - t0:.1f} s", flush=True)
    return [ln for ln in proc.stdout.splitlines() if ln.strip()]


def setup_vllm(timeout: float = 1200) -> tuple[Path, Path]:
    """-> (python of the vLLM venv, tiny model dir)."""
    out = _run_setup("setup_vllm.sh", timeout)
    return Path(out[-1]), CACHE / "tiny-llama"


def setup_llamacpp(timeout: float = 1800) -> tuple[Path, Path]:
    """-> (llama-server binary, GGUF model)."""
    out = _run_setup("setup_llamacpp.sh", timeout)
    return Path(out[-2]), Path(out[-1])


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")


@dataclass
class Server:
    """One engine process on a loopback port, in its own process group and private temp dir."""

    name: str
    cmd: list[str]
    env: dict[str, str]
    port: int
    health_path: str
    workdir: Path
    proc: subprocess.Popen | None = None
    log_path: Path = field(init=False)
    started_s: float | None = None  # seconds from launch to healthy, last start

    def __post_init__(self) -> None:
        self.log_path = self.workdir / f"{self.name}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 240) -> Server:
        t0 = time.monotonic()
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child for its lifetime
        self.proc = subprocess.Popen(
            self.cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            cwd=self.workdir, start_new_session=True,
        )
        log.close()
        deadline = t0 + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EngineSetupError(
                    f"{self.name} exited with {self.proc.returncode} while starting; log tail:\n{self.log_tail()}"
                )
            try:
                status, _ = http_get(self.url + self.health_path, timeout=2)
                if status == 200:
                    self.started_s = time.monotonic() - t0
                    print(f"[real-engines] {self.name} healthy on {self.url} after {self.started_s:.1f} s", flush=True)
                    return self
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.5)
        self.stop()
        raise EngineSetupError(f"{self.name} not healthy within {timeout:.0f} s; log tail:\n{self.log_tail()}")

    def kill(self) -> None:
        """Abrupt death (SIGKILL to the whole process group), as in a crash."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self, grace: float = 20) -> None:
        if not self.proc or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        except ProcessLookupError:
            pass

    def log_tail(self, n: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def metrics(self) -> str:
        status, body = http_get(self.url + "/metrics", timeout=10)
        if status != 200:
            raise EngineSetupError(f"{self.name} /metrics answered {status}")
        return body


def private_dir(prefix: str) -> Path:
    base = CACHE / "run"
    base.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))


def vllm_server(python: Path, model_dir: Path, port: int | None = None, workdir: Path | None = None,
                witness: Path | None = None, extra: tuple[str, ...] = (), kv_bytes: int = VLLM_KV_BYTES,
                max_model_len: int = VLLM_MAX_MODEL_LEN) -> Server:
    """The tiny-model vLLM; ``witness``: with kvtop's witness writing its steps there (``kvtop.witness``
    imported from this checkout, as an operator's ``pip install --no-deps kvtop-console`` would)."""
    port = port or free_port()
    wd = workdir or private_dir("vllm-")
    tmp = wd / "tmp"
    tmp.mkdir(exist_ok=True)
    # No OMP_NUM_THREADS: vLLM then picks its serving thread count itself; two spinning OpenMP
    # threads on a shared 2-core box made decoding 10x slower.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "CUDA_", "OMP_"))}
    env.update(
        HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
        # one process: starts faster and needs ~0.6 GB less memory on this 2-core box
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_LOG_STATS_INTERVAL="1",
        TMPDIR=str(tmp), VLLM_CACHE_ROOT=str(wd / "vllm-cache"),
        TORCHINDUCTOR_CACHE_DIR=str(wd / "inductor"), HF_HOME=str(wd / "hf"),
    )
    cmd = [
        str(python), "-m", "vllm.entrypoints.launchers.api_server.entry",
        "--model", str(model_dir), "--served-model-name", VLLM_MODEL_NAME,
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--enforce-eager",
        "--max-model-len", str(max_model_len), "--block-size", str(VLLM_BLOCK_SIZE),
        "--max-num-seqs", str(VLLM_MAX_NUM_SEQS), "--kv-cache-memory-bytes", str(kv_bytes),
        # each response's final usage chunk carries the engine's own queue/TTFT/decode times
        "--enable-per-request-metrics", *extra,
    ]
    if witness is not None:
        cmd += ["--scheduler-cls", "kvtop.witness.vllm.WitnessScheduler"]
        env["PYTHONPATH"] = str(HERE.parent.parent)
        env["KVTOP_WITNESS_FILE"] = str(witness)
    return Server("vllm", cmd, env, port, "/health", wd)


def llama_server(binary: Path, model: Path, port: int | None = None, ctx: int = 2048, parallel: int = 4,
                 unified_kv: bool = False, workdir: Path | None = None, extra: tuple[str, ...] = ()) -> Server:
    port = port or free_port()
    wd = workdir or private_dir("llamacpp-")
    cmd = [
        str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
        "-c", str(ctx), "--parallel", str(parallel), "--metrics", "-t", "2", "--no-webui",
    ]
    if unified_kv:
        cmd.append("-kvu")
    cmd += extra
    env = dict(os.environ)
    env["TMPDIR"] = str(wd)
    return Server("llama-server", cmd, env, port, "/health", wd)


def cleanup(server: Server) -> None:
    server.stop()
    shutil.rmtree(server.workdir, ignore_errors=True)


def describe(server: Server) -> str:
    return json.dumps({"name": server.name, "url": server.url, "cmd": server.cmd})
