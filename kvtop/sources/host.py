"""Host source: memory, swap and pinned host memory from /proc and cgroup v2 files.

No counter measures CUDA pinned memory exactly (docs/host-and-gpu.md §5), so every signal is
kept, labelled, in ``pinned_signals`` and the best available one is copied to ``pinned_bytes`` /
``pinned_signal``. ``Mlocked`` / ``VmLck`` / ``VmPin`` never stand in for pinned memory: CUDA
pinned pages do not move them. psutil exposes none of these, so the files are parsed directly.
A missing file or a permission error gives None (and a note), never an exception.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from kvtop.model.records import HostRecord

SIG_GUP = "pinned (all GUP)"
SIG_ENGINE_SHMEM = "engine RssShmem (incl. CUDA pinned)"
SIG_CGROUP_SHMEM = "cgroup shmem"
# Shown for comparison only (operators look at it first); never chosen as the pinned figure.
SIG_MLOCKED = "Mlocked (excludes CUDA pinned)"

# Best first (docs/host-and-gpu.md §5.3; engine-reported pools, the best of all, are merged in by the core).
# The engine's own figures lead: torch's pin_memory (cudaHostAlloc) adds exactly its size to the
# process's RssShmem and its cgroup's shmem, while FOLL_PIN never sees it and counts every other
# long-term pin on the host (RDMA, GPUDirect, io_uring), so system-wide GUP comes last.
_ORDER = (SIG_ENGINE_SHMEM, SIG_CGROUP_SHMEM, SIG_GUP)


class _Unreadable(Exception):
    def __init__(self, path: Path, why: str) -> None:
        super().__init__(f"{path}: {why}")
        self.path, self.why = path, why


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="ascii", errors="replace")
    except PermissionError as e:
        raise _Unreadable(path, "permission denied") from e
    except (FileNotFoundError, ProcessLookupError, NotADirectoryError) as e:
        raise _Unreadable(path, "missing") from e
    except OSError as e:
        raise _Unreadable(path, e.strerror or type(e).__name__) from e


def _kv_file(text: str) -> dict[str, int]:
    """``Key:  123 kB`` (meminfo, status) or ``key 123`` (vmstat, memory.stat) -> bytes/counts."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.replace(":", " ", 1).split()
        if len(parts) < 2:
            continue
        try:
            v = int(parts[1])
        except ValueError:
            continue
        if len(parts) >= 3 and parts[2] == "kB":
            v *= 1024
        out[parts[0]] = v
    return out


class HostSource:
    def __init__(self, proc_root: str = "/proc", cgroup_root: str = "/sys/fs/cgroup",
                 engine_pids: Callable[[], set[int]] | None = None, *, page_size: int | None = None) -> None:
        self.proc = Path(proc_root)
        self.cgroup_root = Path(cgroup_root)
        self._engine_pids = engine_pids
        if page_size is None:
            try:
                page_size = os.sysconf("SC_PAGE_SIZE")
            except (ValueError, OSError, AttributeError):
                page_size = 4096
        self.page_size = int(page_size)

    def poll(self, t: float) -> HostRecord:
        rec = HostRecord(t=t)
        try:
            self._poll(rec)
        except Exception as e:  # a parsing bug must not stop monitoring
            rec.notes.append(f"host read failed: {type(e).__name__}: {e}")
        return rec

    def _poll(self, rec: HostRecord) -> None:
        signals: dict[str, int | None] = {}

        mi = self._kv(self.proc / "meminfo", rec)
        if mi is not None:
            rec.mem_total_bytes = mi.get("MemTotal")
            rec.mem_available_bytes = mi.get("MemAvailable")
            rec.swap_total_bytes = mi.get("SwapTotal")
            if "SwapTotal" in mi and "SwapFree" in mi:
                rec.swap_used_bytes = mi["SwapTotal"] - mi["SwapFree"]
            rec.shmem_bytes = mi.get("Shmem")
            signals[SIG_MLOCKED] = mi.get("Mlocked")

        signals[SIG_GUP] = self._gup(rec)

        pids = self._pids(rec)
        if pids is not None:
            signals[SIG_ENGINE_SHMEM] = self._engine_shmem(pids, rec)

        cg = self._cgroup_dir(pids, rec)
        if cg is not None:
            stat = self._kv(cg / "memory.stat", rec)
            if stat is not None:
                rec.cgroup_shmem_bytes = stat.get("shmem")
                signals[SIG_CGROUP_SHMEM] = rec.cgroup_shmem_bytes
            rec.cgroup_mem_max_bytes = self._mem_max(cg / "memory.max", rec)

        rec.pinned_signals = signals
        rec.pinned_signal, rec.pinned_bytes = self._best(signals)

    @staticmethod
    def _best(signals: dict[str, int | None]) -> tuple[str | None, int | None]:
        avail = [(k, signals[k]) for k in _ORDER if signals.get(k) is not None]
        if not avail:
            return None, None
        # FOLL_PIN does not see cudaHostAlloc (driver-allocated pages mapped shared), so a zero
        # GUP count next to positive shmem means the pins came that way: take the next signal.
        for k, v in avail:
            if v:
                return k, v
        return avail[0]

    # -- readers ------------------------------------------------------------------------------
    def _kv(self, path: Path, rec: HostRecord) -> dict[str, int] | None:
        try:
            return _kv_file(_read(path))
        except _Unreadable as e:
            rec.notes.append(f"{e.path}: {e.why}")
            return None

    def _gup(self, rec: HostRecord) -> int | None:
        vm = self._kv(self.proc / "vmstat", rec)
        if vm is None:
            return None
        acq, rel = vm.get("nr_foll_pin_acquired"), vm.get("nr_foll_pin_released")
        if acq is None or rel is None:
            rec.notes.append(f"{SIG_GUP}: kernel has no nr_foll_pin_* in vmstat (needs 5.7+)")
            return None
        # Both are running counts read non-atomically: never report a negative figure.
        return max(0, acq - rel) * self.page_size

    def _pids(self, rec: HostRecord) -> set[int] | None:
        if self._engine_pids is None:
            return None
        try:
            return set(self._engine_pids())
        except Exception as e:  # the caller's lookup failing means "unknown"
            rec.notes.append(f"engine processes unknown ({type(e).__name__}: {e})")
            return set()

    def _engine_shmem(self, pids: set[int], rec: HostRecord) -> int | None:
        if not pids:
            rec.notes.append(f"{SIG_ENGINE_SHMEM}: no local engine process found")
            return None
        total, read = 0, 0
        for pid in sorted(pids):
            try:
                st = _kv_file(_read(self.proc / str(pid) / "status"))
            except _Unreadable as e:
                if e.why != "missing":  # a process that just exited is no news
                    rec.notes.append(f"{SIG_ENGINE_SHMEM}: {e} (hidepid /proc? run as root)")
                continue
            if "RssShmem" in st:
                total += st["RssShmem"]
                read += 1
        return total if read else None

    def _cgroup_dir(self, pids: set[int] | None, rec: HostRecord) -> Path | None:
        """The cgroup v2 directory of the engine (its first readable pid); none without one: kvtop's
        own cgroup (a login session's tmpfs, a sidecar's container) says nothing of the engine."""
        who = [str(p) for p in sorted(pids or ())]
        for w in who:
            try:
                text = _read(self.proc / w / "cgroup")
            except _Unreadable:
                continue
            for line in text.splitlines():
                # cgroup v2 has the single line "0::/path"; v1 hierarchies have other ids.
                if line.startswith("0::"):
                    rel = line[3:].strip().lstrip("/")
                    d = self.cgroup_root / rel if rel else self.cgroup_root
                    if (d / "memory.stat").exists():
                        return d
            return None  # the first readable answer decides; v1-only hosts have no "0::" line
        return None

    def _mem_max(self, path: Path, rec: HostRecord) -> int | None:
        try:
            text = _read(path).strip()
        except _Unreadable as e:
            if e.why != "missing":  # the root cgroup has no memory.max
                rec.notes.append(f"{e.path}: {e.why}")
            return None
        if text == "max":
            return None
        try:
            return int(text)
        except ValueError:
            rec.notes.append(f"{path}: unexpected content {text[:40]!r}")
            return None
