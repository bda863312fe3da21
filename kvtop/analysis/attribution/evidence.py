"""Everything the rules may look at for one spike, gathered in one place.

``gather`` is the only code that reads the stall index and the engine timeline for attribution;
the streaming and the fast path both reach it through ``Analyzer``. The rules
(``preemption``, ``prefill``, ``slow_decode``, ``host``) read an ``Evidence`` and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from kvtop.analysis.asof import Cutoff
from kvtop.analysis.attribution.causes import Cause, Finding
from kvtop.analysis.attribution.spike import Spike
from kvtop.analysis.attribution.thresholds import (
    CHUNKED_TOKENS,
    COARSE_SCRAPE_S,
    DISCOUNT,
    KV_HIGH,
    PROMPT_JUMP_MIN,
    PROMPT_JUMP_REL,
    REL_PREEMPT,
    REL_SLOW,
    RESUME_LEAD_S,
    RETRACT_LAG_S,
    SHARED_FRESH,
    SPARSE_SHARE,
    STEP_EARLY_S,
    TIGHT_TARGET_REL,
    base,
)
from kvtop.analysis.attribution.timeline import EngineTimeline, EngineWindow
from kvtop.analysis.gaps import BURST_S, LOOKAHEAD, Gap
from kvtop.analysis.stalls import Company, StallIndex

# A stream with fewer gaps behind a spike than its look-ahead holds after it is too young to have
# shown a decode-only step of its own: its first steps are often those that prefilled the prompts
# admitted with it (``Evidence.decode_pace``).
YOUNG_GAPS = LOOKAHEAD

if TYPE_CHECKING:
    from kvtop.analysis.witness import Account


@dataclass
class FirstToken:
    """Another request's first token at the end of the stall."""

    request_id: str  # the one with the longest prompt
    prompt_tokens: int | None
    total_prompt_tokens: int = 0  # of every first token at the end (admitted in the same step)
    requests: int = 1
    # the stall's time the engine spent on their prefills by its own times (vLLM's per-request
    # metrics); None where one of them is not engine-timed
    engine_prefill_s: float | None = None


@dataclass
class Evidence:
    gap: Gap  # its length, the stream's stall-free baseline, how it ended, the chunk that ended it, look-ahead
    preempts: bool  # the engine can preempt at all (from its adapter)
    counted_at: str | None  # when its counter steps: "resume" (vLLM V1), "retract" (SGLang), None = unknown
    baseline: float | None  # the stream's stall-free pace, else the run's median gap
    baseline_is_stream: bool
    engine_reported_preempt: bool  # a per-request preempt event inside the gap (engine/simulator)
    active_others: int | None  # other observed streams between first token and end at the stall's middle
    co_stalled: int  # of those, silent over at least half of this stall
    co_fresh: int  # ... and of those, the ones that fell silent with it (not long before)
    co_together: int  # ... and of those, the ones that also came back with it
    co_gap_median: float | None  # median length of their silences
    prev_spike: Spike | None  # the stream's previous spike (judged), if any
    first_token: FirstToken | None
    typical_prompt_delta: float  # prompt tokens the engine adds per scrape, usually
    prefill_rate: float | None  # measured prompt tokens/s (a low estimate; None: not measured yet)
    scrape_interval: float
    target: float | None  # the ITL target
    has_counter: bool  # the engine exports a preemption counter
    tol: float  # how far after the stall a counter step still belongs to it (engines of unknown semantics)
    timeline: EngineTimeline  # engine records; counter units are claimed from it (a spike consumes what it claims)
    stalls: StallIndex  # the other streams
    cut: Cutoff  # what this judgement may know of what came after the stall (``asof``)
    witness: Account | None = None  # the engine's own step log for this stall (a witness ran)
    # another request's prefill, engine-timed, covering at least half the stall: (start, end, prompt, id)
    prefill_span: tuple[float, float, int, str] | None = None
    # a young stream's (``YOUNG_GAPS``): the decode-only pace of the older streams stalled with it
    company_pace: float | None = None
    run_median: float | None = None  # the run's median gap so far (every stream's)
    in_order: bool = False  # the engine admits prompts in arrival order (its adapter's ``admits_in_order``)
    co_start: float | None = None  # the median moment the compared silences (``co_gap_median``'s) began
    co_end: float | None = None  # ... and ended

    # engine readings, read from the timeline when a rule first asks (most spikes never need them)
    @cached_property
    def window(self) -> EngineWindow:
        """KV max, running drop, waiting rise from the scrape before the stall to just after its end;
        prompt-counter increase over the stall and its evidence window."""
        a, b = self.gap.t_start, self.gap.t_end
        return self.timeline.window(a - self.scrape_interval, b + self.tol, b + 0.1)

    @cached_property
    def departures(self) -> int:
        """Streams that ended between the window's two gauge readings."""
        w = self.window
        if w.t_base is None or w.t_state is None:
            return 0
        return self.stalls.departures(w.t_base, w.t_state, self.gap.engine)

    @cached_property
    def scrape_lag(self) -> float:
        """The longest pause between kvtop's own scrapes across the stall."""
        return self.timeline.scrape_lag(self.gap.t_start, self.gap.t_end)

    @cached_property
    def scrape_wait(self) -> float:
        """The whole scrape interval that covers most of the stall (see ``EngineTimeline.covering_interval``)."""
        return self.timeline.covering_interval(self.gap.t_start, self.gap.t_end)

    @cached_property
    def held_reply(self) -> tuple[float, float] | None:
        """A scrape due during the stall that was answered late: (how late, when answered)."""
        return self.timeline.held_reply(self.gap.t_start, self.gap.t_end, self.scrape_interval)

    @cached_property
    def engine_running(self) -> float | None:
        """The engine's running gauge at the stall (all its streams, observed or not)."""
        return self.timeline.running_at(0.5 * (self.gap.t_start + self.gap.t_end))

    # ---- the stall and its stream -----------------------------------------------------------
    @property
    def rel(self) -> float | None:
        return self.gap.gap / self.baseline if self.baseline else None

    @property
    def decode_pace(self) -> float | None:
        """The stream's decode-only pace, at most: its fastest recent gap (a run of prefill steps lifts
        the median of its gaps, never the fastest of them); for a stream too new to have one, the
        fastest gap of its look-ahead (the run's median gap says nothing about an engine that slowed).
        A stream with fewer than ``YOUNG_GAPS`` gaps behind it takes no slower a pace than the older
        streams stalled with it had (``company_pace``), nor a faster one than its look-ahead's: its
        first gaps are often the steps that prefilled the prompts admitted with it, and its fastest
        gap is then one of those."""
        return decode_pace(self.gap, self.baseline, self.baseline_is_stream, self.company_pace)

    @property
    def pace_known(self) -> bool:
        """The decode pace is this stream's own (its gaps before the spike, or after it)."""
        return self.baseline_is_stream or bool(self.gap.after)

    @property
    def resumed(self) -> bool:
        """The stream produced a token again (not a cancel)."""
        return self.gap.ended_by == "token"

    # ---- the other streams ------------------------------------------------------------------
    @property
    def flowing(self) -> int | None:
        """Other active streams that kept receiving tokens through the stall (None: no others)."""
        if not self.active_others:
            return None
        return max(0, self.active_others - self.co_stalled)

    @property
    def alone(self) -> bool:
        """No other observed stream was decoding: none active, or all of them silent since before
        the stall (preempted earlier, still waiting): nothing tells this stream from the engine."""
        f = self.flowing
        return f is None or (f == 0 and self.co_fresh == 0)

    @property
    def others_flowed(self) -> bool:
        """Another stream kept receiving tokens while this one stalled, and most of the others did
        not fall silent and come back with it (when most do, it is one engine-wide or delivery event
        that a few streams' buffered tokens hid: judged as a shared stall), unless the preemption
        counter stepped once for each of them."""
        f = self.flowing
        if f is None or f == 0:
            return False
        if self.co_together < SHARED_FRESH * (self.active_others or 0):
            return True
        # victims that vLLM resumes together once KV frees step the counter once each: as many
        # steps as streams coming back is a batch of resumed victims, not one event (read only where
        # the scrapes are finer than the stall: a coarse interval holds steps of the whole storm)
        return self.has_counter and self.scrape_interval <= self.gap.gap and \
            self.counter_delta() >= self.co_together + 1

    @property
    def observed_share(self) -> float | None:
        """Observed active streams / the engine's running streams (sparse observation when low)."""
        if not self.engine_running or self.active_others is None:
            return None
        return min(1.0, (self.active_others + 1) / self.engine_running)

    # ---- the engine ---------------------------------------------------------------------------
    @property
    def kv_high(self) -> bool:
        return self.window.kv_max is not None and self.window.kv_max >= KV_HIGH

    @property
    def running_drop(self) -> bool:
        # running falls by one whenever a stream finishes (this one too, if its last token ends the
        # gap): only a drop beyond the streams that ended between its readings is evidence
        return self.window.running_drop > self.departures

    @property
    def prompt_jump(self) -> bool:
        """The prompt counter rose well above what the scrapes in the window add at the usual rate."""
        w = self.window
        return w.prompt_delta >= PROMPT_JUMP_MIN and \
            w.prompt_delta > PROMPT_JUMP_REL * self.typical_prompt_delta * max(1, w.intervals)

    @cached_property
    def prompts_done_before(self) -> tuple[int, int, int]:
        """Requests (this stream's own too) whose first token came after the prompt window's first
        scrape and no later than the token that opened the stall: prompts whose prefill was over
        before it began (the prompt counter's rise over the window is theirs, at least in part); and
        those counted later in the window that the engine's own times place outside the stall. How
        many, their prompt tokens, and how many of them have no known prompt length."""
        w = self.window
        a = w.t_base if w.t_base is not None else self.gap.t_start - self.scrape_interval
        b = self.gap.t_start + BURST_S
        n, tokens, unsized = self.stalls.first_tokens_in(self.gap, a, b, self.cut)
        if w.t_prompt_end is not None and w.t_prompt_end > b:
            # and the prompts the window counted later whose prefill the engine itself timed
            # elsewhere (vLLM's per-request metrics): queued through the stall, prefilled after it
            m, more = self.stalls.prefilled_elsewhere(self.gap, b, w.t_prompt_end, self.cut)
            n, tokens = n + m, tokens + more
        return n, tokens, unsized

    @cached_property
    def prefill_observed_in(self) -> bool:
        """Another observed request was between its arrival and its first token during the stall."""
        return self.stalls.prefilling(self.gap, self.gap.t_start, self.gap.t_end, self.cut)

    @cached_property
    def clean_pace(self) -> float | None:
        """The stream's decode-only step where it was last seen with no prompt in flight (the median
        of its last clean gaps, ``StallIndex.clean_gaps``); None: never seen so."""
        v = self.stalls.clean_gaps(self.gap, self.cut, REL_SLOW)
        return sorted(v)[len(v) // 2] if v else None

    def prefill_observed_through(self, judged: int = 0) -> bool:
        """More observed requests were waiting for their first token all through the stall (arrived
        before it, none before its end, within a step's delivery ``BURST_S``) than the engine's
        queue held around it: one of them was in prefill through it (chunks of a long prompt). One
        that arrived late in the stall, or got its first token inside it, had no step of its prompt
        span the stall; the queue's waiting requests (vLLM's ``waiting`` gauge) had none at all.
        ``judged`` of them are left out: the first tokens at the stall's end whose part of it the
        engine's own times already bounded."""
        pending, queued = self._pending_through
        return pending - judged > queued

    @cached_property
    def _pending_through(self) -> tuple[int, float]:
        """(observed requests with no first token all through the stall, the engine's queue then)."""
        g = self.gap
        return (self.stalls.pending_through(g, g.t_start, g.t_end - BURST_S, self.cut),
                self.timeline.waiting_through(g.t_start, g.t_end) or 0.0)

    @cached_property
    def queued_at(self) -> tuple[float, float, float, int] | None:
        """A scrape inside the stall (a decode step from either end) whose gauges leave this stream no
        place in the running batch: running no more than the observed streams flowing then (streams
        between first token and end, less those silent across it), and waiting at least the silent
        ones beyond the observed requests still without a first token. (time, running, waiting,
        silent streams) of the first such scrape, or None."""
        g = self.gap
        edge = max(self.decode_pace or 0.0, BURST_S)
        for t, running, waiting in self.timeline.gauges_in(g.t_start + edge, g.t_end - edge):
            active = self.stalls.active_at(t, g.engine)
            if not active:
                continue
            silent = self.stalls.silent_at(g, t, edge, self.cut.facts)
            if silent < 1 or running > active - silent:
                continue
            if waiting >= silent + self.stalls.pending_through(g, t, t):
                return t, running, waiting, silent
        return None

    @cached_property
    def end_firsts(self) -> tuple[float, int, int, int] | None:
        """The scrape interval in which the stall ended: the first tokens the engine counted there
        (its TTFT histogram) and those kvtop saw there, with their prompt tokens and how many came
        without a prompt length. None where the engine reports no such count."""
        f = self.timeline.firsts_at(self.gap.t_end)
        if f is None:
            return None
        n, tokens, unsized = self.stalls.first_tokens_in(self.gap, f[1], f[2], self.cut)
        return f[0], n, tokens, unsized

    @cached_property
    def end_prompt_excess(self) -> float:
        """Prompt tokens the scrape interval in which the stall ended added beyond the usual: a
        prefill completes as the streams it held resume, so its prompt is counted there. Where the
        engine counts first tokens and kvtop knows the length of every prompt it saw finish there,
        the usual is those prompts instead: the rest is what the prompts kvtop did not see added."""
        d = self.timeline.prompt_at(self.gap.t_end) or 0.0
        f = self.end_firsts
        if f is not None and self.end_excess_unseen:
            return max(0.0, d - f[2])
        return max(0.0, d - self.typical_prompt_delta)

    @property
    def end_excess_unseen(self) -> bool:
        """``end_prompt_excess`` is what prompts kvtop did not see added: the engine counted more first
        tokens there than kvtop saw, and kvtop knows the length of each one it saw."""
        f = self.end_firsts
        return f is not None and f[1] < f[0] and not f[3]

    @cached_property
    def unseen_prompts(self) -> float | None:
        """Prefills the engine completed over the prompt window beyond the first tokens kvtop saw
        there (its TTFT count less the observed first tokens): prompts of requests kvtop does not
        observe. None where the engine reports no such count."""
        w = self.window
        if w.first_delta is None or w.t_base is None or w.t_prompt_end is None:
            return None
        return w.first_delta - self.stalls.first_tokens_in(self.gap, w.t_base, w.t_prompt_end, self.cut)[0]

    @property
    def unseen_prompts_at_end(self) -> float | None:
        """As ``unseen_prompts``, over the scrape interval in which the stall ended."""
        f = self.end_firsts
        return None if f is None else f[0] - f[1]

    @property
    def prompt_excess(self) -> float:
        w = self.window
        return max(0.0, w.prompt_delta - self.typical_prompt_delta * max(1, w.intervals))

    @property
    def counter_unread(self) -> bool:
        """No scrape was read after the stall's end (the run ended first): the counter step of an
        engine that counts at resume cannot be seen at all."""
        last = self.timeline.last_scrape
        return self.counted_at == "resume" and self.resumed and (last is None or last < self.gap.t_end)

    def counter_window(self) -> tuple[float, float, float]:
        """(lo, hi, at): where this stall's preemption would have moved the counter."""
        a, b = self.gap.t_start, self.gap.t_end
        if self.counted_at == "resume" and self.resumed:
            lead = RESUME_LEAD_S
            if self.prefill_rate:
                # the victim re-prefills its prompt and what it generated before its token comes
                lead += self.gap.tokens_before / self.prefill_rate
            return max(a, b - lead), b + STEP_EARLY_S, b
        if self.counted_at == "retract":
            return a - STEP_EARLY_S, min(b, a + RETRACT_LAG_S), a
        return a - STEP_EARLY_S, b + STEP_EARLY_S, b

    def claim_counter(self, yield_to_turns: float | None = None) -> tuple[float, float] | None:
        """Claim one preemption-counter unit for this stall: (scrape time, interval length).
        ``yield_to_turns`` (a weak claim): on an engine counting at resume, leave the unit also to
        longer silences of at least that many of their stream's gaps that end later in the interval."""
        if self.counted_at is None:
            t = self.timeline.claim_counter(self.gap.t_start, self.gap.t_end, self.tol)
            return None if t is None else (t, self.scrape_interval)
        lo, hi, at = self.counter_window()
        if self.counted_at == "resume" and self.resumed:
            # the engine counts each victim as it resumes: streams silent since before this stall
            # began that resume after it inside the same scrape interval own its units first (their
            # spikes are judged after this one; a short stall would take the unit a waiting victim's
            # resume stepped), where their silence was long enough for a victim's turn
            st = self.timeline.unit_in(lo, hi, at)
            if st is not None and self.stalls.resuming_after(self.gap, st[0], st[1], REL_PREEMPT, yield_to_turns) >= st[2]:
                return None
        return self.timeline.claim_in(lo, hi, at)

    def counter_delta(self) -> float:
        """Counter units read around the stall (claimed or not)."""
        if self.counted_at is None:
            return self.timeline.counter_delta(self.gap.t_start - STEP_EARLY_S, self.gap.t_end + self.tol)
        lo, hi, _ = self.counter_window()
        return self.timeline.steps_in(lo, hi)

    # ---- how much the evidence can say ----------------------------------------------------------
    def weaknesses(self, interval: float | None = None, sparse_matters: bool = True) -> tuple[tuple[str, ...], list[str]]:
        """What makes this stall's evidence less specific (``DISCOUNT`` names), and why: coarse
        scrapes, sparse observation and merged chunks. Sparse observation matters to the preemption
        rules (another stream's counter step may be claimed), not to an engine-wide stall."""
        names: list[str] = []
        why = []
        si = interval if interval is not None else self.scrape_interval
        if si > COARSE_SCRAPE_S:
            names.append("coarse")
            why.append(f"engine evidence read over a {si:.1f}s scrape interval")
        share = self.observed_share
        if sparse_matters and share is not None and share < SPARSE_SHARE:
            names.append("sparse")
            why.append(f"only {share:.0%} of the engine's running streams observed")
        if self.gap.tokens_per_event > CHUNKED_TOKENS:
            names.append("chunked")
            why.append(f"the stream arrives in chunks of {self.gap.tokens_per_event:.1f} tokens")
        return tuple(names), why

    def found(self, cause: Cause, key: str, lines: list[str], kind: str, interval: float | None = None,
              sparse_matters: bool = True, weighed: bool = True) -> Finding:
        """A finding of rule ``key`` with its calibrated confidence (``thresholds.base``),
        discounted for each weakness of the evidence (``weighed=False``: none apply)."""
        names, why = self.weaknesses(interval, sparse_matters) if weighed else ((), [])
        tight = self.tight_target
        conf = base(key, tight)
        for n in names:
            conf *= DISCOUNT[n]
        return Finding(cause, conf, lines + why, kind, key=key, discounts=names, tight=tight)

    @property
    def tight_target(self) -> bool:
        """The ITL target is under ``TIGHT_TARGET_REL`` x the run's median gap so far: a few decode steps
        (its findings take ``CONFIDENCE_TIGHT``'s bases)."""
        return bool(self.target and self.run_median and self.target < TIGHT_TARGET_REL * self.run_median)

    def late_first_token_line(self) -> list[str]:
        """Why a first token at the stall's end was not read as its prefill, where a later request
        beat it (``StallIndex.late_first_token``): for the answer that no signal explained it."""
        if not self.in_order:
            return []
        late = self.stalls.late_first_token(self.gap, self.run_median, BURST_S, self.cut)
        if late is None:
            return []
        return [f"request {late[0]}'s first token came at its end, but request {late[1]}, which arrived after it, "
                "had its first token before the stall began: this engine admits prompts in arrival order, so that "
                "prefill was over (its first token was delivered late)"]

    def context_lines(self) -> list[str]:
        """How the stall compares with its stream and with the other streams (leads every answer)."""
        out = []
        rel = self.rel
        if rel is not None:
            out.append(f"gap is {rel:.0f}x this stream's recent gaps")
        if self.active_others:
            older = self.co_stalled - self.co_fresh
            out.append(f"{self.co_stalled}/{self.active_others} other active streams stalled over the same interval"
                       + (f" ({older} of them silent since before it)" if older else ""))
        return out


def decode_pace(g: Gap, baseline: float | None, baseline_is_stream: bool, company: float | None = None) -> float | None:
    """See ``Evidence.decode_pace``; ``company``: ``Evidence.company_pace``."""
    f = g.fast_baseline
    if f and baseline_is_stream:
        if company is not None:
            # not below the stream's own look-ahead: an engine that just slowed shows it only ahead
            return min(f, max(company, min(g.after))) if g.after else min(f, company)
        return f
    return min(g.after) if g.after else baseline


def gather(g: Gap, stalls: StallIndex, median: float | None, target: float | None, timeline: EngineTimeline,
           preempts: bool, settle: float, cut: Cutoff, engine_preempts: list[float] | None = None, counted_at: str | None = None,
           prefill_rate: float | None = None, prev_spike: Spike | None = None,
           witness: Account | None = None, prefill_span: tuple[float, float, int, str] | None = None,
           in_order: bool = False) -> Evidence:
    """Build the evidence for spike ``g`` (called once it has settled: ``settle`` after its end),
    from what was known by its cut-offs (``cut``).

    ``median`` is the run's median gap, ``target`` the ITL target. ``timeline`` holds the engine
    records of the engine that served the stream (the caller picks it); the other streams are those
    of the same engine (``StallIndex`` filters on ``g.engine``)."""
    a, b = g.t_start, g.t_end
    reported = bool(engine_preempts and any(a - 1e-6 <= t <= b + 1e-6 for t in engine_preempts))
    act = stalls.active_at(0.5 * (a + b), g.engine)
    base = g.stream_baseline or median
    after = sorted(g.after)
    company = stalls.company_pace(g, YOUNG_GAPS) if g.stream_baseline and g.gaps_before < YOUNG_GAPS else None
    pace = decode_pace(g, base, bool(g.stream_baseline), company)
    if pace and g.gap < REL_SLOW * pace and not (after and g.gap >= REL_SLOW * after[len(after) // 2]):
        co = Company(0, None, 0, 0, None, None)  # slow decode (see slow_decode.lifted): no need to look for company
    else:
        co = stalls.co_stalled(g, settle, None if act is None else max(1, act - 1))
    si = timeline.interval_at(cut.facts)
    ft = stalls.first_token_near(g, median, BURST_S, cut, in_order)
    return Evidence(
        gap=g, preempts=preempts, counted_at=counted_at, baseline=base, baseline_is_stream=bool(g.stream_baseline),
        engine_reported_preempt=reported, active_others=None if act is None else max(0, act - 1),
        co_stalled=co.stalled, co_fresh=co.fresh, co_together=co.together,
        co_gap_median=co.gap_median, co_start=co.start, co_end=co.end, prev_spike=prev_spike,
        first_token=FirstToken(*ft) if ft else None,
        typical_prompt_delta=timeline.typical_prompt_delta(cut.facts), prefill_rate=prefill_rate, scrape_interval=si,
        target=target,
        has_counter=timeline.has_counter, tol=1.5 * si + 0.25, timeline=timeline, stalls=stalls, cut=cut, witness=witness,
        prefill_span=prefill_span, company_pace=company, run_median=median, in_order=in_order)
