"""vLLM launcher flags (what ``kvtop advise --emit-flags`` prints) as simulated-engine settings.

So a prescription can be tried on the simulator exactly as it would be on vLLM:
``kvtop sim-server --preset P --engine-flags "$(kvtop advise --trace T --emit-flags)"``.

| flag | simulated engine |
|---|---|
| ``--max-num-seqs N`` | ``max_num_seqs`` |
| ``--max-num-batched-tokens N`` | ``max_num_batched_tokens`` (the chunk and the decodes beside it where chunked prefill is on) |
| ``--max-model-len N`` | ``max_model_len`` (prompt + output bound) |
| ``--kv-offloading-size GIB`` | ``preemption_mode: swap`` with a host pool of GIB GiB, copies overlapped with compute (V1's connector is asynchronous) |
| ``--kv-offloading-backend native`` | the host tier itself (needs the size) |
| ``--enable-chunked-prefill`` / ``--no-enable-chunked-prefill`` | ``chunked_prefill`` |
| ``--gpu-memory-utilization F`` | KV blocks scaled by F / 0.9 (vLLM's default share), as the KV cache gets what the weights leave |
| ``--kv-cache-memory-bytes B`` | KV blocks = B // (block size x bytes per token), as vLLM sizes its cache per GPU from B (it then ignores the memory share for the cache) |

Any other flag has no simulated counterpart: a one-line error, never silently ignored. A budget below
the batch limit, or below ``max_model_len`` with chunked prefill off, is refused as vLLM refuses it
(vllm/config/scheduler.py, ``verify_max_model_len``).
"""

from __future__ import annotations

import shlex
from dataclasses import replace

from kvtop.sim.workload import Workload, WorkloadError

VLLM_DEFAULT_GPU_UTIL = 0.9
_GIB = 1 << 30


def _int(flag: str, v: str) -> int:
    try:
        n = int(v)
    except ValueError:
        raise WorkloadError(f"{flag} needs a whole number, not {v!r}") from None
    if n < 1:
        raise WorkloadError(f"{flag} must be at least 1, not {n}")
    return n


def _num(flag: str, v: str) -> float:
    try:
        x = float(v)
    except ValueError:
        raise WorkloadError(f"{flag} needs a number, not {v!r}") from None
    if not 0 < x < float("inf"):  # "inf" parses, and would be a pool of every byte there is
        raise WorkloadError(f"{flag} must be a positive number, not {v}")
    return x


def apply_engine_flags(workload: Workload, flags: str) -> Workload:
    """The workload with its engine set as these vLLM flags would set it."""
    try:
        words = shlex.split(flags)
    except ValueError as e:
        raise WorkloadError(f"--engine-flags: {e}") from None
    eng = replace(workload.engine, step=workload.engine.step, swap=replace(workload.engine.swap))
    offload_size: float | None = None
    kv_bytes: int | None = None
    backend = False
    batch_given = False  # the flags set the batch limit or the token budget
    i = 0
    while i < len(words):
        w = words[i]
        flag, eq, inline = w.partition("=")
        takes_value = flag not in ("--enable-chunked-prefill", "--no-enable-chunked-prefill")
        if takes_value and not eq:
            if i + 1 >= len(words):
                raise WorkloadError(f"--engine-flags: {flag} needs a value")
            val = words[i + 1]
            i += 2
        else:
            val = inline
            i += 1
        if flag == "--max-num-seqs":
            eng.max_num_seqs = _int(flag, val)
            batch_given = True
        elif flag == "--max-num-batched-tokens":
            eng.max_num_batched_tokens = _int(flag, val)
            batch_given = True
        elif flag == "--max-model-len":
            eng.max_model_len = _int(flag, val)
        elif flag == "--kv-offloading-size":
            offload_size = _num(flag, val)
        elif flag == "--kv-offloading-backend":
            if val != "native":
                raise WorkloadError(f"--kv-offloading-backend {val}: the simulator models only the native backend")
            backend = True
        elif flag == "--enable-chunked-prefill":
            eng.chunked_prefill = True
        elif flag == "--no-enable-chunked-prefill":
            eng.chunked_prefill = False
        elif flag == "--gpu-memory-utilization":
            util = _num(flag, val)
            if util > 1:
                raise WorkloadError(f"--gpu-memory-utilization must be at most 1, not {val}")
            if kv_bytes is None:  # vLLM: an explicit KV size wins over the memory share
                eng.num_gpu_blocks = max(2, int(eng.num_gpu_blocks * util / VLLM_DEFAULT_GPU_UTIL))
        elif flag == "--kv-cache-memory-bytes":
            kv_bytes = _int(flag, val)
            if kv_bytes // eng.block_bytes < 2:
                raise WorkloadError(f"--kv-cache-memory-bytes {kv_bytes} holds fewer than 2 KV blocks of "
                                    f"{eng.block_bytes} bytes")
        else:
            raise WorkloadError(f"--engine-flags: {flag} has no simulated counterpart")
    if kv_bytes is not None:
        eng.num_gpu_blocks = kv_bytes // eng.block_bytes
    if batch_given and eng.max_num_batched_tokens < eng.max_num_seqs:
        # vLLM's SchedulerConfig refuses the same pair at start-up: every running sequence's decode
        # token is taken from the budget
        raise WorkloadError(f"--engine-flags: max_num_batched_tokens ({eng.max_num_batched_tokens}) must be at "
                            f"least max_num_seqs ({eng.max_num_seqs}), as vLLM requires")
    if eng.num_gpu_blocks * eng.block_size < eng.max_model_len:
        # vLLM will not start an engine whose KV cache cannot hold one request of max_model_len
        # (vllm/v1/core/kv_cache_utils.py, _check_enough_kv_cache_memory: "... KV cache is needed, which is
        # larger than the available KV cache memory")
        raise WorkloadError(f"--engine-flags: the KV cache holds {eng.num_gpu_blocks * eng.block_size} tokens, fewer "
                            f"than max_model_len ({eng.max_model_len}), which vLLM refuses at start (lower "
                            "--max-model-len or give the cache more memory)")
    if not eng.chunked_prefill and eng.max_num_batched_tokens < eng.max_model_len:
        raise WorkloadError(f"--engine-flags: max_num_batched_tokens ({eng.max_num_batched_tokens}) is smaller than "
                            f"max_model_len ({eng.max_model_len}) with chunked prefill off, which vLLM refuses "
                            "(--enable-chunked-prefill, or a budget of at least max_model_len)")
    if backend and offload_size is None:
        raise WorkloadError("--kv-offloading-backend needs --kv-offloading-size")
    if offload_size is not None:
        eng.preemption_mode = "swap"
        eng.swap.host_capacity_bytes = offload_size * _GIB
        eng.swap.overlap = True
    return replace(workload, engine=eng, traffic_len_cap=workload.traffic_len_cap or workload.engine.max_model_len)
