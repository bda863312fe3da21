"""What "swap" means per implementation: its GPU cost, copy size and the settings that enable it.

Facts (kvtop's engine notes): vLLM V0 swapped with blocking per-layer, per-block copies (one
layer's K or V for a 16-token block; ``--swap-space`` GiB, removed from vLLM in 2026-03); vLLM V1
has no swap, its substitute is the asynchronous KV offloading connector
(``--kv-offloading-size`` GiB over all ranks + ``--kv-offloading-backend native|lmcache``), whose
native layout copies one contiguous block across all layers; LMCache stores chunks (256 tokens by
default) and takes ``local_cpu`` / ``max_local_cpu_size`` (GB per rank, the vLLM size / (TP·PP));
SGLang HiCache backs the radix cache with a host pool (``--enable-hierarchical-cache``,
``--hicache-size`` GB, overriding ``--hicache-ratio``), written asynchronously.
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


def settings_for(impl_name: str | None, engine: str | None, pool_total_bytes: float, ranks: int,
                 names: dict[str, str]) -> list[tuple[str, str | None, Any]]:
    """The settings that give a host pool of ``pool_total_bytes`` (all ranks) for this implementation,
    as ``(generic setting, flag as the engine spells it or None, value)``."""
    gib_total = max(1, math.ceil(pool_total_bytes / GIB))
    per_rank_gb = pool_total_bytes / max(1, ranks) / 1e9
    if impl_name == "vllm_v0_swap":
        # --swap-space is per GPU
        return [("preemption_mode", "--preemption-mode", "swap"),
                ("swap_space", "--swap-space", max(1, math.ceil(pool_total_bytes / max(1, ranks) / GIB)))]
    if impl_name == "vllm_v1_offload":
        return [("offload_backend", "--kv-offloading-backend", "native"),
                ("offload_size", "--kv-offloading-size", gib_total)]
    if impl_name == "lmcache":
        return [("offload_backend", "--kv-offloading-backend", "lmcache"),
                ("offload_size", "--kv-offloading-size", gib_total),
                ("lmcache_local_cpu", "LMCache local_cpu", True),
                ("lmcache_max_local_cpu_size", "LMCache max_local_cpu_size", round(max(0.1, per_rank_gb), 1))]
    if impl_name == "sglang_hicache":
        return [("offload_enable", "--enable-hierarchical-cache", True),
                ("offload_size", "--hicache-size", max(1, math.ceil(per_rank_gb)))]
    if impl_name == "none":
        return []
    # implementation not stated: the engine adapter's names (vLLM: the V1 connector)
    out: list[tuple[str, str | None, Any]] = [("offload_size", names.get("offload_size"), gib_total)]
    if "offload_backend" in names:
        out.append(("offload_backend", names["offload_backend"], "native"))
    if "offload_enable" in names:
        out.append(("offload_enable", names["offload_enable"], True))
    return out
