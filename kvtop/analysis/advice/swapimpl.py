"""What "swap" means per implementation: its GPU cost, copy size and the settings that enable it.

Facts (kvtop's engine notes): vLLM V0 swapped with blocking per-layer, per-block copies (one
layer's K or V for a 16-token block; ``--swap-space`` GiB, removed from vLLM in 2026-03); vLLM V1
has no swap, its substitute is the asynchronous KV offloading connector
(``--kv-offloading-size`` GiB over all ranks + ``--kv-offloading-backend native|lmcache``), whose
native layout copies one contiguous block across all layers; LMCache stores chunks (256 tokens by
default), and vLLM sets its ``local_cpu`` / ``max_local_cpu_size`` (GB per rank, the vLLM size / (TP·PP))
itself; SGLang HiCache backs the radix cache with a host pool (``--enable-hierarchical-cache``,
``--hicache-size`` GB per rank, overriding ``--hicache-ratio``), written asynchronously.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvtop.analysis.advice.costmodel import EPSILON_ASYNC

BLOCK_TOKENS = 16
LMCACHE_CHUNK_TOKENS = 256
GIB = 1 << 30


@dataclass(frozen=True)
class Impl:
    name: str
    kappa: float | None  # GPU cost fraction of the copy time; None: no host tier
    copy: str  # how one contiguous copy is made: layer_block | block | chunk
    note: str


IMPLEMENTATIONS = {
    "vllm_v0_swap": Impl("vllm_v0_swap", 1.0, "layer_block",
                         "vLLM V0 --swap-space: blocking copies of one layer's K or V per 16-token block"),
    "vllm_v1_offload": Impl("vllm_v1_offload", EPSILON_ASYNC, "block",
                            "vLLM V1 KV offloading connector (native): asynchronous 16-token blocks across all layers"),
    "lmcache": Impl("lmcache", EPSILON_ASYNC, "chunk",
                    "LMCache CPU backend: asynchronous 256-token chunks"),
    "sglang_hicache": Impl("sglang_hicache", EPSILON_ASYNC, "block",
                           "SGLang HiCache: host pool behind the radix cache, asynchronous write-back"),
    "none": Impl("none", None, "block", "no host KV tier"),
}


def copy_bytes(impl: Impl, token_bytes_rank: float, layers_rank: float) -> float:
    """Bytes per contiguous copy ``g`` for the link model."""
    if impl.copy == "layer_block" and layers_rank > 0:
        # K or V of one layer for one block: half of that layer's per-token bytes x 16
        return BLOCK_TOKENS * token_bytes_rank / layers_rank / 2
    if impl.copy == "chunk":
        return LMCACHE_CHUNK_TOKENS * token_bytes_rank
    return BLOCK_TOKENS * token_bytes_rank


@dataclass(frozen=True)
class HostTierSettings:
    """The settings that give the host pool (``(generic setting, flag as the engine spells it or
    None, value)``) and what the operator must know beside them: what the engine derives itself,
    what it requires of the size."""

    settings: list[tuple[str, str | None, Any]]
    notes: list[str]


def settings_for(impl_name: str | None, pool_total_bytes: float, ranks: int, names: dict[str, str],
                 device_pool_total_bytes: float | None = None,
                 host_limit_bytes: float | None = None) -> HostTierSettings:
    """The settings that give a host pool of ``pool_total_bytes`` (all ranks) for this implementation.

    ``device_pool_total_bytes``: the GPUs' KV pool (all ranks), where known. SGLang's HiCache backs
    that pool up to the host, so its host pool must exceed it (releases up to at least 0.5.9 refuse
    a smaller one: "The host memory should be larger than the device memory with the current
    protocol"; later ones start and warn that the L2 cache is less effective).
    """
    ranks = max(1, ranks)
    gib_total = max(1, math.ceil(pool_total_bytes / GIB))
    per_rank_gb = pool_total_bytes / ranks / 1e9
    if impl_name == "vllm_v0_swap":
        # --swap-space is per GPU
        return HostTierSettings([("preemption_mode", "--preemption-mode", "swap"),
                                 ("swap_space", "--swap-space", max(1, math.ceil(pool_total_bytes / ranks / GIB)))],
                                [])
    if impl_name == "vllm_v1_offload":
        return HostTierSettings([("offload_backend", "--kv-offloading-backend", "native"),
                                 ("offload_size", "--kv-offloading-size", gib_total)], [])
    if impl_name == "lmcache":
        # vllm/config/vllm.py: the size switches offloading on; since vllm-project/vllm#42865 (merged
        # 2026-05-17; 0.32 has it) the lmcache backend is LMCacheMPConnector, whose standalone server
        # owns the capacity, where before vLLM set LMCache's local_cpu pool from the size
        per_rank = gib_total * GIB / ranks / 1e9
        return HostTierSettings([("offload_backend", "--kv-offloading-backend", "lmcache"),
                                 ("offload_size", "--kv-offloading-size", gib_total)],
                                [f"on vLLM 0.32 (vllm-project/vllm#42865) the lmcache backend talks to a standalone "
                                 f"LMCache server (LMCacheMPConnector, tcp://localhost:5555 unless kv_connector_extra_config "
                                 f"says otherwise) that owns the pool: start it holding {per_rank:.1f} GB per rank; "
                                 "--kv-offloading-size only switches offloading on there (earlier releases set LMCache's "
                                 "local_cpu and max_local_cpu_size from it)"])
    if impl_name == "sglang_hicache":
        return _hicache(per_rank_gb, ranks, device_pool_total_bytes, host_limit_bytes, pool_total_bytes)
    if impl_name == "none":
        return HostTierSettings([], [])
    # no implementation stated, and the engine's adapter names none: the size's unit and scope are not
    # known here, so the pool is stated rather than given as a value its flag may read otherwise
    flag = names.get("offload_size")
    return HostTierSettings([], [f"a host KV pool of {pool_total_bytes / 1e9:.3g} GB ({per_rank_gb:.3g} GB per rank)"
                                 + (f": set {flag} to hold it, in the unit it takes" if flag else "")])


def _hicache(per_rank_gb: float, ranks: int, device_total: float | None, limit: float | None,
             pool_total: float) -> HostTierSettings:
    """``--hicache-size`` is GB per rank (SGLang sizes each rank's host pool from it)."""
    notes = []
    size_gb = per_rank_gb
    if device_total:
        device_gb = device_total / ranks / 1e9
        if limit is None or device_total + pool_total <= limit:
            size_gb = device_gb + per_rank_gb
            notes.append(f"HiCache backs the GPUs' KV pool ({device_gb:.3g} GB per rank) up to the host, so its pool "
                         f"holds that and the preempted sequences ({per_rank_gb:.3g} GB per rank) beside it")
        else:
            notes.append(f"the host pool ({per_rank_gb:.3g} GB per rank) is no larger than the GPUs' KV pool "
                         f"({device_gb:.3g} GB per rank), and the host has no room for both: SGLang up to at least "
                         "0.5.9 refuses to start so (\"The host memory should be larger than the device memory\"), "
                         "later releases start with a less effective L2 cache")
    else:
        notes.append("SGLang up to at least 0.5.9 refuses a host pool no larger than the GPUs' KV pool (the KV pool "
                     "was not seen here): confirm --hicache-size exceeds it per rank")
    return HostTierSettings([("offload_enable", "--enable-hierarchical-cache", True),
                             ("offload_size", "--hicache-size", max(1, math.ceil(size_gb)))], notes)
