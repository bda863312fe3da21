"""What the HTML report of a trace draws (``kvtop analyze --html``), as one value.

Every fact in it has one owner: the verdict, spikes and causes are the ``AnalysisReport`` that the
text and JSON output print; the charts are the console's history series (``kvtop.history``) over
the whole trace; a request's span is the analysis' own record of its stream. The renderer
(``kvtop.views.html``) only lays them out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvtop.model.analysis import AnalysisReport
from kvtop.snapshot import HistoryWindow


@dataclass(frozen=True, slots=True)
class StreamSpan:
    """One analysed stream: when it arrived, its first and last token, how it ended."""

    id: str
    arrive_t: float | None
    first_t: float | None
    last_t: float | None
    end_t: float | None
    ended_by: str | None
    tokens: int
    prompt_tokens: int | None = None
    engine: str | None = None  # host:port of the engine that served it, when its records name one


@dataclass(frozen=True, slots=True)
class Picture:
    source: str  # the trace's file name
    report: AnalysisReport  # finite (unknown is None), as `analyze` prints it
    history: HistoryWindow
    streams: tuple[StreamSpan, ...]  # every stream the analysis held, in arrival order
    t0: float | None  # the first and the latest record time
    t1: float
    header: dict[str, Any] = field(default_factory=dict)  # the trace header (engine, model, what is missing)
    history_capped: bool = False  # a series reached its cap: the charts show the trace's end only
