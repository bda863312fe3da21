"""Thresholds shared by several rules, the evidence and the aggregate (no request records) fallback.

A threshold only one rule reads lives in that rule's module, so changing a rule is one module and
its test. The confidences are fitted (eval/calibrate.py writes them to fitted.json), not chosen.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

REL_SLOW = 2.0  # a spike less than 2x its stream's recent gaps is "all gaps lifted", not an outlier
KV_HIGH = 0.8  # KV usage counted as near full (vLLM frees a victim's blocks at once: it rarely reads 1.0)
SHARED_FRESH = 0.5  # this share of the other active streams falling silent and resuming with a stall makes it shared
PROMPT_JUMP_MIN = 512  # prompt tokens: a smaller rise is no prefill large enough to stall decoding
PROMPT_JUMP_REL = 1.5  # ... and it must be this much above what the scrapes add at the usual rate
STEP_EARLY_S = 0.25  # a counter step may be read this long before the stall's start (scrape skew)
# A prefill rate read from prompts and their TTFT: a prompt shorter than this spends its TTFT on the
# step it rode in, not on its prefill (kvtop's own TTFT sample takes no shorter prompt, the engine's
# counters are read only where its prompts average at least this); read from this many prompts on.
RATE_MIN_PROMPT = 256
RATE_MIN_PROMPTS = 5
# A victim is silent through its wait for re-admission and the step that re-prefills it. A silence
# under this many of the stream's recent gaps was no such turn (it claims no counter unit, and no unit
# is left waiting for it): on the witnessed vLLM rounds A-L the preemption calls on such gaps (the
# counter steps near almost any stall in a storm) were right 5 of 86 times, above it 1,001 of 1,010
# (held out, rounds M-N: 0 of 9 and 144 of 145).
REL_PREEMPT = 5.0
# A victim resuming as a stall of under this many of the stream's recent gaps ended did not hold it
# with its re-prefill (vLLM keeps a preempted request's blocks hashed, so a victim resumed soon after
# re-prefills from the prefix cache): on the witnessed vLLM rounds A-AL at 2.5x the decode step, the
# recompute readings of such stalls (two decode steps, mostly) were right 9 of 39 times, and real
# vLLM's log held no recompute token in the steps of the wrong ones; from 3x to 5x, 37 of 84.
REL_RECOMPUTE = 3.0

# When the counter steps (the engine adapter's ``preempt_counted_at``): vLLM V1 counts a preemption
# when the victim is scheduled again, then re-prefills it and emits a token; SGLang counts at
# retraction. The step must be read from a scrape interval overlapping that moment.
RESUME_LEAD_S = 1.0  # the counter may step this long before the resumed token (plus the measured re-prefill)
RETRACT_LAG_S = 1.0  # ... or this long after the stall began (SGLang)

# Confidence: evidence read from coarse scrapes, or with few of the engine's streams observed, or
# from a stream that arrives in merged chunks, says less about one stream.
COARSE_SCRAPE_S = 2.0
SPARSE_SHARE = 0.5
CHUNKED_TOKENS = 1.5  # tokens per event above which a stream counts as merged

# Calibrated confidence: a finding's confidence is CONFIDENCE[its rule] x DISCOUNT[each weakness of
# its evidence]. Both are data, fitted on traces with exact truth and written to fitted.json by
# ``python -m eval.calibrate --write`` (docs/evaluation.md says how and on which traces). An unknown
# makes no claim to be right or wrong, so its value is set, not fit; a discount at the fit's cap
# (0.99) still moves what reports show (one weakness reads 0.98), so it stays.
FITTED_FILE = "fitted.json"
_FITTED: dict[str, Any] = json.loads(resources.files(__package__).joinpath(FITTED_FILE).read_text(encoding="utf-8"))
CONFIDENCE: dict[str, float] = {k: float(v) for k, v in _FITTED["confidence"].items()}
# The same rules' bases at a tight ITL target (under ``TIGHT_TARGET_REL`` x the run's median gap: the
# 2-3x the decode step operators set), where the real engine judged enough of their calls: there a
# scrape interval holds many stalls, and evidence that names the cause at 100 ms (an interval's
# prompt tokens at the measured rate) is right far less often (docs/evaluation.md). A rule without
# an entry takes its base.
CONFIDENCE_TIGHT: dict[str, float] = {k: float(v) for k, v in _FITTED.get("confidence_tight", {}).items()}
TIGHT_TARGET_REL = 3.0
DISCOUNT: dict[str, float] = {k: float(v) for k, v in _FITTED["discount"].items()}


def base(key: str, tight: bool, confidence: dict[str, float] | None = None,
         confidence_tight: dict[str, float] | None = None) -> float:
    """Rule ``key``'s base confidence, at a tight target (``tight``) its tight base where it has one;
    from the shipped tables, or from the ones given (a fit being judged)."""
    conf = CONFIDENCE if confidence is None else confidence
    at_tight = CONFIDENCE_TIGHT if confidence_tight is None else confidence_tight
    return at_tight.get(key, conf[key]) if tight else conf[key]
