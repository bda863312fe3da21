"""Thresholds shared by the per-spike rules and the aggregate (no request records) fallback."""

from __future__ import annotations

REL_SLOW = 2.0  # a spike less than 2x its stream's recent gaps is "all gaps lifted", not an outlier
KV_HIGH = 0.8  # KV usage counted as near full (vLLM frees a victim's blocks at once: it rarely reads 1.0)
KV_FULL = 0.95
LONGER = 1.2  # a co-stalled victim stalled this much longer than the others: it was preempted too
PROMPT_JUMP_MIN = 512  # prompt tokens: a smaller rise is no prefill large enough to stall decoding
PROMPT_JUMP_REL = 1.5  # ... and it must be this much above what the scrapes add at the usual rate
STEP_EARLY_S = 0.25  # a counter step may be read this long before the stall's start (scrape skew)
