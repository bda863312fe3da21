"""Thresholds shared by several rules, the evidence and the aggregate (no request records) fallback.

A threshold only one rule reads lives in that rule's module, so changing a rule is one module and
its test. The confidences below are fitted (bench/calibrate.py), not chosen.
"""

from __future__ import annotations

REL_SLOW = 2.0  # a spike less than 2x its stream's recent gaps is "all gaps lifted", not an outlier
KV_HIGH = 0.8  # KV usage counted as near full (vLLM frees a victim's blocks at once: it rarely reads 1.0)
SHARED_FRESH = 0.5  # this share of the other active streams falling silent and resuming with a stall makes it shared
PROMPT_JUMP_MIN = 512  # prompt tokens: a smaller rise is no prefill large enough to stall decoding
PROMPT_JUMP_REL = 1.5  # ... and it must be this much above what the scrapes add at the usual rate
STEP_EARLY_S = 0.25  # a counter step may be read this long before the stall's start (scrape skew)

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
# its evidence]. Fit by bench/calibrate.py on kvtop's own simulator (``kvtop simulate`` presets,
# seed 1, 1/5/15 s scrapes): the base is the share of the rule's calls that were right (its plain
# calls where they are most of them, else all with the discounts divided out), a discount the share
# right among the calls it applies to over what the bases predicted. Rules the simulator rarely
# exercises (< 20 calls: it has no engine-wide slowdown, few lone prefills) are fit on bench/tracegen
# seeds 3-6, which the held-out reliability table (tracegen seeds 1-2) never uses; rules rare on both
# keep a hand-set value (marked "set"), as do the "unknown/..." entries: an unknown makes no claim to
# be right or wrong, so there is nothing to fit. The three discounts sit at the fit's cap (0.99) yet
# still move what reports show (a finding with one weakness reads 0.98, not 0.99), so they stay.
# BEGIN FITTED (bench/calibrate.py --write rewrites this block)
CONFIDENCE: dict[str, float] = {
    "preemption/reported": 0.980,  # set
    "preemption/counter": 0.990,  # fit on 463 (discounts divided out)
    "preemption/state": 0.800,  # set
    "preemption/cancelled": 0.800,  # set
    "preemption/unread": 0.600,  # set
    "preemption/longer": 0.990,  # fit on 24 (discounts divided out)
    "preemption/mass": 0.600,  # set
    "prefill/lone-checked": 0.896,  # fit on 80, tracegen seeds 3-6 (discounts divided out)
    "prefill/lone": 0.600,  # set
    "prefill/shared-checked": 0.990,  # fit on 1539 (discounts divided out)
    "prefill/shared": 0.850,  # set
    "prefill/dominant": 0.800,  # set
    "prefill/recompute": 0.990,  # fit on 380, tracegen seeds 3-6 (discounts divided out)
    "prefill/recompute-long": 0.113,  # fit on 303, tracegen seeds 3-6 (discounts divided out)
    "slow/lifted": 0.990,  # fit on 29946
    "slow/lifted-run": 0.990,  # fit on 54
    "slow/continued": 0.986,  # fit on 146, tracegen seeds 3-6
    "slow/onset": 0.974,  # fit on 12687, tracegen seeds 3-6
    "slow/pace": 0.876,  # fit on 6324, tracegen seeds 3-6
    "unknown/host": 0.600,  # set
    "unknown/delivery": 0.600,  # set
    "unknown/delivery-continued": 0.500,  # set
    "unknown/lone": 0.300,  # set
    "unknown/shared": 0.350,  # set
}
DISCOUNT: dict[str, float] = {"coarse": 0.990, "sparse": 0.990, "chunked": 0.990}
# END FITTED
