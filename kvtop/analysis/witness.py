"""The engine's own step log (``step`` records from a witness) and what it says about one stall.

With a witness, a stall's cause is read, not inferred. The client's chunks are mapped to engine steps
by time (the step that produced a request's token ended before its chunk reached the client), never by
counting tokens (the API server holds back and merges tokens whose text is incomplete). Between the
step that produced the token before the stall and the one that produced the token after it:

1. the request was preempted, or recomputed its own KV → **preemption**, unless its wait around that
   (between the tokens the engine made it before and after) met the target and the gap would have
   missed the target without it too (a victim back soon, inside a hold outside the engine: the
   preemption broke no target, and the gap is read as in 2);
2. else, of the time between the two tokens: the part the engine spent on other requests' prompt or
   recompute tokens (each such step's time beyond a decode-only step of that moment: the median of the
   last ``LOCAL_DECODE`` decode-only steps before it, so that an engine slowed by its host does not
   book its slowness to the prompt that happened to ride in one of its steps), the part outside the engine
   (client gap minus engine interval: API server, network, a slow reader), the wait of the request's
   own tokens that the engine made during the gap and the client got in one chunk (had each arrived
   when made, the request would have waited at most its longest engine-side silence there: held by
   the API server's output merging or detokenizer, the network or the reader), and the engine's own
   decode steps. The cause is the part without which the gap would have met the target (prefill first, then
   outside, then held), else the largest part → **prefill_interference**, **unknown** (`outside` or
   `held`: outside the engine's steps) or **slow_decode**. Where the engine's decode-only steps just after such a step took a time
   that none of the ``LOCAL_DECODE`` before it took (the engine slowed or sped up there), the step's
   decode part is known only between the two: if the cause depends on which, the log cannot tell it →
   **unknown** (``witness-ambiguous``, saying so).

This is exact only as far as the witness saw: a request the engine did not log under the stream's id
(no ``X-Request-Id`` join), or a stall whose steps have not arrived yet, gets no answer here and goes
to the inference rules.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import pairwise
from statistics import median
from typing import Any

from kvtop.analysis.attribution.causes import WITNESS_KINDS, Cause, Finding
from kvtop.model.analysis import PrefillCompute, ResumeCosts

# the step that produced a token ends before the token's chunk reaches the client; the engine writes
# wall-clock to the microsecond and kvtop's run clock is mapped onto it, so allow a little slack
MATCH_SLACK_S = 0.002
# A step's prefill cost is its time beyond a decode-only step *then*: the engine's pace drifts (a busy
# host, a growing batch), and against the run's median a slowed engine's every prompt-carrying step
# looked like prefill while the decode-only steps beside it took as long (the stream's own window of
# recent gaps has the same length)
LOCAL_DECODE = 8
# ... and the decode-only steps after it that end within this long of it say whether the engine's
# pace held there: a stall is judged at least MIN_SETTLE_S (2 s) after its end, by when the live and
# the offline analysis have both read them
AFTER_S = 1.0


@dataclass(frozen=True, slots=True)
class Step:
    t0: float
    t1: float
    reqs: dict[str, tuple[int, int, int, int]]  # id -> (scheduled, prefill, recompute, produced)
    preempted: frozenset[str]
    prefill: int  # prompt tokens in the step, all requests
    recompute: int  # recomputed tokens in the step, all requests


@dataclass(frozen=True, slots=True)
class Account:
    """Where the time between two tokens of one request went, by the engine's own log."""

    cause: Cause
    kind: str  # "preempted", "recompute", "prefill", "outside", "held", "decode", "ambiguous"
    gap: float
    engine_s: float  # between the two producing steps' ends
    prefill_s: float  # of it, steps' time beyond a decode step where others' prompt/recompute tokens ran
    outside_s: float  # the gap beyond the engine interval
    decode_s: float  # the rest of the engine interval
    steps: int
    prompt_tokens: int  # others' prompt + recompute tokens in those steps
    decode_step_s: float | None  # a decode-only step just before the stall
    # where the pace changed around a prompt step: (the least and the most time the prompt steps took
    # beyond a decode-only step, a decode-only step just after them)
    shift: tuple[float, float, float] | None = None
    made: int = 0  # this request's tokens the engine produced in the gap
    longest_s: float = 0.0  # the longest the engine left it without a token there (from the token before)

    def finding(self) -> Finding:
        ms = 1e3
        lines = [f"engine step log (witness): {self.steps} step(s) between this request's two tokens, "
                 f"{self.engine_s * ms:.0f} ms in the engine of a {self.gap * ms:.0f} ms gap"]
        if self.kind == "ambiguous" and self.shift is not None:
            lo, hi, after = self.shift
            lines.append(f"other requests' prompt/recompute tokens: {self.prompt_tokens}, in steps whose decode part "
                         f"is not known: a decode-only step took {(self.decode_step_s or 0.0) * ms:.1f} ms just before "
                         f"and {after * ms:.1f} ms just after, so the prompts took {lo * ms:.0f}-{hi * ms:.0f} ms "
                         "beyond decode steps, and at this target the cause depends on which (the engine's pace "
                         "changed there)")
            return Finding(self.cause, 1.0, lines, WITNESS_KINDS[1])
        if self.kind == "held":
            lines.append(f"the engine made {self.made} of this request's tokens in the gap, never more than "
                         f"{self.longest_s * ms:.0f} ms apart, and the client got them in one chunk: the gap was "
                         "their wait outside the engine's steps (the API server's output merging or detokenizer, "
                         "the network, the reader), not the engine's pace")
            return Finding(self.cause, 1.0, lines, WITNESS_KINDS[0])
        if self.kind == "preempted":
            lines.append("the engine preempted this request between the two tokens")
        elif self.kind == "recompute":
            lines.append("the engine recomputed this request's KV between the two tokens (it had been preempted)")
        else:
            lines.append(f"other requests' prompt/recompute tokens: {self.prompt_tokens} "
                         f"({self.prefill_s * ms:.0f} ms beyond decode steps); outside the engine: "
                         f"{self.outside_s * ms:.0f} ms; decode steps: {self.decode_s * ms:.0f} ms"
                         + (f" (a decode-only step took {self.decode_step_s * ms:.1f} ms just before)"
                            if self.decode_step_s else ""))
        return Finding(self.cause, 1.0, lines, WITNESS_KINDS[0])


class StepIndex:
    """Engine steps in time order (per engine key), with per-request lookups by time."""

    def __init__(self, horizon_s: float = 300.0):
        self.horizon_s = horizon_s
        self.steps: list[Step] = []
        self.ends: list[float] = []
        self.by_req: dict[str, list[int]] = {}  # request -> indexes (absolute) of steps that produced its tokens
        self.base = 0  # absolute index of steps[0]
        self.decode_idx: list[int] = []  # absolute indexes of the decode-only steps (``decode_near``)
        self.latest = float("-inf")
        self.n = 0
        # steps that computed prompt/recompute tokens after a decode-only step was seen: how many, their
        # tokens, and their time beyond that decode-only step (PrefillCompute)
        self.compute_steps = 0
        self.compute_tokens = 0
        self.compute_s = 0.0

    def __bool__(self) -> bool:
        return self.n > 0

    def add(self, d: dict[str, Any]) -> int:
        """Index one ``step`` record; the positions it recomputed (0 for a record it cannot read)."""
        try:
            t0, t1 = float(d["t"]), float(d["end"])
            reqs = {str(r[0]): (int(r[1]), int(r[2]), int(r[3]), int(r[4])) for r in d.get("reqs") or ()}
        except (KeyError, TypeError, ValueError, IndexError):
            return 0
        pf = sum(v[1] for v in reqs.values())
        rc = sum(v[2] for v in reqs.values())
        if t1 < self.latest:  # out of order (a second witness, a restart): keep the index sorted
            return rc
        step = Step(t0, t1, reqs, frozenset(str(x) for x in d.get("preempted") or ()), pf, rc)
        i = self.base + len(self.steps)
        self.steps.append(step)
        self.ends.append(t1)
        self.latest = t1
        self.n += 1
        for rid, v in reqs.items():
            if v[3] > 0:
                self.by_req.setdefault(rid, []).append(i)
        if pf == 0 and rc == 0 and reqs:
            self.decode_idx.append(i)
        elif (pf or rc) and (before := self.decode_near(i)[0]):
            # a step of no request (the engine waiting on a remote KV transfer) computed nothing
            self.compute_steps += 1
            self.compute_tokens += pf + rc
            self.compute_s += max(0.0, (t1 - t0) - median(before))
        return rc

    def prune(self, before: float) -> None:
        k = bisect.bisect_left(self.ends, before)
        if k < 1024 and k < len(self.steps) // 2:
            return  # compact in batches
        del self.steps[:k]
        del self.ends[:k]
        self.base += k
        del self.decode_idx[:bisect.bisect_left(self.decode_idx, self.base)]
        for rid in list(self.by_req):
            idx = self.by_req[rid]
            j = bisect.bisect_left(idx, self.base)
            if j >= len(idx):
                del self.by_req[rid]
            elif j:
                del idx[:j]

    def decode_near(self, i: int) -> tuple[list[float], list[float]]:
        """The durations of the decode-only steps around step ``i`` (absolute index): the last
        ``LOCAL_DECODE`` before it, and up to as many after it that ended within ``AFTER_S`` of it
        (those read so far)."""
        steps, base, dix = self.steps, self.base, self.decode_idx
        k = bisect.bisect_left(dix, i)
        before = [steps[j - base].t1 - steps[j - base].t0 for j in dix[max(0, k - LOCAL_DECODE):k]]
        until = steps[i - base].t1 + AFTER_S
        after = []
        k = bisect.bisect_right(dix, i, lo=k)
        for j in dix[k:k + LOCAL_DECODE]:
            s = steps[j - base]
            if s.t1 > until:
                break
            after.append(s.t1 - s.t0)
        return before, after

    def _producer(self, rid: str, t: float) -> int | None:
        """The last step that produced a token of ``rid`` and ended by ``t`` (absolute index)."""
        idx = self.by_req.get(rid)
        if not idx:
            return None
        base, ends = self.base, self.ends  # every index kept is >= base (prune trims both together)
        j = bisect.bisect_right(idx, t + MATCH_SLACK_S, key=lambda i: ends[i - base])
        return idx[j - 1] if j else None

    def account(self, rid: str, t_start: float, t_end: float, target: float | None) -> Account | None:
        """Where the gap ``(t_start, t_end]`` of ``rid`` went; None where the log does not cover it."""
        if t_end > self.latest + MATCH_SLACK_S:
            return None  # the steps that produced the closing token are not in yet
        b = self._producer(rid, t_end)
        a = self._producer(rid, t_start)
        if a is None or b is None or b < a:
            return None
        gap = t_end - t_start
        sa, sb = self.steps[a - self.base], self.steps[b - self.base]
        engine_s = max(0.0, sb.t1 - sa.t1)
        between = self.steps[a - self.base + 1: b - self.base + 1]
        first = self.decode_near(a + 1)[0] if between else []
        dec = median(first) if first else None
        prefill_s = 0.0
        # the prompt steps' time beyond a decode-only step, read against the slower and the faster of
        # the steps before and after each (where they differ), and the last "after" read
        lo = hi = 0.0
        after_last = None
        tokens = 0
        made, ends = self._made(rid, a, b)
        longest = max((y - x for x, y in pairwise(ends)), default=0.0)
        tgt = target if target is not None else 0.0
        for i, s in enumerate(between, a + 1):
            mine = s.reqs.get(rid)
            out = "preempted" if rid in s.preempted else "recompute" if mine is not None and mine[2] > 0 else None
            # the request's wait around it (between the tokens the engine made it before and after):
            # one it waited out within the target, in a gap that would miss the target without it too,
            # broke no target (a victim resumed soon, inside a hold outside the engine)
            if out is not None and ((wait := _around(ends, s.t1)) > tgt or gap - wait <= tgt):
                return Account(Cause.PREEMPTION, out, gap, engine_s, 0.0, max(0.0, gap - engine_s), engine_s,
                               len(between), 0, dec, None, made, longest)
            own = mine[1] + mine[2] if mine is not None else 0
            others = s.prefill + s.recompute - own
            if others > 0:
                tokens += others
                near_before, near_after = self.decode_near(i)
                dur, before = s.t1 - s.t0, median(near_before) if near_before else 0.0
                prefill_s += max(0.0, dur - before)
                # the pace changed at it where the decode-only steps after it took a time that none of
                # those before it took (a spread within theirs is the pace's own jitter)
                after = median(near_after) if near_after else None
                shifted = after is not None and bool(near_before) and not min(near_before) <= after <= max(near_before)
                after_last = after if shifted else after_last
                refs = (before, after if shifted and after is not None else before)
                lo += max(0.0, dur - max(refs))
                hi += max(0.0, dur - min(refs))
        prefill_s = min(prefill_s, engine_s)
        outside_s = max(0.0, gap - engine_s)
        cause, kind = _decide(gap, engine_s, prefill_s, outside_s, tgt, longest)
        if hi - lo > 0 and ({_decide(gap, engine_s, min(p, engine_s), outside_s, tgt, longest) for p in (lo, hi)}
                            != {(cause, kind)}):
            return Account(Cause.UNKNOWN, "ambiguous", gap, engine_s, prefill_s, outside_s,
                           max(0.0, engine_s - prefill_s), len(between), tokens, dec,
                           (min(lo, engine_s), min(hi, engine_s), after_last or 0.0), made, longest)
        return Account(cause, kind, gap, engine_s, prefill_s, outside_s, max(0.0, engine_s - prefill_s), len(between),
                       tokens, dec, None, made, longest)

    def _made(self, rid: str, a: int, b: int) -> tuple[int, list[float]]:
        """``rid``'s tokens produced by the steps after ``a`` through ``b`` (absolute indexes, both its
        producers), and the ends of ``a`` and of those steps."""
        idx, base = self.by_req[rid], self.base
        ends = [self.steps[a - base].t1]
        made = 0
        for i in idx[bisect.bisect_right(idx, a):bisect.bisect_right(idx, b)]:
            s = self.steps[i - base]
            made += s.reqs[rid][3]
            ends.append(s.t1)
        return made, ends


def _around(ends: list[float], t: float) -> float:
    """The length of the wait between two of a request's tokens (their steps' ``ends``) that holds
    trace time ``t`` (the last one where ``t`` is past them all)."""
    k = min(max(1, bisect.bisect_left(ends, t)), len(ends) - 1)
    return ends[k] - ends[k - 1] if len(ends) > 1 else 0.0


def _decide(gap: float, engine_s: float, prefill_s: float, outside_s: float, tgt: float,
            longest_s: float) -> tuple[Cause, str]:
    """The cause of a gap from where its time went: the part without which it met the target
    (prefill first, then outside, then the wait of tokens made during it: had each reached the client
    when made, its longest wait would have been ``longest_s``), else the largest part."""
    decode_s = max(0.0, engine_s - prefill_s)
    if prefill_s > 0 and gap - prefill_s <= tgt:
        return Cause.PREFILL, "prefill"
    if outside_s > 0 and gap - outside_s <= tgt:
        return Cause.UNKNOWN, "outside"
    if longest_s <= tgt < gap:
        return Cause.UNKNOWN, "held"
    part = max((prefill_s, 0), (outside_s, 1), (decode_s, 2))[1]
    return ((Cause.PREFILL, "prefill"), (Cause.UNKNOWN, "outside"), (Cause.SLOW_DECODE, "decode"))[part]


def prefill_compute(indexes: Iterable[StepIndex]) -> PrefillCompute | None:
    """The engines' prompt/recompute steps over a run; None where no witness logged one."""
    steps = tokens = 0
    secs = 0.0
    for idx in indexes:
        steps += idx.compute_steps
        tokens += idx.compute_tokens
        secs += idx.compute_s
    return PrefillCompute(steps, tokens, secs) if steps else None


class ResumeTally:
    """Restored vs recomputed positions of resumed requests over a run (``ResumeCosts``): what the
    engine's resume mechanism bought, read from the witness's ``restored`` entries."""

    def __init__(self) -> None:
        self.resumes = 0
        self.restored = 0
        self.recomputed = 0

    def add(self, d: dict[str, Any], recomputed: int) -> None:
        self.recomputed += recomputed
        for r in d.get("restored") or ():
            try:
                n = int(r[1])
            except (TypeError, ValueError, IndexError):
                continue
            if n >= 0:
                self.resumes += 1
                self.restored += n

    def report(self) -> ResumeCosts | None:
        """None where no resume was reported (no witness, or one too old to say)."""
        return ResumeCosts(self.resumes, self.restored, self.recomputed) if self.resumes else None
