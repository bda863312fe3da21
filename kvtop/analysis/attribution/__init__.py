"""Cause attribution for token-gap spikes.

``evidence.gather`` builds one typed ``Evidence`` per spike; ``classify`` asks the rules in the
order of their table (``rules.RULES``; one module per cause); ``aggregate`` is the fallback for
traces without request records. Thresholds live in ``thresholds`` and are shared by both.
"""

from kvtop.analysis.attribution.causes import ALL, Cause, Finding
from kvtop.analysis.attribution.classify import classify
from kvtop.analysis.attribution.evidence import Evidence, gather
from kvtop.analysis.attribution.timeline import EngineTimeline, EngineWindow

__all__ = ["ALL", "Cause", "EngineTimeline", "EngineWindow", "Evidence", "Finding", "classify", "gather"]
