"""A stand-in ``vllm`` package with the scheduler hook points kvtop's witness uses.

``kvtop.witness.vllm`` subclasses vLLM's scheduler; on machines without vLLM (the unit tests, the
witness overhead bench) this package stands in for it. It mirrors what the witness relies on in vLLM
0.32's ``vllm/v1/core/sched/scheduler.py``: ``requests`` (id -> request with ``num_computed_tokens``,
``num_prompt_tokens``), ``running``/``waiting``, ``_update_after_schedule`` advancing computed tokens
after a step is planned, ``update_from_output`` returning ``{client: EngineCoreOutputs}`` whose
``outputs`` carry ``request_id``, ``new_token_ids``, ``finish_reason``, ``finish_requests`` and
``shutdown``; ``scheduler_config`` and ``max_model_len`` as ``Scheduler.__init__`` keeps them. The real vLLM runs the witness in tests/integration/test_real_vllm_witness.py.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any


class FakeScheduler:
    def __init__(self, **kw: Any) -> None:
        self.kw = kw
        cfg = kw.get("vllm_config")
        # as vLLM's Scheduler.__init__ keeps them
        self.scheduler_config = getattr(cfg, "scheduler_config", None)
        self.max_model_len = getattr(getattr(cfg, "model_config", None), "max_model_len", None)
        self.requests: dict[str, Any] = {}
        self.running: list[Any] = []
        self.waiting: list[Any] = []

    def _update_after_schedule(self, so: Any) -> None:
        for rid, n in so.num_scheduled_tokens.items():
            self.requests[rid].num_computed_tokens += n

    def update_from_output(self, so: Any, mro: Any) -> dict[int, Any]:
        fin = mro.get("fin", {})
        outs = [SimpleNamespace(request_id=rid, new_token_ids=[7] * k, finish_reason=fin.get(rid))
                for rid, k in mro["made"].items()]
        return {0: SimpleNamespace(outputs=outs)}

    def finish_requests(self, ids: Any, status: Any) -> list[Any]:
        return [self.requests[i] for i in ids]

    def shutdown(self) -> None:
        self.shut = True


class FakeAsyncScheduler(FakeScheduler):
    pass


def config(async_scheduling: bool, block_size: int = 16, max_num_seqs: int = 16,
           max_num_batched_tokens: int = 2048, max_model_len: int = 1024) -> SimpleNamespace:
    """The parts of a ``VllmConfig`` the witness reads."""
    return SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=async_scheduling, max_num_seqs=max_num_seqs,
                                                            max_num_batched_tokens=max_num_batched_tokens),
                           cache_config=SimpleNamespace(block_size=block_size),
                           model_config=SimpleNamespace(max_model_len=max_model_len))


def scheduler_output(sched: dict[str, int], preempted: Any = (), resumed: Any = ()) -> SimpleNamespace:
    return SimpleNamespace(num_scheduled_tokens=sched, preempted_req_ids=set(preempted),
                           scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=set(resumed)))


def request(rid: str, prompt_tokens: int, computed: int = 0) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, num_computed_tokens=computed, num_prompt_tokens=prompt_tokens)


@contextmanager
def installed(version: str = "0.32.0") -> Iterator[types.ModuleType]:
    """``import vllm`` (and the two scheduler modules) resolve to the stand-in inside the block."""
    names = ("vllm", "vllm.v1", "vllm.v1.core", "vllm.v1.core.sched", "vllm.v1.core.sched.scheduler",
             "vllm.v1.core.sched.async_scheduler")
    saved = {n: sys.modules.get(n) for n in names}
    mods = {n: types.ModuleType(n) for n in names}
    mods["vllm"].__version__ = version  # type: ignore[attr-defined]
    mods["vllm.v1.core.sched.scheduler"].Scheduler = FakeScheduler  # type: ignore[attr-defined]
    mods["vllm.v1.core.sched.async_scheduler"].AsyncScheduler = FakeAsyncScheduler  # type: ignore[attr-defined]
    sys.modules.update(mods)
    try:
        yield mods["vllm"]
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m
