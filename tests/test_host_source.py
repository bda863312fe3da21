"""HostSource over a fake /proc and cgroup tree, plus engine PID discovery on real sockets."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from kvtop.sources.host import SIG_CGROUP_SHMEM, SIG_ENGINE_SHMEM, SIG_GUP, SIG_MLOCKED, HostSource
from kvtop.sources.procs import EnginePids, engine_pids_for_url

KiB, GiB = 1024, 2**30

MEMINFO = """\
MemTotal:       65843228 kB
MemFree:         1234567 kB
MemAvailable:   40000000 kB
Buffers:          123456 kB
SwapTotal:       8388604 kB
SwapFree:        8000000 kB
Shmem:           5000000 kB
Mlocked:            1024 kB
HugePages_Total:       0
"""

VMSTAT = """\
nr_free_pages 308641
nr_foll_pin_acquired 3000000
nr_foll_pin_released 1950000
pgfault 99
"""

STATUS = """\
Name:\tpython3
Pid:\t{pid}
VmLck:\t       0 kB
VmPin:\t       0 kB
VmRSS:\t{rss} kB
RssAnon:\t  100000 kB
RssFile:\t   50000 kB
RssShmem:\t{shmem} kB
"""


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, Path]:
    proc, cg = tmp_path / "proc", tmp_path / "cgroup"
    write(proc / "meminfo", MEMINFO)
    write(proc / "vmstat", VMSTAT)
    write(proc / "4242" / "status", STATUS.format(pid=4242, rss=4_400_000, shmem=4194304))
    write(proc / "4243" / "status", STATUS.format(pid=4243, rss=2_000, shmem=1024))
    write(proc / "4242" / "cgroup", "0::/kubepods/pod1/ctr\n")
    write(proc / "self" / "cgroup", "0::/user.slice\n")
    write(cg / "kubepods" / "pod1" / "ctr" / "memory.stat", "anon 123456\nfile 99\nshmem 4294967296\n")
    write(cg / "kubepods" / "pod1" / "ctr" / "memory.max", "68719476736\n")
    write(cg / "user.slice" / "memory.stat", "anon 1\nshmem 7\n")
    write(cg / "user.slice" / "memory.max", "max\n")
    return proc, cg


def src(tree, pids=None, **kw) -> HostSource:
    proc, cg = tree
    return HostSource(proc_root=str(proc), cgroup_root=str(cg), engine_pids=pids, page_size=4096, **kw)


def test_every_number(tree):
    r = src(tree, pids=lambda: {4242, 4243}).poll(3.5)
    assert r.t == 3.5
    assert r.mem_total_bytes == 65843228 * KiB
    assert r.mem_available_bytes == 40000000 * KiB
    assert r.swap_total_bytes == 8388604 * KiB
    assert r.swap_used_bytes == 388604 * KiB
    assert r.shmem_bytes == 5000000 * KiB
    gup = (3000000 - 1950000) * 4096  # 4_300_800_000
    assert r.pinned_signals == {
        SIG_GUP: 4_300_800_000,
        SIG_ENGINE_SHMEM: (4194304 + 1024) * KiB,  # both engine processes
        SIG_CGROUP_SHMEM: 4294967296,  # the engine's cgroup, not kvtop's own
        SIG_MLOCKED: 1024 * KiB,
    }
    assert gup == 4_300_800_000
    # the engine's own figure leads: GUP counts every long-term pin on the host, and no cudaHostAlloc
    assert (r.pinned_signal, r.pinned_bytes) == (SIG_ENGINE_SHMEM, (4194304 + 1024) * KiB)
    assert r.cgroup_shmem_bytes == 4294967296
    assert r.cgroup_mem_max_bytes == 64 * GiB
    assert r.notes == []


def test_without_engine_pids_no_cgroup_figure_and_gup_is_left(tree):
    # kvtop's own cgroup (here a login session's, 7 B of shmem) says nothing of the engine's memory
    r = src(tree).poll(0.0)
    assert SIG_ENGINE_SHMEM not in r.pinned_signals and SIG_CGROUP_SHMEM not in r.pinned_signals
    assert r.cgroup_shmem_bytes is None and r.cgroup_mem_max_bytes is None
    assert r.pinned_signal == SIG_GUP


def test_rdma_pins_never_outrank_the_engines_cuda_pinned_memory(tree):
    proc, _ = tree
    write(proc / "vmstat", "nr_foll_pin_acquired 16384\nnr_foll_pin_released 0\n")  # 64 MiB of RDMA pins
    r = src(tree, pids=lambda: {4242}).poll(0.0)
    assert r.pinned_signals[SIG_GUP] == 64 * 1024 * KiB
    assert (r.pinned_signal, r.pinned_bytes) == (SIG_ENGINE_SHMEM, 4194304 * KiB)


def test_order_falls_through_when_gup_unavailable(tree):
    proc, _ = tree
    write(proc / "vmstat", "nr_free_pages 1\n")  # kernel before 5.8: no FOLL_PIN counters
    r = src(tree, pids=lambda: {4242}).poll(0.0)
    assert r.pinned_signals[SIG_GUP] is None
    assert (r.pinned_signal, r.pinned_bytes) == (SIG_ENGINE_SHMEM, 4194304 * KiB)
    assert any("nr_foll_pin" in n for n in r.notes)
    # No engine either: nothing of the engine's is left to show
    r = src(tree, pids=set).poll(0.0)
    assert r.pinned_signals[SIG_ENGINE_SHMEM] is None
    assert (r.pinned_signal, r.pinned_bytes) == (None, None)


def test_zero_gup_with_engine_shmem_picks_shmem(tree):
    # cudaHostAlloc maps driver pages shared; FOLL_PIN never sees them.
    proc, _ = tree
    write(proc / "vmstat", "nr_foll_pin_acquired 500\nnr_foll_pin_released 500\n")
    r = src(tree, pids=lambda: {4242}).poll(0.0)
    assert r.pinned_signals[SIG_GUP] == 0
    assert (r.pinned_signal, r.pinned_bytes) == (SIG_ENGINE_SHMEM, 4194304 * KiB)


def test_mlocked_never_chosen(tree):
    proc, cg = tree
    write(proc / "vmstat", "nr_free_pages 1\n")
    for f in (cg / "user.slice" / "memory.stat",):
        f.unlink()
    r = src(tree).poll(0.0)
    assert r.pinned_signals[SIG_MLOCKED] == 1024 * KiB
    assert r.pinned_bytes is None and r.pinned_signal is None


def test_missing_everything_is_none_not_a_crash(tmp_path):
    r = HostSource(proc_root=str(tmp_path / "nope"), cgroup_root=str(tmp_path / "nocg"),
                   engine_pids=lambda: {1, 2}).poll(1.0)
    assert r.mem_total_bytes is None and r.mem_available_bytes is None and r.swap_used_bytes is None
    assert r.shmem_bytes is None and r.pinned_bytes is None and r.cgroup_mem_max_bytes is None
    assert r.pinned_signals == {SIG_GUP: None, SIG_ENGINE_SHMEM: None}
    assert any("meminfo: missing" in n for n in r.notes)


def test_engine_process_exited_is_skipped_quietly(tree):
    r = src(tree, pids=lambda: {4242, 77777}).poll(0.0)
    assert r.pinned_signals[SIG_ENGINE_SHMEM] == 4194304 * KiB
    assert not any("77777" in n for n in r.notes)


def test_permission_errors_are_none(tree, monkeypatch):
    # Tests may run as root, where chmod does not deny reads: refuse at the read call instead.
    real = Path.read_text

    def deny(self, *a, **kw):
        if self.name in ("vmstat", "memory.max") or self.parts[-2:] == ("4242", "status"):
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *a, **kw)

    monkeypatch.setattr(Path, "read_text", deny)
    r = src(tree, pids=lambda: {4242}).poll(0.0)
    assert r.pinned_signals[SIG_GUP] is None
    assert r.pinned_signals[SIG_ENGINE_SHMEM] is None
    assert r.cgroup_mem_max_bytes is None
    assert r.pinned_signals[SIG_CGROUP_SHMEM] == 4294967296  # memory.stat still readable
    assert (r.pinned_signal, r.pinned_bytes) == (SIG_CGROUP_SHMEM, 4294967296)
    assert r.mem_total_bytes == 65843228 * KiB
    assert any("vmstat: permission denied" in n for n in r.notes)
    assert any("hidepid" in n for n in r.notes)
    assert any("memory.max: permission denied" in n for n in r.notes)


def test_cgroup_v1_only_host_has_no_cgroup_signal(tree):
    proc, _ = tree
    write(proc / "4242" / "cgroup", "12:memory:/docker/abc\n1:name=systemd:/docker/abc\n")
    r = src(tree, pids=lambda: {4242}).poll(0.0)
    assert SIG_CGROUP_SHMEM not in r.pinned_signals and r.cgroup_shmem_bytes is None


def test_container_with_cgroup_namespace(tree):
    proc, cg = tree
    write(proc / "4242" / "cgroup", "0::/\n")
    write(cg / "memory.stat", "shmem 1048576\n")
    write(cg / "memory.max", "17179869184\n")
    r = src(tree, pids=lambda: {4242}).poll(0.0)
    assert r.cgroup_shmem_bytes == 1048576 and r.cgroup_mem_max_bytes == 16 * GiB


def test_garbage_files(tree):
    proc, cg = tree
    write(proc / "meminfo", "MemTotal: lots kB\n\x00\x01binary\nMemAvailable: 10 kB\n")
    write(cg / "kubepods" / "pod1" / "ctr" / "memory.max", "unlimited-ish\n")
    r = src(tree, pids=lambda: {4242}).poll(0.0)
    assert r.mem_total_bytes is None and r.mem_available_bytes == 10 * KiB
    assert r.cgroup_mem_max_bytes is None and any("unexpected content" in n for n in r.notes)


def test_real_proc_agrees_with_psutil():
    if not Path("/proc/meminfo").exists():
        pytest.skip("no /proc")
    r = HostSource(engine_pids=lambda: {os.getpid()}).poll(0.0)
    vm = psutil.virtual_memory()
    assert r.mem_total_bytes == vm.total
    assert r.swap_total_bytes == psutil.swap_memory().total
    assert r.pinned_signals[SIG_ENGINE_SHMEM] is not None  # our own status is always readable


# -- engine PID discovery ---------------------------------------------------------------------------

def test_engine_pids_from_listening_socket_and_children():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        pids = engine_pids_for_url(f"http://127.0.0.1:{port}/metrics")
        assert os.getpid() in pids and child.pid in pids
        assert engine_pids_for_url(f"http://localhost:{port}") >= {os.getpid()}
        assert engine_pids_for_url(f"127.0.0.1:{port}") >= {os.getpid()}
    finally:
        child.kill()
        child.wait()
        s.close()
    assert os.getpid() not in engine_pids_for_url(f"http://127.0.0.1:{port}/metrics")


def test_engine_pids_remote_or_bad_url_is_empty():
    assert engine_pids_for_url("http://192.0.2.10:8000/metrics") == set()  # TEST-NET: never local
    assert engine_pids_for_url("http://[::1:bad") == set()
    assert engine_pids_for_url("ftp://127.0.0.1/metrics") == set()


def test_engine_pids_cache():
    now = [0.0]
    calls = []

    def lookup(url: str) -> set[int]:
        calls.append(url)
        return {10} if url.endswith("8000") else {20}

    ep = EnginePids(["http://a:8000", "http://a:8001"], ttl_s=30, lookup=lookup, clock=lambda: now[0])
    assert ep() == {10, 20} and len(calls) == 2
    now[0] = 29.0
    assert ep() == {10, 20} and len(calls) == 2
    now[0] = 30.0
    ep()
    assert len(calls) == 4
    # An empty answer (engine still starting) is retried after 5 s, not 30.
    seen = []
    empty = EnginePids(["u"], ttl_s=30, lookup=lambda u: seen.append(u) or set(), clock=lambda: now[0])
    assert empty() == set() and len(seen) == 1
    now[0] += 4.9
    empty()
    assert len(seen) == 1
    now[0] += 0.2
    empty()
    assert len(seen) == 2
