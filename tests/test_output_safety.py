"""A full disk or an unwritable directory costs records, never the run's output or the console:
one line and exit 1 for a recorder, a counted warning and no spray of empty files for the agent."""

from __future__ import annotations

import errno
import io
import os
import re
import stat
from pathlib import Path

import pytest
from conftest import logged, run_kvtop

import kvtop.model.trace as trace_mod
import kvtop.model.trace_rotate as rotate_mod
from kvtop.errors import RunFailure
from kvtop.model.records import RequestRecord
from kvtop.model.trace import TraceReader, TraceWriteError, TraceWriter, make_header


class _FullDisk(io.RawIOBase):
    """A file whose disk fills after ``room`` bytes (as a quota or a full partition answers)."""

    def __init__(self, room: int):
        self.room = room
        self.data = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:  # noqa: ANN001
        if len(self.data) + len(b) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.data += b
        return len(b)


class _FillingDisk(io.RawIOBase):
    """A trace file on a disk that fills after ``room`` more bytes: the bytes before land in the file,
    the write at the edge is short, every later one fails (as write(2) answers on a full partition)."""

    def __init__(self, path: Path, room: int):
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        self.room = room

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.fd

    def write(self, b) -> int:  # noqa: ANN001
        if self.room <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        n = os.write(self.fd, bytes(b[: self.room]))
        self.room -= n
        return n

    def close(self) -> None:
        if not self.closed:
            os.close(self.fd)
        super().close()


def _fill_after(w: TraceWriter, room: int) -> None:
    """From now on ``w`` writes through its usual 64 KiB buffer to a disk with ``room`` bytes left."""
    w._f.close()
    w._f = io.TextIOWrapper(io.BufferedWriter(_FillingDisk(w.path, room), 1 << 16), encoding="ascii", newline="")


def _rec(i: int) -> RequestRecord:
    return RequestRecord(t=i * 0.01, id=f"r{i}", event="token", n=1)


def _flushed_writer(tmp_path: Path) -> TraceWriter:
    """A recorder's trace holding records r0-r9, flushed."""
    w = TraceWriter(tmp_path / "t.jsonl", make_header(recorder="kvtop record"))
    for i in range(10):
        w.write(_rec(i))
    w.flush()
    return w


def test_a_full_disk_is_one_line_naming_the_file_and_what_was_flushed_stays_a_trace(tmp_path: Path):
    w = _flushed_writer(tmp_path)
    path = w.path
    disk = _FullDisk(room=0)
    w._f = io.TextIOWrapper(io.BufferedWriter(disk, 64), encoding="ascii", newline="")
    with pytest.raises(TraceWriteError) as err:
        for i in range(10, 1000):
            w.write(_rec(i))
    # the CLI prints str(e) after "kvtop: error:" and exits 1 (a RunFailure), never a traceback
    assert str(err.value) == f"cannot write {path}: No space left on device"
    assert isinstance(err.value, RunFailure) and err.value.errno == errno.ENOSPC
    with pytest.raises(TraceWriteError):
        w.close()
    assert [d["id"] for d in TraceReader(path).dicts() if d.get("kind") == "request"] == [f"r{i}" for i in range(10)]


def test_the_agent_drops_records_on_a_full_disk_with_one_warning_and_no_empty_segments(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    now = [0.0]

    class NoRoom(TraceWriter):
        def __init__(self, path, *a, **kw):  # noqa: ANN001, ANN002, ANN003
            Path(path).touch()  # the file is created, its header does not fit
            raise TraceWriteError(path, OSError(errno.ENOSPC, "No space left on device"))

    monkeypatch.setattr(rotate_mod, "TraceWriter", NoRoom)
    rt = rotate_mod.RotatingTrace(tmp_path, lambda: make_header(recorder="kvtop agent"), clock=lambda: now[0])
    with logged(rotate_mod.log) as seen:
        for i in range(3000):  # a probe's tokens over a few seconds
            now[0] = i * 0.001
            rt.write(_rec(i))
    assert rt.dropped == 3000
    assert list(tmp_path.iterdir()) == []  # it was 3,273 empty segment files in 6 s
    warned = [r for r in seen if "No space left on device" in r.getMessage()]
    assert len(warned) == 1 and "kvtop_dropped_records_total" in warned[0].getMessage()
    # room again: the next try after the back-off opens a segment and the records flow
    monkeypatch.setattr(rotate_mod, "TraceWriter", trace_mod.TraceWriter)
    now[0] = 3.0 + rotate_mod.OPEN_RETRY_S
    rt.write(_rec(5000))
    rt.close()
    assert rt.dropped == 3000 and rt.rotations == 1


def test_every_record_the_agent_took_is_in_its_segment_or_counted_dropped_when_the_disk_fills(tmp_path: Path):
    now = [0.0]
    rt = rotate_mod.RotatingTrace(tmp_path, lambda: make_header(recorder="kvtop agent"), clock=lambda: now[0])
    for i in range(10):
        rt.write(_rec(i))
    assert rt._writer is not None
    rt._writer.flush()
    _fill_after(rt._writer, room=5000)  # the first spill of the buffer finds 5,000 bytes of room
    for i in range(10, 4000):  # about 170 KB of token lines: the 64 KiB buffer spills and the disk fills
        rt.write(_rec(i))
    rt.close()
    (seg,) = rotate_mod.segments(tmp_path)
    kept = [d["id"] for d in TraceReader(seg).dicts()]
    assert kept == [f"r{i}" for i in range(len(kept))] and 10 < len(kept) < 200  # the flushed ones and 5,000 bytes
    # the buffer's records when the disk filled were lost uncounted (1,101 of them here)
    assert rt.dropped == 4000 - len(kept)


def test_a_writer_that_failed_counts_what_its_buffer_could_not_put_on_disk(tmp_path: Path):
    w = _flushed_writer(tmp_path)
    path = w.path
    assert w.unsaved() == 0
    _fill_after(w, room=len('{"t":0.1,"kind":"request","id":"r10","event":"token","n":1}\n') // 2)
    for i in range(10, 20):
        w.write(_rec(i))
    assert w.unsaved() == 10  # accepted, still in the buffer
    with pytest.raises(TraceWriteError):
        w.close()  # the buffer's records meet the full disk (the first one torn in half)
    assert [d["id"] for d in TraceReader(path).dicts() if d.get("kind") == "request"] == [f"r{i}" for i in range(10)]
    assert w.unsaved() == 10


def test_agent_trace_dir_is_private_when_created_and_refused_when_it_takes_no_file(tmp_path: Path):
    d = tmp_path / "traces"
    r = run_kvtop("agent", "--url", "http://127.0.0.1:9", "--listen", "127.0.0.1:0", "--trace-dir", str(d),
                  "--duration", "1", "--no-gpu", "--no-host", timeout=60)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700, r.stderr  # README: the directory 0700, segments 0600
    r = run_kvtop("agent", "--url", "http://127.0.0.1:9", "--trace-dir", "/proc/self", "--duration", "1",
                  "--no-gpu", "--no-host", timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "cannot write to --trace-dir" in r.stderr


def test_force_replaces_a_trace_file_never_a_device_or_pipe(tmp_path: Path):
    from kvtop.commands._options import replace_output

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    replace_output(str(fifo))  # as root, `-o /dev/null --force` deleted the device node
    assert stat.S_ISFIFO(fifo.stat().st_mode)
    old = tmp_path / "old.jsonl"
    old.write_text("{}\n")
    replace_output(str(old))
    assert not old.exists()


def test_proxy_record_refuses_a_trace_it_would_append_a_second_run_to(tmp_path: Path):
    old = tmp_path / "old.jsonl.gz"
    old.write_bytes(b"\x1f\x8b" + b"\x00" * 100)  # appended to, a gzip trace became unreadable
    r = run_kvtop("proxy", "--upstream", "http://127.0.0.1:9", "--record", str(old), timeout=60)
    assert r.returncode == 2 and "already exists (use --force to overwrite)" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and old.read_bytes() == b"\x1f\x8b" + b"\x00" * 100


def test_simulate_overwrites_only_with_force_and_refuses_an_endless_run(tmp_path: Path):
    """simulate's refusal named --force, which it lacked; and a duration of 1e9 s wrote 2.4 GB a
    minute until stopped. Now --force replaces the old trace (one run, one header), and a duration
    beyond a day is refused before anything is written."""
    out = tmp_path / "s.jsonl"
    first = run_kvtop("simulate", "--preset", "healthy", "--duration", "2", "-o", str(out))
    assert first.returncode == 0, first.stderr
    again = run_kvtop("simulate", "--preset", "healthy", "--duration", "2", "-o", str(out))
    assert again.returncode == 2 and "already exists (use --force to overwrite)" in again.stderr
    forced = run_kvtop("simulate", "--preset", "healthy", "--duration", "3", "-o", str(out), "--force")
    assert forced.returncode == 0, forced.stderr
    assert sum(1 for line in out.read_text().splitlines() if '"kind":"header"' in line.replace(" ", "")) == 1
    endless = tmp_path / "e.jsonl"
    r = run_kvtop("simulate", "--preset", "healthy", "--duration", "1e9", "-o", str(endless))
    assert r.returncode == 2 and "at most 86400 simulated seconds" in r.stderr and not endless.exists()
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_pipe_as_the_trace_is_refused_before_anything_blocks_on_it(tmp_path: Path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    # simulate and import blocked on it for good (simulate even through SIGTERM)
    for args in (("simulate", "--preset", "healthy", "--duration", "2", "-o", str(fifo)),
                 ("import", "vllm-bench", str(tmp_path / "r.json"), "-o", str(fifo))):
        if args[0] == "import":
            (tmp_path / "r.json").write_text(
                '{"ttfts": [0.1], "itls": [[0.02]], "start_times": [1.0], "model_id": "m"}')
        r = run_kvtop(*args, timeout=30)
        assert r.returncode == 2 and "is a pipe or socket" in r.stderr, r.stderr


_DISK_FILLS = """
import sys
import kvtop.model.trace as t
real = t.TraceWriter.write
def write(self, rec, _n=[0]):
    _n[0] += 1
    if _n[0] > 20:  # the disk fills after 20 records
        raise t.TraceWriteError(self.path, OSError(28, "No space left on device"))
    return real(self, rec)
t.TraceWriter.write = write
from kvtop.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("command", ["proxy", "record"])
async def test_a_recording_proxy_keeps_forwarding_when_its_trace_disk_fills(tmp_path: Path, command: str):
    # record's trace writer is a runner sink, whose exception only became a console event that no
    # headless recorder printed: it went on silently, its closing line counted records the disk
    # refused, and it exited 0. Both say it at once now, and fail the run with what was lost.
    import asyncio
    import signal
    import socket
    import sys

    import httpx
    from conftest import REPO

    from kvtop.sim.server import SimServer
    from kvtop.sim.workload import load_preset

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "p.jsonl"
    async with SimServer(load_preset("healthy"), speed=10.0) as srv:
        args = (["proxy", "--upstream", srv.url, "--listen", f"127.0.0.1:{port}", "--record", str(out), "--quiet"]
                if command == "proxy" else
                ["record", "--url", srv.url, "--proxy-listen", f"127.0.0.1:{port}", "-o", str(out), "--no-gpu",
                 "--no-host", "--interval", "5"])
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", _DISK_FILLS, *args,
                                                    env=dict(os.environ, PYTHONPATH=str(REPO)),
                                                    stderr=asyncio.subprocess.PIPE)
        try:
            assert proc.stderr is not None
            assert b"Ctrl-C to stop" in await asyncio.wait_for(proc.stderr.readline(), 30)
            async with httpx.AsyncClient(timeout=30) as c:
                body = {"model": "m", "prompt": "hi", "max_tokens": 16, "stream": True}
                for _ in range(4):  # the disk fills during the first; every one is still answered whole
                    r = await c.post(f"http://127.0.0.1:{port}/v1/completions", json=body)
                    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
            # said while it runs, not at its end
            warned = await asyncio.wait_for(proc.stderr.readline(), 30)
            assert f"kvtop {command}: warning: cannot write".encode() in warned, warned
            assert b"still forwarding, no longer recording" in warned
            # an SSH session that drops stops a recorder in order, as Ctrl-C does
            proc.send_signal(signal.SIGHUP if command == "record" else signal.SIGINT)
            _, err = await asyncio.wait_for(proc.communicate(), 30)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    text = err.decode()
    assert proc.returncode == 1 and "Traceback" not in text, text
    assert "still forwarding" not in text and "record(s) written" not in text  # said once; no count of the lost
    # the 20 records before the disk filled are in the trace; every later one is counted as not recorded
    kept = sum(1 for d in TraceReader(out).dicts() if d.get("kind") != "header")
    assert kept == 20 and TraceReader(out).header["recorder"] == f"kvtop {command}"
    m = re.search(r"No space left on device; (\d+) record\(s\) not recorded \(the traffic was forwarded\)", text)
    assert m and int(m.group(1)) >= 4 * 3, text  # at least arrive, a token and the end of 4 requests


def test_record_without_a_proxy_stops_when_its_disk_fills(tmp_path: Path):
    import subprocess
    import sys

    from conftest import REPO

    out = tmp_path / "r.jsonl"
    sim = subprocess.Popen([sys.executable, "-m", "kvtop", "sim-server", "--port", "0"], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        assert sim.stdout is not None
        url = next(w for line in iter(sim.stdout.readline, "") for w in line.split() if w.startswith("http://"))
        r = subprocess.run([sys.executable, "-c", _DISK_FILLS, "record", "--url", url.rstrip(".,)"), "-o", str(out),
                            "--no-gpu", "--no-host", "--interval", "0.05", "--duration", "1h"],
                           capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO)))
    finally:
        sim.kill()
        sim.wait()
    # an hour's --duration: recording nothing any more, it stopped at once
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "kvtop record: warning: cannot write" in r.stderr and "stopping, no longer recording" in r.stderr
    assert re.search(r"No space left on device; \d+ record\(s\) not recorded$", r.stderr.strip()), r.stderr
