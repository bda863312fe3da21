"""A simulated request's state inside the engine, and the plan of one engine step.

``Seq`` is a plain slotted record that the block pool, the preemption logic and the scheduler all
read and update; each of them owns a subset of its fields (see the comments). It holds lengths and
times only, never prompt or completion text.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from kvtop.sim.workload import RequestSpec

WAITING, RUNNING, SWAPPED, SWAPPING_IN, DONE = "waiting", "running", "swapped", "swapping_in", "done"


class Seq:
    __slots__ = (
        "id", "order", "arrival_t", "cls", "prompt", "out_len", "max_tokens", "priority", "prefix_id",
        "prefix_tokens", "patience", "key", "state", "num_tokens", "computed", "generated", "blocks",
        "shared", "n_sched", "last_t", "first_t", "preempted_at", "pending_preempts", "n_preempts",
        "materialising", "host_blocks", "out_done", "ready_t", "cancelled", "counted_prefix",
        "resume_info", "user",
    )

    def __init__(self, spec: RequestSpec, order: int, t: float):
        self.id = spec.id
        self.order = order
        self.arrival_t = t
        self.cls = spec.cls
        self.prompt = spec.prompt_tokens
        self.out_len = max(1, spec.output_tokens)
        self.max_tokens = spec.max_tokens
        self.priority = spec.priority
        self.prefix_id = spec.prefix_id
        self.prefix_tokens = spec.prefix_tokens if spec.prefix_id else 0
        self.patience = spec.patience_s
        # running list order and victim choice: least important, then most recently arrived, last
        self.key = (spec.priority, order)
        self.state = WAITING
        self.num_tokens = spec.prompt_tokens  # tokens known (prompt + generated)
        self.computed = 0  # tokens whose KV is on the GPU
        self.generated = 0
        # block pool: blocks held (shared + private), of which shared-prefix blocks (refcounted)
        self.blocks = 0
        self.shared = 0
        self.materialising = False  # this sequence computes a prefix that others will share
        self.counted_prefix = False  # prefix-cache query counted once per request (vLLM #25787)
        self.n_sched = 0  # tokens scheduled in the step in flight
        self.last_t = t  # last token time (arrival before the first token)
        self.first_t: float | None = None
        # preemption: stall start, preemptions not yet counted (vLLM V1 counts at resume), swap state
        self.preempted_at: float | None = None
        self.pending_preempts = 0
        self.n_preempts = 0
        self.host_blocks = 0
        self.out_done = 0.0  # a swap-out's copy ends (the swap-in cannot start before)
        self.ready_t = 0.0  # an overlapped swap-in's copy ends
        self.resume_info: dict[str, Any] | None = None
        self.cancelled = False
        self.user: object = None  # owner's per-request data (the HTTP server's stream queue)


def order_key(s: Seq) -> tuple[int, int]:
    return s.key


class StepPlan(NamedTuple):
    """One scheduled step: what runs and what it costs (times in simulated seconds)."""

    t0: float
    t_end: float | None
    dec: list[Seq]  # plain decodes (the commit fast path)
    sched: list[Seq]  # everything else: prefill chunks, first decodes after a resume
    n_dec: int
    pf_tokens: int
    dec_cost: float
    pf_cost: float
    blocked_s: float  # time the step waited on blocking swap copies
    prefills: list[Seq]
