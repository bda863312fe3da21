"""The recording proxy as several processes sharing one port, and the ``make_proxy`` factory."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import time

import kvtop
from kvtop.model.records import Record, RequestRecord, from_dict
from kvtop.sources.proxy.server import RecordingProxy, upstream_url
from kvtop.sources.sse import Clock, Emit


class ProxyPool:
    """The recording proxy as ``workers`` processes sharing one port (SO_REUSEPORT).

    One Python process forwards roughly 25K chunks/s before its core is full (bench/proxy_overhead.py);
    beyond that, latency grows without bound. Each worker runs a ``RecordingProxy`` and sends its
    records to this process as JSON lines on its stdout, where they reach ``emit`` in arrival order
    per worker (records of different workers can be a few milliseconds out of order). Same interface
    as ``RecordingProxy``; ``clock`` must be ``time.monotonic()`` plus a constant (workers use the
    same offset).
    """

    def __init__(self, upstream: str, emit: Emit, clock: Clock, host: str = "127.0.0.1", port: int = 0,
                 cls: str | None = None, workers: int = 2, loop: str = "asyncio", trace_prefix: str | None = None):
        self.upstream = upstream_url(upstream)
        self.emit = emit
        self.clock = clock
        self.host = host
        self.port = port
        self.cls = cls
        self.workers = max(1, workers)
        self.loop = loop
        # each worker writes its own trace PREFIX.K.jsonl instead of sending records to this process
        # (emit then never sees them; a measured alternative for bench/proxy_overhead.py)
        self.trace_prefix = trace_prefix
        self.requests_seen = 0
        self._procs: list[asyncio.subprocess.Process] = []
        self._readers: list[asyncio.Task[None]] = []
        self._pongs: dict[int, int] = {}
        self._pong_event = asyncio.Event()
        self._ping = 0

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        offset = self.clock() - time.monotonic()
        reserve = None
        if self.port == 0:
            # Hold an ephemeral port (bound, not listening) so every worker can bind the same one.
            family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
            reserve = socket.socket(family, socket.SOCK_STREAM)
            reserve.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            reserve.bind((self.host, 0))
            self.port = reserve.getsockname()[1]
        env = dict(os.environ)
        args = [*worker_command("kvtop.sources.proxy.worker"), "--worker", "--upstream", self.upstream, "--host", self.host,
                "--port", str(self.port), f"--offset={offset!r}", "--loop", self.loop]
        if self.cls:
            args += ["--class", self.cls]
        try:
            for k in range(self.workers):
                own = ["--trace", f"{self.trace_prefix}.{k}.jsonl"] if self.trace_prefix else []
                proc = await asyncio.create_subprocess_exec(
                    *args, *own, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE, env=env, limit=1 << 20)
                self._procs.append(proc)
            for proc in self._procs:
                assert proc.stdout is not None and proc.stderr is not None
                line = await asyncio.wait_for(proc.stdout.readline(), 60)
                if not line.startswith(b'{"ready"'):
                    err = (await proc.stderr.read()).decode(errors="replace").strip().splitlines()
                    raise OSError(err[-1] if err else "proxy worker failed to start")
            for i, proc in enumerate(self._procs):
                self._readers.append(asyncio.create_task(self._read(i, proc)))
        except BaseException:
            await self._kill()
            raise
        finally:
            if reserve is not None:
                reserve.close()

    async def _read(self, i: int, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        loads = json.loads
        async for line in proc.stdout:
            try:
                d = loads(line)
            except ValueError:
                continue
            if "pong" in d:
                self._pongs[i] = d["pong"]
                self._pong_event.set()
                continue
            if len(d) == 5 and "n" in d and d.get("kind") == "request":  # a token line: the hot path
                rec: Record | None = RequestRecord(d["t"], d["id"], d["event"], n=d["n"])
            else:
                rec = from_dict(d)
            if isinstance(rec, RequestRecord):
                if rec.event == "arrive":
                    self.requests_seen += 1
                self.emit(rec)

    async def flush_records(self, timeout_s: float = 10.0) -> None:
        """Wait until every record the workers produced before this call has been emitted here."""
        self._ping += 1
        n = self._ping
        for proc in self._procs:
            if proc.stdin is not None and proc.returncode is None:
                proc.stdin.write(b"ping %d\n" % n)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while any(self._pongs.get(i, 0) < n for i, p in enumerate(self._procs) if p.returncode is None):
            self._pong_event.clear()
            left = deadline - loop.time()
            if left <= 0:
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._pong_event.wait(), left)

    async def stop(self, grace_s: float = 0.0) -> None:
        for proc in self._procs:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        if self._readers:
            # the workers record their cut-off streams, then close stdout
            await asyncio.wait(self._readers, timeout=10 + grace_s)
        await self._kill()

    async def _kill(self) -> None:
        for proc in self._procs:
            if proc.returncode is None:
                try:
                    await asyncio.wait_for(proc.wait(), 5)
                except asyncio.TimeoutError:
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
                    await proc.wait()
        for task in self._readers:
            task.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)
        self._procs, self._readers = [], []


def make_proxy(upstream: str, emit: Emit, clock: Clock, host: str = "127.0.0.1", port: int = 0,
               cls: str | None = None, workers: int = 1, loop: str = "asyncio") -> RecordingProxy | ProxyPool:
    """One in-process proxy, or ``workers`` processes (each on event loop ``loop``)."""
    if workers <= 1:
        return RecordingProxy(upstream, emit, clock, host=host, port=port, cls=cls)
    return ProxyPool(upstream, emit, clock, host=host, port=port, cls=cls, workers=workers, loop=loop)


def worker_command(module: str) -> list[str]:
    """A command line running ``module`` as ``__main__`` in a child Python that cannot import
    files from the current directory.

    ``python -m`` puts the working directory first on the import path, so a ``uuid.py`` there
    would run inside every worker. The child starts isolated (``-I``: no cwd, no PYTHON* variables,
    no user site) and gets this process's import path back minus the working directory, plus the
    folder kvtop itself was imported from.
    """
    cwd = os.getcwd()
    root = os.path.dirname(os.path.dirname(os.path.abspath(kvtop.__file__)))
    paths = [root] + [p for p in sys.path if p and os.path.abspath(p) not in (cwd, root)]
    code = (f"import sys, runpy; sys.path[:0] = {paths!r}; "
            f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)")
    return [sys.executable, "-I", "-c", code]

