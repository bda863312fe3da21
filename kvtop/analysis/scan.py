"""Analyse a trace file end to end, streaming (never the whole file in memory)."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtop.analysis.analyzer import Analyzer
from kvtop.analysis.engines import engine_semantics
from kvtop.analysis.report import build_report
from kvtop.model.analysis import AnalysisReport
from kvtop.model.trace import TraceReader, skipped_note
from kvtop.model.validate import TokenLine

if TYPE_CHECKING:
    from kvtop.picture import Picture

# samples per chart series the HTML report keeps: 12 hours of 1 s scrapes (~1.5 MB a series)
PICTURE_MAX_POINTS = 43_200


@contextmanager
def _no_cycle_collection() -> Iterator[None]:
    """A scan makes many objects that live to its end (each stream's state, the spikes, the engine
    timeline) and next to no cyclic garbage: the cycle collector would walk them over and over
    for nothing (a tenth of the fast path's time on a 2 M-record trace). Off for the scan, on again
    after it (if it was on)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _scan(path: str, itl_target_s: float | None, fast: bool, use_request_preempts: bool,
          observe: Callable[[dict[str, Any]], None] | None,
          tick: Callable[[int | None], bool] | None = None,
          columns: bool = True) -> tuple[Analyzer, list[str], dict[str, str], str | None]:
    """``tick(bytes read, or None on the streaming path)`` is called as the scan goes (progress);
    True stops it there: the report covers the records read so far and says so in its warnings.
    ``columns``: the fast path reads the token lines from the trace's token sidecar, where it has
    a valid one (the same results; ``kvtop.model.token_columns``)."""
    with _no_cycle_collection():
        return _scan_records(path, itl_target_s, fast, use_request_preempts, observe, tick, columns)


def _scan_records(path: str, itl_target_s: float | None, fast: bool, use_request_preempts: bool,
                  observe: Callable[[dict[str, Any]], None] | None, tick: Callable[[int | None], bool] | None,
                  columns: bool) -> tuple[Analyzer, list[str], dict[str, str], str | None]:
    reader = TraceReader(path)
    header = reader.header
    eng = (header.get("engine") or {}).get("adapter")
    sem = engine_semantics(eng)
    settings, warn = sem.settings, sem.warning
    an = Analyzer(itl_target_s=itl_target_s, use_request_preempts=use_request_preempts)
    an.use_engine(sem, eng)  # read once: set_header finds it
    an.set_header(header)
    an.observe = observe
    warnings = [warn] if warn else []
    # what the recorder (or an importer) knew the trace could not hold: the report repeats it
    # rather than let an absent signal read as a quiet one
    missing = header.get("missing")
    if isinstance(missing, list):
        warnings.extend(f"this trace lacks {m}" for m in missing if isinstance(m, str))
    if fast:
        # numpy takes a tenth of a second or more to import: only the fast path loads it
        from kvtop.analysis import fastscan

        if fastscan.available():
            if reader.header_dropped:  # the reader's own warning is not read on this path
                warnings.append(f"{path}: {reader.header_note()}")
            reader.close()
            stopped_at: list[int] = []

            def chunk_tick(done: int) -> bool:
                if tick is not None and tick(done):
                    stopped_at.append(done)
                    return True
                return False

            skipped = fastscan.scan(path, an, tick=chunk_tick if tick is not None else None, columns=columns,
                                    notes=warnings)
            an.finish()
            warnings.extend(an.losses)
            if skipped:
                warnings.append(f"{path}: {skipped_note(skipped)}")
            if stopped_at:
                warnings.append(f"interrupted: the analysis covers the first {stopped_at[0] / 1e6:.1f} MB of {path}")
            return an, warnings, *_learned_engine(an, settings, eng, warnings)
    feed, token = an.feed_dict, an.token
    for n, d in enumerate(reader.items()):
        if isinstance(d, TokenLine):
            an.records += 1  # feed_dict counts the records it is given; token counts tokens only
            token(d.id, d.t, d.n)
        else:
            feed(d)
        if tick is not None and n % 4096 == 4095 and tick(None):
            warnings.append(f"interrupted: the analysis covers the first {n + 1} records of {path}")
            break
    an.finish()
    warnings.extend(an.losses)
    w = reader.warning()
    if w:
        warnings.append(w)
    return an, warnings, *_learned_engine(an, settings, eng, warnings)


def _learned_engine(an: Analyzer, settings: dict[str, str], eng: str | None,
                    warnings: list[str]) -> tuple[dict[str, str], str | None]:
    """The engine's flag names and adapter for the report: the header's, else the adapter its engine
    records named (the analyzer judged by it from the first of them)."""
    if eng is None and an.engine_name is not None and an.semantics is not None:
        if an.semantics.warning:
            warnings.append(an.semantics.warning)
        return an.semantics.settings, an.engine_name
    return settings, eng


def analyze_trace(path: str, itl_target_s: float | None = None, model_config: dict[str, Any] | None = None,
                  kv_bytes: float | None = None, dtype: str = "bf16", tp: int = 1, fast: bool = True,
                  use_request_preempts: bool = True, tick: Callable[[int | None], bool] | None = None,
                  columns: bool = True) -> AnalysisReport:
    an, warnings, settings, eng = _scan(path, itl_target_s, fast, use_request_preempts, None, tick, columns)
    return build_report(an, model_config, kv_bytes, dtype, tp, settings, eng, warnings)


def picture_trace(path: str, itl_target_s: float | None = None, model_config: dict[str, Any] | None = None,
                  kv_bytes: float | None = None, dtype: str = "bf16", tp: int = 1,
                  tick: Callable[[int | None], bool] | None = None) -> Picture:
    """The report of ``analyze_trace`` and, from the same pass, what the HTML report draws beside
    it (``kvtop.picture.Picture``): the console's history series over the trace and every stream's span."""
    # the history store and the picture only when a picture is asked for: `analyze` alone stays lean
    from kvtop.history import History
    from kvtop.model.records import from_dict
    from kvtop.picture import Picture, StreamSpan

    hist = History(max_points=PICTURE_MAX_POINTS)

    def observe(d: dict[str, Any]) -> None:
        try:
            rec = from_dict(d)
            if rec is not None:
                hist.ingest(rec)
        except (TypeError, ValueError):
            pass  # a line the analysis read but a chart cannot (a field of the wrong type): no sample

    an, warnings, settings, eng = _scan(path, itl_target_s, True, True, observe, tick)
    rep = build_report(an, model_config, kv_bytes, dtype, tp, settings, eng, warnings).finite()
    st = an.state()
    streams = tuple(StreamSpan(r.id, r.arrive_t, r.first_t, r.last_t, r.end_t, r.ended_by, r.tokens, r.prompt_tokens,
                               r.engine)
                    for r in st.streams)
    window = hist.window(float("-inf"))
    capped = any(len(s) >= PICTURE_MAX_POINTS for e in window.engines.values() for s in e.values())
    return Picture(Path(path).name, rep, window, streams, st.t0, st.now, dict(st.header), capped)
