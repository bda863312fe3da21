"""Host or API-server stalls: kvtop's own scrapes paused across the stall too.

The recorder scrapes on a fixed beat; a beat missed for seconds means the host (or the engine's
API server, which answers /metrics and streams tokens alike) stalled, not the engine's scheduler.
"""

from __future__ import annotations

from kvtop.analysis.attribution.evidence import Evidence


def scrapes_stalled(ev: Evidence) -> bool:
    lag = ev.scrape_lag
    return lag >= 0.5 * ev.gap.gap and lag >= 2.0 * ev.scrape_interval


def line(ev: Evidence) -> str:
    return f"kvtop's own scrapes stalled {ev.scrape_lag:.1f}s across it: the host or the engine's API server hung"
