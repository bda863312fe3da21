"""Analyse a trace file end to end, streaming (never the whole file in memory)."""

from __future__ import annotations

from typing import Any

from kvtop.analysis.analyzer import Analyzer
from kvtop.analysis.engines import engine_semantics
from kvtop.analysis.report import build_report
from kvtop.model.analysis import AnalysisReport
from kvtop.model.trace import TraceReader


def analyze_trace(path: str, itl_target_s: float | None = None, model_config: dict[str, Any] | None = None,
                  kv_bytes: float | None = None, dtype: str = "bf16", tp: int = 1, fast: bool = True,
                  use_request_preempts: bool = True) -> AnalysisReport:
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
            skipped = fastscan.scan(path, an)
            an.finish()
            if skipped:
                warnings.append(f"{path}: skipped {skipped} malformed line(s) (a torn last line after a crash is normal)")
            return build_report(an, model_config, kv_bytes, dtype, tp, settings, eng, warnings)
    feed = an.feed_dict
    for d in reader.dicts():
        feed(d)
    an.finish()
    w = reader.warning()
    if w:
        warnings.append(w)
    return build_report(an, model_config, kv_bytes, dtype, tp, settings, eng, warnings)
