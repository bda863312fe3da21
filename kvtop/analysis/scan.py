"""Analyse a trace file end to end, streaming (never the whole file in memory)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvtop.analysis.analyzer import Analyzer
from kvtop.analysis.engines import engine_semantics
from kvtop.analysis.report import build_report
from kvtop.model.analysis import AnalysisReport
from kvtop.model.trace import TraceReader


def analyze_trace(path: str, itl_target_s: float | None = None, model_config: dict[str, Any] | None = None,
                  kv_bytes: float | None = None, dtype: str = "bf16", tp: int = 1, fast: bool = True,
                  use_request_preempts: bool = True, tick: Callable[[int | None], bool] | None = None) -> AnalysisReport:
    """``tick(bytes read, or None on the streaming path)`` is called as the scan goes (progress);
    True stops it there: the report covers the records read so far and says so in its warnings."""
    reader = TraceReader(path)
    header = reader.header
    eng = (header.get("engine") or {}).get("adapter")
    preempts, settings, counted_at, warn = engine_semantics(eng)
    an = Analyzer(itl_target_s=itl_target_s, preempts=preempts, use_request_preempts=use_request_preempts)
    an.counted_at = counted_at
    an.set_header(header)
    warnings = [warn] if warn else []
    if fast:
        # numpy takes a tenth of a second or more to import: only the fast path loads it
        from kvtop.analysis import fastscan

        if fastscan.available():
            reader.close()
            stopped_at: list[int] = []

            def chunk_tick(done: int) -> bool:
                if tick is not None and tick(done):
                    stopped_at.append(done)
                    return True
                return False

            skipped = fastscan.scan(path, an, tick=chunk_tick if tick is not None else None)
            an.finish()
            if skipped:
                warnings.append(f"{path}: skipped {skipped} malformed line(s) (a torn last line after a crash is normal)")
            if stopped_at:
                warnings.append(f"interrupted: the analysis covers the first {stopped_at[0] / 1e6:.1f} MB of {path}")
            return build_report(an, model_config, kv_bytes, dtype, tp, settings, eng, warnings)
    feed = an.feed_dict
    for n, d in enumerate(reader.dicts()):
        feed(d)
        if tick is not None and n % 4096 == 4095 and tick(None):
            warnings.append(f"interrupted: the analysis covers the first {n + 1} records of {path}")
            break
    an.finish()
    w = reader.warning()
    if w:
        warnings.append(w)
    return build_report(an, model_config, kv_bytes, dtype, tp, settings, eng, warnings)
