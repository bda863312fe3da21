"""Compact human summary of a Snapshot (``kvtop snapshot --format text``, headless demo/replay).

Plain text, no colour, no Textual: numbers carry their units, unknown values print as ``n/a``.
"""

from __future__ import annotations

from kvtop.model.analysis import AnalysisReport
from kvtop.model.sanitize import printable
from kvtop.snapshot import EngineView, GpuView, HostView, Snapshot

NA = "n/a"


def fmt_bytes(v: float | None) -> str:
    if v is None:
        return NA
    x = float(v)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(x) < 1024 or unit == "TiB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return f"{x:.1f} TiB"  # pragma: no cover


def fmt_rate_bytes(v: float | None) -> str:
    """Link traffic in decimal GB/s (how PCIe bandwidth is quoted)."""
    if v is None:
        return NA
    x = float(v)
    for unit, div in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.2f} {unit}"
    return f"{x:.0f} B/s"


def fmt_s(v: float | None) -> str:
    """A latency: ms below a second, s above."""
    if v is None:
        return NA
    return f"{v * 1000:.1f} ms" if abs(v) < 1 else f"{v:.2f} s"


def fmt_num(v: float | None, digits: int = 0) -> str:
    if v is None:
        return NA
    if digits == 0 and float(v).is_integer():
        return f"{int(v):,}"
    return f"{v:,.{digits or 1}f}"


def fmt_pct(v: float | None) -> str:
    return NA if v is None else f"{v * 100:.1f}%"


def fmt_per_s(v: float | None, digits: int = 1) -> str:
    return NA if v is None else f"{v:,.{digits}f}/s"


def _gpu_line(g: GpuView) -> str:
    if g.lost:
        return f"GPU {g.index} {g.name or ''}: LOST (fell off the bus?)".replace("  ", " ")
    link = NA
    if g.pcie_link_gen is not None or g.pcie_link_width is not None:
        link = f"Gen{g.pcie_link_gen or '?'} x{g.pcie_link_width or '?'}"
        if g.pcie_link_gen_max is not None or g.pcie_link_width_max is not None:
            link += f" (max Gen{g.pcie_link_gen_max or '?'} x{g.pcie_link_width_max or '?'})"
    parts = [
        f"GPU {g.index} {g.name or NA}",
        f"mem {fmt_bytes(g.mem_used_bytes)} / {fmt_bytes(g.mem_total_bytes)}",
        f"util {NA if g.util_pct is None else f'{g.util_pct:.0f}%'}",
        f"PCIe tx {fmt_rate_bytes(g.pcie_tx_bytes_per_s)} rx {fmt_rate_bytes(g.pcie_rx_bytes_per_s)}",
        f"link {link}",
    ]
    if g.engine_proc_mem_bytes is not None:
        parts.append(f"engine procs {fmt_bytes(g.engine_proc_mem_bytes)}")
    if g.link_downtrained:
        parts.append("LINK DOWNTRAINED")
    return "  ".join(parts)


def _host_line(h: HostView) -> str:
    pinned = fmt_bytes(h.pinned_bytes)
    if h.pinned_bytes is not None and h.pinned_signal:
        pinned += f" ({h.pinned_signal})"
    swap = NA if h.swap_used_bytes is None else f"{fmt_bytes(h.swap_used_bytes)} / {fmt_bytes(h.swap_total_bytes)}"
    return (
        f"host  mem available {fmt_bytes(h.mem_available_bytes)} / {fmt_bytes(h.mem_total_bytes)}"
        f"  pinned {pinned}  shmem {fmt_bytes(h.shmem_bytes)}  swap used {swap}"
    )


def _engine_lines(e: EngineView) -> list[str]:
    tag = e.adapter or "unknown"
    if e.engine is not None:
        tag += f", engine {e.engine}"
    head = f"engine {e.url} [{tag}]"
    if not e.up:
        why = e.error or "no successful scrape"
        stale = "" if e.stale_s is None else f" (last good scrape {e.stale_s:.1f} s ago)"
        return [f"{head}  DOWN: {why}{stale}"]
    lines = [f"{head}  up  model {e.model or NA}"]
    cap = ""
    if e.kv_capacity_tokens is not None:
        cap = f" of {fmt_num(e.kv_capacity_tokens)} tokens"
        if e.block_size is not None:
            cap += f" (block {e.block_size})"
    lines.append(f"  KV cache {fmt_pct(e.kv_usage)}{cap}  running {fmt_num(e.running)}  waiting {fmt_num(e.waiting)}")
    if e.preempts:
        lines.append(f"  preemptions {fmt_num(e.preemptions_total)} total, {fmt_per_s(e.preemptions_per_s, 2)}")
    else:
        lines.append("  preemptions: never (this engine does not preempt)")
    lines.append(
        f"  tokens prompt {fmt_per_s(e.prompt_tokens_per_s)}  generation {fmt_per_s(e.generation_tokens_per_s)}"
    )
    lines.append(
        f"  ITL p50 {fmt_s(e.itl_p50_s)} p99 {fmt_s(e.itl_p99_s)}"
        f"  TTFT p50 {fmt_s(e.ttft_p50_s)} p99 {fmt_s(e.ttft_p99_s)}"
    )
    if e.restarts:
        lines.append(f"  restarted {e.restarts} time(s) during the window (counters reset)")
    for w in e.warnings:
        lines.append(f"  warning: {w}")
    return lines


def _analysis_lines(a: AnalysisReport) -> list[str]:
    """The analysis report as `kvtop analyze` prints it: causes, worst streams, verdict, numbers."""
    from kvtop.analysis.report import render_report_text

    return ["", *render_report_text(a).splitlines()]


def render_text(snapshot: Snapshot) -> str:
    s = snapshot
    out = [f"kvtop {s.kvtop_version}  {s.taken_at}  window {s.window_s:.1f} s  ({s.source_label})"]
    if s.itl_target_s is not None:
        out[0] += f"  ITL target {fmt_s(s.itl_target_s)}"
    if s.gpu_status != "ok":
        out.append(f"GPU: {NA} ({s.gpu_status})")
    elif not s.gpus:
        out.append("GPU: none found")
    out.extend(_gpu_line(g) for g in s.gpus)
    out.append(_host_line(s.host) if s.host is not None else f"host  {NA}")
    if not s.engines:
        out.append("engines: none configured")
    for e in s.engines:
        out.extend(_engine_lines(e))
    if s.analysis is not None:
        out.extend(_analysis_lines(s.analysis))
    # The one exit to a terminal: label values, model names, paths and messages all pass here.
    return "\n".join(printable(line) for line in out) + "\n"
