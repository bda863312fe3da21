"""Usable host-link bandwidth for KV copies (docs/kv-science.md §2.2).

``BW_eff = c · g / (g/BW_peak + α)``: every contiguous copy of ``g`` bytes pays a fixed cost α,
so small per-layer copies use a fraction of the link; ``c`` discounts contention (≈0.8 with all
GPUs offloading, 0.4–0.65 with traffic in both directions).
"""

from __future__ import annotations

# Defaults for an H100 on PCIe Gen5 (docs/kv-science.md §12 "common defaults"); always marked "assumed".
DEFAULT_BW_PEAK = 50e9  # B/s, one direction, pinned
DEFAULT_ALPHA_S = 6e-6  # fixed cost per contiguous copy
DEFAULT_BLOCK_TOKENS = 16


def bw_eff(copy_bytes: float, bw_peak: float = DEFAULT_BW_PEAK, alpha_s: float = DEFAULT_ALPHA_S,
           contention: float = 1.0) -> float:
    """Effective bytes/s for copies of ``copy_bytes`` each."""
    if copy_bytes <= 0 or bw_peak <= 0:
        raise ValueError("copy size and peak bandwidth must be positive")
    return contention * copy_bytes / (copy_bytes / bw_peak + alpha_s)
