"""The vLLM witness: ``vllm serve ... --scheduler-cls kvtop.witness.vllm.WitnessScheduler``.

It subclasses vLLM V1's own scheduler (``AsyncScheduler`` when async scheduling is on, as it is by
default, else ``Scheduler``), changes no scheduling decision, and after each step writes what the step
did to ``$KVTOP_WITNESS_FILE`` (default ``/tmp/kvtop-witness-<uid>/vllm-<pid>.jsonl``): per request the
tokens scheduled, how many were prompt (prefill) or recomputed after a preemption, the tokens it
produced; which requests were preempted, resumed, finished or aborted; the step's wall-clock start and
end. ``kvtop record/tui/agent --witness FILE`` reads it.

Only the vLLM versions in ``SUPPORTED`` are witnessed (the scheduler's internals are not a public
interface): on any other version, or if the witness itself fails, vLLM logs one line and runs its own
scheduler unchanged. The witness never stops the engine.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from kvtop.witness.steplog import DEFAULT_MAX_BYTES, StepBook, StepLog

# vLLM versions whose scheduler internals this module reads (checked against the real engine in the
# real-engine tier: tests/integration/test_real_vllm_witness.py)
SUPPORTED = ("0.32.",)

# under vLLM's own logger: its messages appear in the engine's log, in its format, whatever kvtop
# itself configures
log = logging.getLogger("vllm.kvtop_witness")


def _default_path() -> str:
    # a folder of this user's under /tmp: another user's (or a link) is refused, as the file is
    d = os.path.join("/tmp", f"kvtop-witness-{os.getuid()}")
    os.makedirs(d, mode=0o700, exist_ok=True)
    st = os.lstat(d)
    if not os.path.isdir(d) or os.path.islink(d) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"{d} is not this user's private folder: give KVTOP_WITNESS_FILE")
    return os.path.join(d, f"vllm-{os.getpid()}.jsonl")


class _Witness:
    """Mixed into vLLM's scheduler class. Every hook calls vLLM's own method first or last, unchanged;
    the bookkeeping around it is wrapped so a witness failure turns the witness off, never the engine."""

    requests: dict[str, Any]
    _kvw: StepLog | None = None
    _kvw_book: StepBook
    _kvw_plans: dict[int, tuple[float, list[Any], list[str], list[str], list[tuple[str, int]]]]
    _kvw_aborted: list[str]
    _kvw_last_end: float

    def _kvw_init(self, path: str, engine_version: str, block_size: int | None, private: bool = False) -> None:
        self._kvw_book = StepBook()
        self._kvw_plans = {}
        self._kvw_aborted = []
        self._kvw_last_end = 0.0
        max_bytes = int(os.environ.get("KVTOP_WITNESS_MAX_BYTES", DEFAULT_MAX_BYTES))
        self._kvw = StepLog(path, "vllm", engine_version, max_bytes,
                            {"scheduler": type(self).__mro__[2].__name__, "block_size": block_size,
                             "limits": self._kvw_limits()}, private=private)
        log.info("kvtop witness: writing engine steps to %s", path)

    def _kvw_limits(self) -> dict[str, int | bool]:
        """The limits this scheduler runs under, after vLLM's defaults were applied: what a prescription
        changes, and what it must stay consistent with (a batch limit no larger than the token budget;
        without chunked prefill, a budget no smaller than max_model_len)."""
        sc = getattr(self, "scheduler_config", None)
        out = {"max_num_seqs": getattr(sc, "max_num_seqs", None),
               "max_num_batched_tokens": getattr(sc, "max_num_batched_tokens", None),
               "max_model_len": getattr(self, "max_model_len", None)}
        lim: dict[str, int | bool] = {k: v for k, v in out.items() if isinstance(v, int) and not isinstance(v, bool)}
        chunked = getattr(sc, "enable_chunked_prefill", None)
        if isinstance(chunked, bool):
            lim["chunked_prefill"] = chunked
        return lim

    def _kvw_fail(self, e: BaseException) -> None:
        log.warning("kvtop witness: stopped after an error (%s: %s); vLLM runs on unwitnessed",
                    type(e).__name__, e)
        w, self._kvw = self._kvw, None
        if w is not None:
            try:
                w.close()
            except Exception:  # noqa: BLE001 - the engine must not see it
                pass

    def _update_after_schedule(self, scheduler_output: Any) -> None:
        if self._kvw is not None:
            try:
                self._kvw_plan(scheduler_output)
            except Exception as e:  # noqa: BLE001 - never into the engine
                self._kvw_fail(e)
        super()._update_after_schedule(scheduler_output)  # type: ignore[misc]

    def _kvw_plan(self, so: Any) -> None:
        # before vLLM advances num_computed_tokens: these are the positions this step computes
        plan = self._kvw_book.plan
        reqs = self.requests
        cached = so.scheduled_cached_reqs
        back = set(getattr(cached, "resumed_req_ids", ()) or ())
        # Model Runner V2 (vLLM's default on GPUs) schedules a resumed request as a new one and
        # leaves resumed_req_ids empty: a "new" request that has been preempted before comes back
        for nr in getattr(so, "scheduled_new_reqs", ()) or ():
            rid = getattr(nr, "req_id", None)
            again: Any = reqs.get(rid) if rid is not None else None
            if again is not None and int(getattr(again, "num_preemptions", 0) or 0) > 0:
                back.add(rid)
        spec = getattr(so, "scheduled_spec_decode_tokens", None) or {}
        plans = []
        for rid, n in so.num_scheduled_tokens.items():
            req = reqs[rid]
            plans.append(plan(rid, req.num_computed_tokens, n, req.num_prompt_tokens, len(spec.get(rid, ())),
                              rid in back))
        resumed = sorted(back)
        preempted = sorted(so.preempted_req_ids or ())
        # a resumed request's computed positions before its first step back are the ones the engine
        # found again instead of recomputing: its prefix cache's blocks, or a KV connector's load
        restored = [(rid, int(reqs[rid].num_computed_tokens)) for rid in resumed if rid in reqs]
        self._kvw_plans[id(so)] = (time.time(), plans, preempted, resumed, restored)

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        t_out = time.time()
        outputs = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        if self._kvw is not None:
            try:
                self._kvw_record(scheduler_output, outputs, t_out)
            except Exception as e:  # noqa: BLE001 - never into the engine
                self._kvw_fail(e)
        return outputs

    def _kvw_record(self, so: Any, outputs: Any, t_out: float) -> None:
        planned = self._kvw_plans.pop(id(so), None)
        if planned is None or self._kvw is None:
            return
        t_sched, plans, preempted, resumed, restored = planned
        made: dict[str, int] = {}
        finished: list[tuple[str, str]] = []
        for eco in outputs.values():
            for o in eco.outputs:
                made[o.request_id] = len(o.new_token_ids)  # one output per request per step
                if o.finish_reason is not None:
                    finished.append((o.request_id, str(o.finish_reason)))
                    self._kvw_book.forget(o.request_id)
        get = made.get
        aborted, self._kvw_aborted = self._kvw_aborted, []
        # async scheduling plans step N+1 before step N's output is in: a request that N finished (a
        # stop token, a stop string) is in N+1's plan, and vLLM skips it. So does the witness: its
        # number would otherwise be taken anew and never given back
        live, gone = self.requests, set(aborted)
        reqs = []
        for rid, n, pf, rc in plans:
            if rid in made or rid in live or rid in gone:
                reqs.append((rid, n, pf, rc, get(rid, 0)))
            else:
                self._kvw_book.forget(rid)
        # async scheduling plans step N+1 while N runs: N+1 starts when N's output is in
        t0 = max(t_sched, self._kvw_last_end)
        self._kvw_last_end = t_out
        # the engine going idle writes no further step that would push this one out
        idle = not getattr(self, "running", True) and not getattr(self, "waiting", True)
        self._kvw.step(t0, t_out, reqs, preempted, resumed, finished, aborted, idle=idle, restored=restored)

    def finish_requests(self, request_ids: Any, finished_status: Any) -> Any:
        done = super().finish_requests(request_ids, finished_status)  # type: ignore[misc]
        if self._kvw is not None:
            try:
                # "ab" is the client gone (FINISHED_ABORTED); vLLM also ends requests here with
                # FINISHED_ERROR, which their output's finish reason ("error") already says
                if "ABORT" in str(getattr(finished_status, "name", finished_status)).upper():
                    for r in done:
                        self._kvw_aborted.append(r.request_id)
                for r in done:
                    self._kvw_book.forget(r.request_id)  # its number goes once the end is written
            except Exception as e:  # noqa: BLE001 - never into the engine
                self._kvw_fail(e)
        return done

    def shutdown(self) -> None:
        w, self._kvw = self._kvw, None
        if w is not None:
            try:
                w.close()
            except Exception as e:  # noqa: BLE001 - the engine shuts down regardless
                log.warning("kvtop witness: closing the file failed (%s: %s)", type(e).__name__, e)
        super().shutdown()  # type: ignore[misc]


def _classes() -> tuple[type, type]:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    class WitnessAsync(_Witness, AsyncScheduler):  # type: ignore[misc]
        pass

    class WitnessSync(_Witness, Scheduler):  # type: ignore[misc]
        pass

    return WitnessAsync, WitnessSync


def _plain(cfg: Any) -> Any:
    """vLLM's own scheduler class for this configuration, as far as this vLLM has one: the version
    check comes first, so an older vLLM (no AsyncScheduler before 0.10) still gets its own."""
    from vllm.v1.core.sched.scheduler import Scheduler

    if cfg is not None and getattr(getattr(cfg, "scheduler_config", None), "async_scheduling", False):
        try:
            from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        except ImportError:
            return Scheduler
        return AsyncScheduler
    return Scheduler


def _path(cfg: Any) -> tuple[str, bool]:
    """The witness file: $KVTOP_WITNESS_FILE (or the default, in a private folder: True) for
    data-parallel rank 0, with the rank appended for the others. Each DP rank is its own EngineCore
    process: one shared file would interleave their request numbers and headers."""
    given = os.environ.get("KVTOP_WITNESS_FILE")
    path = given or _default_path()
    pc = getattr(cfg, "parallel_config", None)
    rank = getattr(pc, "data_parallel_rank", 0) if pc is not None else 0
    return (path if not isinstance(rank, int) or rank <= 0 else f"{path}.dp{rank}"), not given


def WitnessScheduler(*args: Any, **kwargs: Any) -> Any:  # noqa: N802 - vLLM calls it as a class
    """What ``--scheduler-cls`` names: builds vLLM's own scheduler, witnessed when the version is known."""
    import vllm

    cfg = kwargs.get("vllm_config")
    version = getattr(vllm, "__version__", "unknown")
    if not version.startswith(SUPPORTED):
        log.warning("kvtop witness: vLLM %s is not supported (supported: %s); running vLLM's own scheduler "
                    "without the witness", version, ", ".join(v + "x" for v in SUPPORTED))
        return _plain(cfg)(*args, **kwargs)
    is_async = bool(cfg is not None and cfg.scheduler_config.async_scheduling)
    witness_async, witness_sync = _classes()
    sched = (witness_async if is_async else witness_sync)(*args, **kwargs)
    try:
        block = getattr(getattr(cfg, "cache_config", None), "block_size", None)
        path, private = _path(cfg)
        sched._kvw_init(path, version, block, private)
    except Exception as e:  # noqa: BLE001 - a file we cannot open must not stop the engine
        sched._kvw = None
        log.warning("kvtop witness: not started (%s: %s); vLLM runs unwitnessed", type(e).__name__, e)
    return sched
