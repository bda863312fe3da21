"""Compact human summary of a Snapshot (``kvtop snapshot --format text``, headless demo/replay).

Plain text, no colour, no Textual: numbers carry their units, unknown values print as ``n/a``.
"""

from __future__ import annotations

from kvtop import units
from kvtop.analysis.report import render_report_text
from kvtop.model.analysis import AnalysisReport
from kvtop.model.records import HostRecord
from kvtop.model.sanitize import printable
from kvtop.snapshot import EngineView, GpuView, Snapshot
from kvtop.units import NA


def _gpu_line(view: GpuView) -> str:
    g = view.record
    if g.lost:
        return f"GPU {g.index} {g.name or ''}: LOST (fell off the bus?)".replace("  ", " ")
    link = NA
    if g.pcie_link_gen is not None or g.pcie_link_width is not None:
        link = f"Gen{g.pcie_link_gen or '?'} x{g.pcie_link_width or '?'}"
        if g.pcie_link_gen_max is not None or g.pcie_link_width_max is not None:
            link += f" (max Gen{g.pcie_link_gen_max or '?'} x{g.pcie_link_width_max or '?'})"
    parts = [
        f"GPU {g.index} {g.name or NA}",
        f"mem {units.bytes_iec(g.mem_used_bytes)} / {units.bytes_iec(g.mem_total_bytes)}",
        f"util {units.num(g.util_pct, '{:.0f}%')}",
        f"PCIe tx {units.byte_rate(g.pcie_tx_bytes_per_s)} rx {units.byte_rate(g.pcie_rx_bytes_per_s)}",
        f"link {link}",
    ]
    if g.engine_proc_mem_bytes is not None:
        parts.append(f"engine procs {units.bytes_iec(g.engine_proc_mem_bytes)}")
    if view.link_downtrained:
        parts.append("LINK DOWNTRAINED")
    return "  ".join(parts)


def _host_line(h: HostRecord) -> str:
    pinned = units.bytes_iec(h.pinned_bytes)
    if h.pinned_bytes is not None and h.pinned_signal:
        pinned += f" ({h.pinned_signal})"
    swap = NA if h.swap_used_bytes is None else f"{units.bytes_iec(h.swap_used_bytes)} / {units.bytes_iec(h.swap_total_bytes)}"
    return (
        f"host  mem available {units.bytes_iec(h.mem_available_bytes)} / {units.bytes_iec(h.mem_total_bytes)}"
        f"  pinned {pinned}  shmem {units.bytes_iec(h.shmem_bytes)}  swap used {swap}"
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
        cap = f" of {units.count(e.kv_capacity_tokens)} tokens"
        if e.block_size is not None:
            cap += f" (block {e.block_size})"
    lines.append(f"  KV cache {units.pct(e.kv_usage)}{cap}  running {units.count(e.running)}  waiting {units.count(e.waiting)}")
    if e.preempts:
        lines.append(f"  preemptions {units.count(e.preemptions_total)} total, {units.per_s(e.preemptions_per_s, 2)}")
    else:
        lines.append("  preemptions: never (this engine does not preempt)")
    lines.append(
        f"  tokens prompt {units.per_s(e.prompt_tokens_per_s)}  generation {units.per_s(e.generation_tokens_per_s)}"
    )
    lines.append(
        f"  ITL p50 {units.duration(e.itl_p50_s)} p99 {units.duration(e.itl_p99_s)}"
        f"  TTFT p50 {units.duration(e.ttft_p50_s)} p99 {units.duration(e.ttft_p99_s)}"
    )
    if e.restarts:
        lines.append(f"  restarted {e.restarts} time(s) during the window (counters reset)")
    for w in e.warnings:
        lines.append(f"  warning: {w}")
    return lines


def _analysis_lines(a: AnalysisReport) -> list[str]:
    """The analysis report as `kvtop analyze` prints it: causes, worst streams, verdict, numbers."""
    return ["", *render_report_text(a).splitlines()]


def render_text(snapshot: Snapshot, trace: tuple[float, float] | None = None) -> str:
    """``trace``: (position, duration) of a replayed trace, in seconds from its start; the header
    then says how much of which trace this is, and the rates' window is at most the part replayed."""
    s = snapshot
    if trace is None:
        span = f"window {s.window_s:.1f} s"
    else:
        at, duration = trace
        span = (f"trace {duration:.1f} s" + (f", replayed to {at:.1f} s" if at < duration else "")
                + f"  rates over the last {min(s.window_s, at):.1f} s")
    out = [f"kvtop {s.kvtop_version}  {s.taken_at}  {span}  ({s.source_label})"]
    if s.itl_target_s is not None:
        out[0] += f"  ITL target {units.duration(s.itl_target_s)}"
    if s.gpu_status != "ok":
        out.append(f"GPU: {NA} ({s.gpu_status})")
    elif not s.gpus:
        out.append("GPU: none found")
    out.extend(_gpu_line(g) for g in s.gpus)
    out.append(_host_line(s.host) if s.host is not None else
               f"host  {NA}" + (f" ({s.host_status})" if s.host_status != "ok" else ""))
    if not s.engines:
        out.append("engines: none configured")
    for e in s.engines:
        out.extend(_engine_lines(e))
    if s.analysis is not None:
        out.extend(_analysis_lines(s.analysis))
    # The one exit to a terminal: label values, model names, paths and messages all pass here.
    return "\n".join(printable(line) for line in out) + "\n"
