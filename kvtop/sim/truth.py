"""Ground-truth labels for gaps the engine itself causes (what attribution is scored against).

A step longer than the ITL target stalls every stream that was decoding through it. The label says
why, from the step's cost breakdown: the decode work alone exceeds the target (``slow_step``,
accumulated over consecutive steps into one run), prefill tokens sharing the step
(``prefill_stall``), or a blocking swap copy the step waited on (``swap_stall``). Preemption and
resume labels come from ``kvtop.sim.preemption``; a client's cancel is labelled here too.
"""

from __future__ import annotations

from typing import Any

from kvtop.model.records import TruthRecord
from kvtop.sim.seq import RUNNING, Seq
from kvtop.sim.stats import Sink


def stalled_streams(dec: list[Seq], sched: list[Seq], t0: float) -> list[str]:
    """Streams whose previous token came at the step's start (call before the step's outputs)."""
    affected = [s.id for s in dec if s.last_t == t0]
    affected += [s.id for s in sched if s.n_sched == 1 and s.generated and s.last_t == t0]
    return affected


def cancel_record(t: float, s: Seq, itl_target_s: float) -> TruthRecord:
    """Why a client gave up: it was a preemption victim, or it sat through a slow step, or it queued."""
    cause = "queue"
    if s.preempted_at is not None:
        cause = "preemption"
    elif s.state == RUNNING and t - s.last_t > itl_target_s:
        cause = "slow_step"
    return TruthRecord(t, "cancel", s.id, {
        "state": s.state, "cause": cause, "silent_s": round(t - s.last_t, 6), "generated": s.generated})


class StallLabeller:
    def __init__(self, itl_target_s: float, sink: Sink):
        self.target = itl_target_s
        self.sink = sink
        self.slow_run: dict[str, Any] | None = None  # the run of slow-decode steps in progress

    def stall(self, t0: float, t_end: float, dec_cost: float, pf_cost: float, blocked_s: float,
              prefills: list[Seq], affected: list[str], n_dec: int) -> None:
        """Label a step longer than the target."""
        if dec_cost > self.target:
            r = self.slow_run
            if r is None:
                self.slow_run = {"t_start": t0, "t_end": t_end, "steps": 1, "max_step_s": t_end - t0,
                                 "max_batch": n_dec, "cause": "slow_decode"}
            else:
                r["t_end"] = t_end
                r["steps"] += 1
                r["max_step_s"] = max(r["max_step_s"], t_end - t0)
                r["max_batch"] = max(r["max_batch"], n_dec)
            return
        if self.slow_run is not None:
            self.close_slow_run(t_end)
        if not affected:
            return
        if pf_cost >= blocked_s:
            main = max(prefills, key=lambda s: s.n_sched) if prefills else None
            self.sink.on_truth(TruthRecord(t_end, "prefill_stall", main.id if main else None, {
                "t_start": t0, "t_end": t_end, "step_s": round(t_end - t0, 6), "cause": "prefill_interference",
                "affected": affected, "prefill_requests": [s.id for s in prefills],
                "prefill_tokens": sum(s.n_sched for s in prefills),
                "recompute": any(s.n_preempts > 0 for s in prefills),
                "decode_only_s": round(dec_cost, 6)}))
        else:
            self.sink.on_truth(TruthRecord(t_end, "swap_stall", None, {
                "t_start": t0, "t_end": t_end, "step_s": round(t_end - t0, 6), "cause": "swap_blocking",
                "affected": affected, "blocked_s": round(blocked_s, 6)}))

    def smooth(self, t_end: float) -> None:
        """A step within the target ends any slow run."""
        if self.slow_run is not None:
            self.close_slow_run(t_end)

    def close_slow_run(self, t: float) -> None:
        """Emit the run of slow steps that just ended (record time = now, so traces stay in order;
        the run's own span is in t_start / t_end)."""
        r = self.slow_run
        self.slow_run = None
        if r is not None:
            r["max_step_s"] = round(r["max_step_s"], 6)
            self.sink.on_truth(TruthRecord(max(t, r["t_end"]), "slow_step", None, r))
