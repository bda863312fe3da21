"""The event log: what happened to the sources, the engines and the verdict, newest last (bounded).

Every tracker writes its derived events here, and so does the core for the advisor's verdict, so
every front end (console, agent, headless report) logs the same events from the same records.
"""

from __future__ import annotations

from collections import deque

from kvtop.model.analysis import Verdict
from kvtop.model.sanitize import printable
from kvtop.snapshot import EventView

MAX_EVENTS = 500


class EventLog:
    def __init__(self) -> None:
        self._events: deque[EventView] = deque(maxlen=MAX_EVENTS)
        self._last_action: str | None = None

    def add(self, t: float, severity: str, kind: str, message: str) -> None:
        # messages quote URLs and engine text: shown on terminals, so no control sequences
        self._events.append(EventView(t, severity, kind, printable(message, 300)))

    def note_verdict(self, t: float, verdict: Verdict | None) -> None:
        """A changed verdict (the advisor's action) is worth an entry; the first one is not a change."""
        if verdict is None:
            return
        action = verdict.action
        prev, self._last_action = self._last_action, action
        if prev is None or prev == action:
            return
        conf = verdict.confidence
        conf_txt = f" (confidence {conf:.0%})" if isinstance(conf, (int, float)) else ""
        self.add(t, "info", "verdict_change", f"advisor: {prev} -> {action}{conf_txt}")

    def views(self) -> tuple[EventView, ...]:
        return tuple(self._events)
