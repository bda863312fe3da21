"""The attribution rules as ordered data: ``RULES`` is the order in which they are asked about one spike.

Each row names a rule, the cause it gives (and the ``rule`` names its findings report), the stalls it
applies to, the function that explains the stall, the calibrated confidence entries
(``thresholds.CONFIDENCE``) its findings take, and what it checks in words. ``classify`` asks the rows
in order and returns the first finding. docs/rules.md carries this table as Markdown
(``python -m kvtop.analysis.attribution --markdown`` prints it; tests/test_rules_table.py checks that
they agree), so a rule change is one row here, its rule function and its test.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from functools import partial

from kvtop.analysis.asof import PREFILL_HOLD_S
from kvtop.analysis.attribution import host, preemption, prefill, slow_decode, unknown
from kvtop.analysis.attribution.causes import WITNESS_KINDS, Cause, Finding, Signs
from kvtop.analysis.attribution.evidence import Evidence
from kvtop.analysis.attribution.thresholds import (
    CONFIDENCE,
    CONFIDENCE_TIGHT,
    KV_HIGH,
    RATE_MIN_PROMPT,
    REL_PREEMPT,
    REL_RECOMPUTE,
    REL_SLOW,
    RESUME_LEAD_S,
    SHARED_FRESH,
    STEP_EARLY_S,
    TIGHT_TARGET_REL,
)
from kvtop.analysis.gaps import BURST_S
from kvtop.analysis.streams import RECENT


class Stall(Enum):
    """How the stall relates to the other observed streams (see ``stall_of``)."""

    FLOWED = "flowed"  # another stream kept receiving tokens through it
    ALONE = "alone"  # no other observed stream was decoding
    SHARED = "shared"  # every decoding stream stalled with it


def stall_of(ev: Evidence) -> Stall:
    """While any other stream still received tokens the engine kept stepping: this stream alone was
    left out. In a preemption storm most streams sit silent (preempted earlier, still waiting), so a
    share of silent streams says nothing; an engine-wide stall (a prefill step, a host hiccup) is one
    that nobody streamed through."""
    if ev.others_flowed:
        return Stall.FLOWED
    return Stall.ALONE if ev.alone else Stall.SHARED


@dataclass(frozen=True)
class When:
    """The stalls a rule applies to."""

    says: str  # in the rules table
    stalls: frozenset[Stall]


ANY = When("any stall", frozenset(Stall))
LONE = When("lone: another stream kept flowing, or none was decoding", frozenset({Stall.FLOWED, Stall.ALONE}))
ALONE = When("alone: no other observed stream was decoding", frozenset({Stall.ALONE}))
SHARED = When("shared: every decoding stream stalled with it", frozenset({Stall.SHARED}))

# A rule's answer: a finding, the weaker signs it saw (they lead whatever later rule answers), or nothing.
Explain = Callable[[Evidence], Finding | Signs | None]


@dataclass(frozen=True)
class Rule:
    """One row of the table."""

    key: str
    cause: Cause | None  # None: whichever cause the engine's log shows (the witness)
    kinds: tuple[str, ...]  # the ``rule`` names its findings report (Finding.kind)
    when: When
    explain: Explain
    confidence: tuple[str, ...]  # the thresholds.CONFIDENCE entries its findings take
    checks: str  # what it requires, in words (the rules table)
    context: bool = True  # its answer leads with how the stall compares with its stream and the others


def _mass(ev: Evidence) -> Finding | None:
    """A mass preemption, unless a prefill signal explains the streams falling silent together."""
    return preemption.mass(ev, bool(prefill.signals(ev)[0]))


def _pct(x: float) -> str:
    return f"{x * 100:g} %"


def _witness(ev: Evidence) -> Finding | None:
    return ev.witness.finding() if ev.witness is not None else None


RULES: tuple[Rule, ...] = (
    Rule("witness", None, WITNESS_KINDS, ANY, _witness, (),
         "the engine's own step log (a witness: `--witness`) covers the stall: preempted or recomputed between "
         "its two tokens → preemption (unless the request was back within the target and the gap misses it "
         "without that wait too); else the part of the gap without which it met the target — other requests' "
         "prompt/recompute steps (their time beyond the decode-only steps just before them) → "
         "prefill_interference, time outside the engine, or the wait of tokens the engine made on pace that "
         "reached the client in one chunk (held) → unknown; else the largest part (decode steps → "
         "slow_decode). Exact: confidence 1.0. `witness-ambiguous` (unknown): the decode-only steps just after a "
         "prompt step took a time that none of the 8 before it took (the engine's pace changed there), and the "
         "cause depends on which the step's decode part was. See [The engine as witness](witness.md)",
         context=False),
    Rule("reported", Cause.PREEMPTION, ("reported",), ANY, preemption.reported, ("preemption/reported",),
         "the engine or adapter reported a `preempt` event for this request inside the gap", context=False),
    # the host and delivery rows come before any engine cause: a hung host or a held-back burst
    # leaves the same silence as an engine stall, and no engine setting fixes it
    Rule("host", Cause.UNKNOWN, ("host",), ANY, host.hung, ("unknown/host",),
         "kvtop's own scrapes paused across the stall (≥ half of it and ≥ 2 scrape intervals), or the scrape "
         f"interval covering it came late by ≥ half the stall (and ≥ {host.HOST_LATE_MIN_S:g} s), or a scrape that "
         f"fell due inside the stall was answered ≥ {host.HOST_LATE_MIN_S:g} s late within {host.HELD_REPLY_S:g} s "
         "of the stall's end (however little of the stall was left when it fell due, the reply waited for the same "
         "hang): the host or the engine's API server hung; not when the stream was silent for the ITL target while "
         "kvtop's scrapes were answered on time (before the last reply ahead of the late one, or before the last "
         "token another stream released with the late reply got ahead of its silence: the hang had not begun, and "
         f"after the late reply beyond {host.HELD_REPLY_S:g} s): without the hang it would still have missed the target (a "
         "preemption victim waits through a hang of the API server). Asked before any engine cause"),
    Rule("delivery-continued", Cause.UNKNOWN, ("delivery",), ANY, host.continued, ("unknown/delivery-continued",),
         f"the spike starts within {BURST_S * 1e3:g} ms of where the stream's previous spike, a `delivery` stall, "
         "ended, is no longer than it and did not end with a single token: the same disruption (a longer silence after "
         "the burst is a stall of its own; one token at its end buffered nothing)"),
    Rule("delivery", Cause.UNKNOWN, ("delivery",), ANY, host.delivery, ("unknown/delivery",),
         f"the stall ended with a buffered burst: ≥ {host.BURST_MIN_TOKENS} tokens delivered within "
         f"{BURST_S * 1e3:g} ms of its end that are ≥ {host.BURST_REL:g}× the stream's usual tokens per event or "
         f"more than any one of its recent {RECENT} events carried (more than one engine step: k + 1 tokens with "
         f"speculative decoding), covering ≥ {_pct(host.BURST_EXPLAINS)} of the stall at the stream's own pace "
         "unless the stream finished with it (the engine had made its last token) (a slow reader, API-server "
         "merging, the network); a resumed preemption victim emits one step's worth. Asked "
         "before any engine cause"),
    Rule("queued", Cause.PREEMPTION, ("queued",), ANY, preemption.queued, ("preemption/queued",),
         "a scrape inside the stall (a decode step from either end) read the engine's `running` gauge no higher "
         "than the streams kvtop saw flowing then (streams between first token and end, less those silent across "
         "it) and its `waiting` gauge at least the silent ones beyond the requests still without a first token: "
         "this stream, mid-output and silent, was in the queue, i.e. preempted (vLLM V1 counts it only at resume; "
         "a unit is claimed where one is left)"),
    # a chunked prefill slows every step it rides in: the stream's slower pace is the prefill's doing,
    # so the engine's own timing of another request's prefill is asked before the pace rules
    # (any stall: the streams riding in the same chunk steps get their tokens a few ms apart, so one
    # stream's stall can look as if the others flowed through it)
    Rule("prefill-span", Cause.PREFILL, ("span",), ANY, prefill.span, ("prefill/span",),
         "another request's prefill, as the engine timed it (vLLM `--enable-per-request-metrics`: its first "
         "token less its engine TTFT), covers ≥ half the stall; no preemption counted around the stall; its "
         f"prompt at the measured rate (slowed as in `shared-prefill`) covers ≥ {_pct(prefill.PREFILL_SHARE)} of "
         "the stall's excess over the "
         f"stream's pace; not where the stream's decode steps as last seen with no prompt in flight (the median of "
         "its last clean gaps, at most its fastest recent gap) already missed the target and make up over half the "
         "stall (its cause is then the engine's slow decode); nor where the engine prefilled the prompt in under "
         f"{prefill.SHORT_PREFILL_STEPS:g} of the stream's decode steps (a chat-sized prompt, in a step beside the "
         "stream's decode) and the stall, less the prefill's time inside it less one decode step (the shorter of "
         "the stream's fastest recent gap and its clean decode step), still misses the target. Spikes that may "
         "lie in a prefill not yet reported "
         f"wait up to {PREFILL_HOLD_S:g} s past their end for it (vLLM reports a request's times on its final chunk)"),
    Rule("lifted", Cause.SLOW_DECODE, ("lifted",), ANY, slow_decode.lifted, ("slow/lifted", "slow/lifted-run"),
         f"the gap is < {REL_SLOW:g}× the stream's **decode-only pace** (below), unless the gaps that follow it "
         f"(look-ahead, below) are < 1/{REL_SLOW:g} of it. `slow/lifted-run`: the stream has no gaps of its own "
         "before it (the pace is its look-ahead's, or the run's median gap)", context=False),
    # with nobody else decoding, a prefill that the measured rate confirms comes first: in a storm
    # some counter step is near almost any stall of the only observed stream
    Rule("alone-prefill-checked", Cause.PREFILL, ("lone",), ALONE, partial(prefill.lone, checked_only=True),
         ("prefill/lone-checked",),
         "a prefill explains the stall as in `shared-prefill`, confirmed by the measured prefill rate; asked "
         "before the preemption rules (in a storm some counter step is near almost any stall of the only "
         "observed stream)"),
    Rule("lone-preemption", Cause.PREEMPTION, ("counter", "state", "cancelled", "unread"), LONE, preemption.lone,
         ("preemption/counter", "preemption/state", "preemption/cancelled", "preemption/unread"),
         "`counter`: a preemption-counter unit is claimed from a scrape interval that overlaps the moment the "
         f"engine counts it: **at resume** for vLLM V1 (the interval around the stall's end, reaching back "
         f"{RESUME_LEAD_S:g} s plus the victim's re-prefill at the measured rate), **at retraction** for SGLang "
         f"(around its start), anywhere in the stall ± {STEP_EARLY_S:g} s for engines whose adapter does not say "
         "(`preempt_counted_at`). Each unit is claimed once; a step read from an interval that does not overlap "
         "the stall is somebody else's, however coarse the scrapes. On an engine that counts at resume, the "
         "streams silent since before the stall began that resume after it in the same interval own its units "
         f"first (their spikes are judged later), where that silence was ≥ {REL_PREEMPT:g}× their stream's "
         "recent gaps (a shorter one was a step they shared, no victim's wait). **No claim for a stream that resumed after a silence under "
         f"{REL_PREEMPT:g}× its recent gaps**: a victim is silent through its wait and the step that "
         "re-prefills it. **No claim when no other observed stream "
         "was decoding**: the step may belong to a stream kvtop does not see, and an engine-wide stall looks "
         f"the same from one stream. `state`, `cancelled`: KV ≥ {KV_HIGH:g} with running dropping (beyond the "
         f"streams that finished between the same scrapes) or waiting rising, or KV ≥ {preemption.KV_FULL:g} "
         "while others flow, **only** where the counter cannot speak: the silence ended in a cancel (vLLM never "
         "counts a victim cancelled while waiting), the engine has no counter, or its counting moment is "
         "unknown; `unread`: the run ended before any scrape after the stall was read, so the resume counter "
         "cannot show it. In a storm those gauges hold for every stream, so a stream that resumed on vLLM V1 "
         "without a counter step at its resume is not called a preemption. The signs seen when the evidence "
         "is too weak lead the answer a later rule gives"),
    Rule("alone-prefill", Cause.PREFILL, ("lone",), ALONE, prefill.lone, ("prefill/lone",),
         "a prefill signal as in `shared-prefill` that the measured rate cannot confirm (none measured yet)"),
    Rule("longer", Cause.PREEMPTION, ("longer",), SHARED, preemption.longer_than_company, ("preemption/longer",),
         f"this stream stayed silent > {preemption.LONGER:g}× longer than the other stalled streams (those that "
         "fell silent with it; streams silent since long before are victims still waiting) and longer by at least "
         "one of its decode steps (a victim misses the step it was preempted in) — or fell silent "
         f"≥ {preemption.LEAD_STEPS:g} decode steps (its own or its company's, the slower) before them, came back "
         "with them (within half a step) and is longer by those steps (a victim's missed steps before a re-prefill "
         f"too long for {preemption.LONGER:g}× to show them) — and ≥ "
         f"{REL_PREEMPT:g}× its recent gaps, with a counter unit claimed as in `lone-preemption`; on an "
         "engine that counts at resume, not a unit that a longer silence ending later in the same scrape interval "
         f"(≥ {REL_PREEMPT:g}× its own stream's recent gaps: a victim's turn) owns first"),
    Rule("shared-prefill", Cause.PREFILL, ("shared",), SHARED, prefill.shared,
         ("prefill/shared-checked", "prefill/shared"),
         "other requests' first tokens at its end (their prompts added up: prompts admitted in one step finish "
         "together; not one delivered later after its end than the stall was long, which came out of a later "
         "step), a prompt-counter jump over the stall's evidence window, or (no first token seen: the "
         "request may be unobserved) the prompt tokens that the scrape interval in which the stall ended added "
         "beyond the usual (where the engine counts first tokens and kvtop knows the length of every prompt it "
         "saw finish there: beyond those prompts, and then a first token at its end whose prompt alone falls short "
         "adds that prompt to them: prompts of one step) explain it: those tokens at the **measured** prefill rate "
         "(median prompt tokens / TTFT, a low estimate; where kvtop has none, the engine's prompt tokens over its "
         f"TTFT histogram's sum, if its prompts average ≥ {RATE_MIN_PROMPT} tokens; on an engine that slowed, slowed as "
         "much as the stream's "
         "decode-only pace is now slower than the run's median gap: an engine stepping k times slower prefills k "
         f"times slower too) cover ≥ {_pct(prefill.PREFILL_SHARE)} of the stall's excess over the stream's "
         f"decode-only pace (and, for a chat-sized prompt priced under {prefill.SHORT_PREFILL_STEPS:g} of those "
         "decode steps, the stall less that price less one decode step meets the target: the price is a high one "
         "for so short a prompt, and without its part the stall would still have missed), and that pace is under "
         f"{_pct(prefill.PACE_NEAR)} of the target (else the spike is "
         "slow decode: near the target the pace, not the prefill, decides). First tokens delivered with the "
         "token that opened the stall came out of the step before it and do not count, nor those whose prefill "
         "the engine's own times (vLLM's per-request metrics) place outside the stall, nor, on an engine that admits "
         "prompts in arrival order (its adapter's `admits_in_order`: vLLM), one that a request which arrived after "
         "it, of the same class and with a prompt no shorter, beat to a first token before the stall began (its "
         "prefill was over; its first token was delivered late). Without a measured rate "
         "the first-token signal is taken as is (`prefill/shared`), and so is the jump, but only on a stall "
         f"≥ {REL_SLOW:g}× the stream's own recent gaps (one about as long as them is its pace, not an event). A counter rise counts "
         "only for what the prompts kvtop saw finish (first tokens, the stalled stream's own included) between "
         "the window's first scrape and the stall's start, and those the engine's own times (vLLM's per-request "
         "metrics) place outside the stall, leave of it (nothing, if one has no known length), unless a request "
         "it sees was waiting for its first token during the stall (by the engine's times, where it gave them). "
         "A rise with no first token at the stall's end (the jump, the end interval) counts only where the engine's "
         "own first-token count (its TTFT histogram) shows prompts kvtop did not see, or a request kvtop sees waited "
         "for its first token all through the stall beyond what the engine's queue (`waiting`) held: otherwise "
         "every prompt of the rise is placed by its own first token. **A first token at its end is no signal where "
         "the engine timed its prompt's prefill** (vLLM's per-request metrics) **and the stall, less the part of it "
         "the engine spent on that prefill less one of the stream's decode steps (the part's most), still misses the "
         "target**: the prompt is not why it missed (the witness's own test; on real vLLM such gaps were two "
         "engine steps, one of which ran a ten-token prompt); nor is that request then one that waited through "
         "the stall, nor its prompt part of the end interval's rise beyond the usual"),
    Rule("dominant", Cause.PREFILL, ("dominant",), SHARED, prefill.dominant, ("prefill/dominant",),
         "another request's first token at its end, and the gap is the longest around it and ≥ "
         f"{prefill.PREFILL_DOMINANT:g}× both the stream's pace before it and its decode-only pace after it (the "
         "shortest look-ahead gap, itself within the target); the prompts, at the measured rate slowed as in "
         "`shared-prefill`, cover ≥ "
         f"{_pct(prefill.PREFILL_SHARE)} of the excess; not where the stream's own decode-only pace before it "
         "was already near the target (as in `shared-prefill`). A mostly-prefill step on an engine running "
         "slower (throttled clocks, a flood of short requests), which the slow-decode rules would otherwise take; "
         "not where the engine's own times for the prompts leave the stall missing the target without them "
         "(as in `shared-prefill`)"),
    Rule("onset", Cause.SLOW_DECODE, ("onset", "continued"), ANY, slow_decode.onset, ("slow/onset", "slow/continued"),
         f"the ≥ 2 gaps after it are more than 1/{REL_SLOW:g} as long as it: a new, slower pace, not a stall "
         "(asked after the prefill rules: a run of prefill steps lifts a few gaps too); `continued`: near a "
         "stream's end, a spike right after a slow-decode spike of the same pace"),
    Rule("recompute", Cause.PREFILL, ("recompute",), SHARED, prefill.recompute,
         ("prefill/recompute", "prefill/recompute-long"),
         "on an engine that counts preemptions at resume (vLLM V1), the counter stepped at its end with no new "
         "prompt and a victim was seen resuming as it ended (another stream, silent since before it, came back "
         "with it: within a quarter of its length, ≥ 50 ms, and inside it; after its end by no more than its length): that victim's re-prefill (recompute tokens are in no "
         f"counter), on a stall ≥ {REL_RECOMPUTE:g}× the stream's own recent gaps (a victim resumed as a shorter one "
         "ended re-prefilled from the prefix cache: real vLLM's log held no recompute token in such stalls). A counter step with no victim seen is no call: in a storm the counter steps near almost any "
         "stall (scored against real vLLM's own step log, such steps were almost always another stall's). A stall "
         "longer than one "
         f"re-prefill step ({prefill.RECOMPUTE_STEP_S:g} s) takes `prefill/recompute-long`, a much lower "
         "confidence (a host hang between scrape beats looks the same)"),
    Rule("alone-resumed", Cause.PREFILL, ("recompute",), ALONE, prefill.resumed, ("prefill/resumed",),
         "on an engine that preempts, the only decoding stream stalled (the others silent since before it) and "
         "one of the waiting streams resumed as it ended (as in `recompute`): its re-prefill held the lone "
         f"decoder's step; the stall ≥ {REL_RECOMPUTE:g}× the stream's recent gaps and its own pace within the target, "
         f"and the preemption counter stepped within {prefill.RESUMED_AFTER_S:g} s before its end (else no victim "
         "was waiting)"),
    Rule("mass", Cause.PREEMPTION, ("mass",), SHARED, _mass, ("preemption/mass",),
         "streams fell silent together while the counter rose by ≥ 2 (and ≥ half of them), with no prefill "
         "signal; not on engines that count at resume, where each victim's step comes at its own resume"),
    Rule("pace", Cause.SLOW_DECODE, ("pace",), ANY, slow_decode.pace_missed, ("slow/pace",),
         "the stream's own pace already missed the target"),
    Rule("lone-unknown", Cause.UNKNOWN, ("lone",), LONE, unknown.lone, ("unknown/lone",),
         "nothing above explained it; the evidence says which signal was missing"),
    Rule("shared-unknown", Cause.UNKNOWN, ("shared",), SHARED, unknown.shared, ("unknown/shared",),
         "nothing above explained it"),
)

LEGEND = (
    "A stall is **lone** when another observed stream of the same engine kept receiving tokens through it "
    f"(and fewer than {_pct(SHARED_FRESH)} of the other active streams fell silent and came back with it: one "
    "engine-wide or delivery event that a few streams' buffered tokens hid; unless, with scrapes finer than "
    "the stall, the counter rose once for each of them: vLLM resumes waiting victims as a batch), or when no "
    "other observed stream was decoding (**alone**: none active, or all silent since before it, preempted "
    "earlier and still waiting); otherwise it is **shared**. The first row that answers decides; the signs "
    "a rule saw but found too weak lead the answer a later row gives. A confidence marked *tight* is the "
    f"rule's base where the ITL target is under {TIGHT_TARGET_REL:g}x the run's median gap (a few decode steps)."
)


def markdown(rules: tuple[Rule, ...] = RULES, confidence: dict[str, float] | None = None,
             tight: dict[str, float] | None = None) -> str:
    """The rules table as Markdown, from the rows and the calibrated confidences (a rule's base at a
    tight target beside its base, where it has one)."""
    conf = CONFIDENCE if confidence is None else confidence
    tight = CONFIDENCE_TIGHT if tight is None else tight
    out = ["| order | key | cause (`rule`) | applies when | what it checks | confidence |",
           "|---|---|---|---|---|---|"]
    for i, r in enumerate(rules, 1):
        kinds = ", ".join(f"`{k}`" for k in r.kinds)
        confs = ", ".join(f"`{k}` {conf[k]:.3f}" + (f" (tight {tight[k]:.3f})" if k in tight else "")
                          for k in r.confidence) or "1.000 (read, not inferred)"
        out.append(f"| {i} | `{r.key}` | {r.cause or 'as logged'} ({kinds}) | {r.when.says} | {r.checks} | {confs} |")
    return "\n".join(out) + "\n\n" + LEGEND + "\n"
