"""KV-cache bytes per token from a model's geometry (docs/kv-science.md §1).

``kv_bytes_per_token`` answers "how many bytes does one token's KV occupy on one rank" for
MHA/GQA/MQA, MLA (DeepSeek), FP8 and tensor parallelism; ``seq_bytes`` adds sliding-window
layers, which cap the bytes to *move* (never the tokens to *recompute*).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtop.model import jsonio

# bytes per element by KV dtype name as engines spell it
_DTYPE_BYTES = {
    "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "half": 2, "auto": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "float8": 1, "int8": 1,
    "fp32": 4, "float32": 4,
}
# vLLM FlashMLA-sparse layout: 512 fp8 latent + 4 fp32 scales + 64 bf16 rope = 656 B per layer
_FP8_DS_MLA_LAYER_BYTES = 656


class ModelConfigError(ValueError):
    """The config does not describe a model whose KV size we can compute."""


@dataclass(frozen=True)
class Geometry:
    """The parts of a model config that decide KV size and recompute cost."""

    layers: int
    heads_q: int
    kv_heads: int
    head_dim: int
    kv_lora_rank: int | None = None  # MLA latent width (elements per layer with the rope part)
    qk_rope_head_dim: int | None = None
    sliding_window: int | None = None
    swa_layers: int = 0  # how many of ``layers`` use the sliding window
    non_embedding_params: float | None = None  # N in the recompute FLOP model (docs/kv-science.md §3.1)

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def k_att(self) -> float | None:
        """Attention-to-linear cost coefficient L·H_q·d_h / N (docs/kv-science.md §3.1)."""
        if not self.non_embedding_params:
            return None
        return self.layers * self.heads_q * self.head_dim / self.non_embedding_params


def dtype_bytes(dtype: str) -> int:
    d = dtype.lower()
    if d == "fp8_ds_mla":
        return 1
    if d not in _DTYPE_BYTES:
        raise ModelConfigError(f"unknown KV dtype {dtype!r} (known: {', '.join(sorted(_DTYPE_BYTES))}, fp8_ds_mla)")
    return _DTYPE_BYTES[d]


def geometry_from_config(cfg: dict[str, Any]) -> Geometry:
    """Geometry from a Hugging Face ``config.json`` dict (text_config for multimodal wrappers)."""
    if "text_config" in cfg and "num_hidden_layers" not in cfg:
        cfg = cfg["text_config"]
    try:
        layers = int(cfg["num_hidden_layers"])
        heads_q = int(cfg["num_attention_heads"])
    except (KeyError, TypeError, ValueError):
        raise ModelConfigError("config lacks num_hidden_layers / num_attention_heads") from None
    kv_heads = int(cfg.get("num_key_value_heads") or heads_q)
    head_dim = cfg.get("head_dim")
    if not head_dim:
        hidden = cfg.get("hidden_size")
        if not hidden:
            raise ModelConfigError("config lacks head_dim and hidden_size")
        head_dim = int(hidden) // heads_q
    layer_types = cfg.get("layer_types")
    if isinstance(layer_types, list) and layer_types:
        # hybrid models (SSM / linear attention layers) keep per-token KV only in attention layers;
        # the others hold a fixed per-sequence state (given separately)
        attn = [t for t in layer_types if _is_kv_layer(str(t))]
        if attn and len(attn) < len(layer_types):
            layers = len(attn)
            layer_types = attn
    kv_lora = cfg.get("kv_lora_rank")
    rope = cfg.get("qk_rope_head_dim")
    window = None
    swa_layers = 0
    sw = cfg.get("sliding_window")
    # Qwen2 ships sliding_window with use_sliding_window=false: the window is not applied.
    if sw and cfg.get("use_sliding_window", True):
        window = int(sw)
        if isinstance(layer_types, list) and layer_types:
            swa_layers = sum(1 for t in layer_types if "sliding" in str(t))
        elif cfg.get("model_type") in ("gemma2", "gemma3_text", "gemma3"):
            # Gemma-2 alternates local (sliding) and global layers
            swa_layers = layers // 2
        else:
            swa_layers = layers
        if swa_layers == 0:
            window = None
    return Geometry(
        layers=layers, heads_q=heads_q, kv_heads=kv_heads, head_dim=int(head_dim),
        kv_lora_rank=int(kv_lora) if kv_lora else None, qk_rope_head_dim=int(rope) if rope else None,
        sliding_window=window, swa_layers=swa_layers,
        non_embedding_params=cfg.get("non_embedding_params"),
    )


def _is_kv_layer(kind: str) -> bool:
    k = kind.lower()
    return "attention" in k and not any(x in k for x in ("linear", "mamba", "ssm", "delta"))


def _layer_bytes(g: Geometry, dtype: str, tp: int) -> float:
    """Bytes per token per layer on one rank."""
    if g.mla:
        if dtype.lower() == "fp8_ds_mla":
            return _FP8_DS_MLA_LAYER_BYTES
        # the latent is replicated on every TP rank, never split
        return ((g.kv_lora_rank or 0) + (g.qk_rope_head_dim or 0)) * dtype_bytes(dtype)
    b = dtype_bytes(dtype)
    # heads are split across ranks until there are fewer heads than ranks, then replicated
    return 2 * g.kv_heads * g.head_dim * b / min(max(tp, 1), g.kv_heads)


def kv_bytes_per_token(config: dict[str, Any] | Geometry, dtype: str = "bf16", tp: int = 1) -> int:
    """KV bytes per token on one rank, for a context that fits every sliding window."""
    return int(round(kv_size(config, dtype, tp).token_bytes_rank))


def seq_bytes(config: dict[str, Any] | Geometry, n: int, dtype: str = "bf16", tp: int = 1) -> int:
    """KV bytes of a whole ``n``-token sequence on one rank (sliding-window layers capped at W)."""
    return int(round(kv_size(config, dtype, tp).rank_bytes(n)))


# Built-in table (docs/kv-science.md §1.2, Hugging Face config.json values). N = non-embedding params.
BUILTIN: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                     "head_dim": 128, "non_embedding_params": 6.979e9},
    "llama-3.1-70b": {"num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
                      "head_dim": 128, "non_embedding_params": 68.45e9},
    "qwen2.5-7b": {"num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                   "head_dim": 128, "non_embedding_params": 6.525e9},
    "mistral-7b": {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                   "head_dim": 128, "non_embedding_params": 6.98e9},
    "mistral-7b-v0.1": {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                        "head_dim": 128, "sliding_window": 4096, "non_embedding_params": 6.98e9},
    "deepseek-v3": {"num_hidden_layers": 61, "num_attention_heads": 128, "kv_lora_rank": 512,
                    "qk_rope_head_dim": 64, "head_dim": 192},
    "gemma-2-9b": {"model_type": "gemma2", "num_hidden_layers": 42, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "head_dim": 256, "sliding_window": 4096},
    "gpt-oss-20b": {"num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
                    "head_dim": 64, "sliding_window": 128,
                    "layer_types": ["sliding_attention", "full_attention"] * 12},
}
# Llama-3 8B/70B share the 3.1 geometry; Meta-Llama-3-8B spelling too.
_ALIASES = {
    "llama-3-8b": "llama-3.1-8b", "llama-3.2-8b": "llama-3.1-8b", "llama-3.3-70b": "llama-3.1-70b",
    "llama-3-70b": "llama-3.1-70b", "mistral-7b-v0.2": "mistral-7b", "mistral-7b-v0.3": "mistral-7b",
    "deepseek-r1": "deepseek-v3",
}


def _norm(name: str) -> str:
    s = name.lower().rsplit("/", 1)[-1]
    s = s.replace("meta-", "").replace("_", "-")
    return s


def lookup_model(name: str | None) -> tuple[str, dict[str, Any]] | None:
    """Best built-in entry for a served model name like ``meta-llama/Llama-3.1-8B-Instruct``."""
    if not name:
        return None
    s = _norm(name)
    keys = sorted({**{k: k for k in BUILTIN}, **_ALIASES}.items(), key=lambda kv: -len(kv[0]))
    for key, target in keys:
        # the key must appear as a whole dash-separated prefix run, so "mistral-7b" does not
        # swallow "mistral-7b-v0.1"
        if re.search(rf"(^|-){re.escape(key)}($|-)", s):
            return target, BUILTIN[target]
    return None


def load_config_file(path: str | Path) -> dict[str, Any]:
    # NaN/Infinity kept: transformers writes its configs with json.dumps, which emits them
    d = jsonio.read_json(path, "model config", ModelConfigError, allow_nan=True)
    if not isinstance(d, dict):
        raise ModelConfigError(f"model config {path} is not a JSON object")
    try:
        checked_geometry(d)  # validate now so the error names the file
    except ModelConfigError as e:
        raise ModelConfigError(f"model config {path}: {e}") from None
    return d


# Far past any real model (layers, heads, head_dim, latent rank, window): bigger is a broken file,
# and byte counts built from such numbers overflow a float.
_GEOMETRY_MAX = 1 << 24


def checked_geometry(cfg: dict[str, Any]) -> Geometry:
    """``geometry_from_config`` for a config from a user's file: any field of the wrong type or an
    absurd value is a ModelConfigError (one line), never a TypeError, ZeroDivisionError or OverflowError."""
    try:
        g = geometry_from_config(cfg)
    except ModelConfigError:
        raise
    except (TypeError, ValueError, ArithmeticError, AttributeError) as e:  # "1e3" heads, Infinity layers
        raise ModelConfigError(f"a geometry field has the wrong type or value ({str(e)[:100]})") from None
    sizes = (g.layers, g.heads_q, g.kv_heads, g.head_dim)
    if min(sizes) < 1:  # every KV byte count divides by them
        raise ModelConfigError("layers, attention heads, KV heads and head_dim must be at least 1")
    extra = (g.kv_lora_rank or 0, g.qk_rope_head_dim or 0, g.sliding_window or 0, g.swa_layers)
    if max(*sizes, *extra) > _GEOMETRY_MAX or min(extra) < 0:
        raise ModelConfigError(f"a geometry field is outside 0..{_GEOMETRY_MAX:,}")
    return g


# ---- the one size function every byte count goes through ------------------------------------

@dataclass(frozen=True)
class KVSize:
    """KV footprint of sequences on this deployment, per rank and over all ranks.

    Every byte the advisor counts (freed, moved, gated, link demand, recommended host pool) comes
    from ``rank_bytes`` / ``total_bytes`` so sliding windows, MLA replication, FP8, TP/PP splits and
    a hybrid model's fixed per-sequence state are honoured in one place.

    ``total`` means the physical bytes on all ``tp·pp`` GPUs together: for GQA with TP ≤ KV heads
    that is the unsplit model size; for MLA (latent replicated on every TP rank) it is TP copies.
    """

    layer_bytes_rank: float  # one token, one attention layer, one rank
    layers_rank: float  # attention layers on one rank (L / PP)
    swa_layers_rank: float = 0.0  # of which sliding-window layers
    window: int | None = None
    state_bytes_rank: float = 0.0  # fixed per-sequence state (SSM / linear attention) on one rank
    tp: int = 1
    pp: int = 1
    replicated: bool = False  # MLA latent: every TP rank holds the same bytes

    @property
    def ranks(self) -> int:
        return self.tp * self.pp

    @property
    def token_bytes_rank(self) -> float:
        """Per-token bytes on one rank while the context fits every window (β_rank)."""
        return self.layer_bytes_rank * self.layers_rank

    @property
    def token_bytes_total(self) -> float:
        """Per-token bytes over all ranks while the context fits every window (β)."""
        return self.token_bytes_rank * self.ranks

    def rank_bytes(self, n: float) -> float:
        """Bytes one rank holds for an ``n``-token sequence (windows capped, state added)."""
        return self.private_rank_bytes(n, 0.0)

    def total_bytes(self, n: float) -> float:
        return self.rank_bytes(n) * self.ranks

    def private_rank_bytes(self, n: float, held: float) -> float:
        """Bytes one rank holds for tokens [held, n) of an ``n``-token sequence.

        ``held`` tokens at the start are shared with live requests (or already on the host): they
        are neither freed nor moved. A windowed layer holds only the last ``window`` tokens, so a
        prefix that slid out of the window costs nothing there. The fixed state is always private.
        """
        n = max(0.0, float(n))
        held = min(max(0.0, float(held)), n)
        full = self.layers_rank - self.swa_layers_rank
        tokens = full * (n - held)
        if self.swa_layers_rank:
            w = float(self.window or n)
            tokens += self.swa_layers_rank * max(0.0, n - max(n - w, held))
        state = self.state_bytes_rank if n > 0 else 0.0
        return self.layer_bytes_rank * tokens + state

    def private_total_bytes(self, n: float, held: float) -> float:
        return self.private_rank_bytes(n, held) * self.ranks

    def describe(self) -> str:
        bits = [f"TP={self.tp}"]
        if self.pp > 1:
            bits.append(f"PP={self.pp}")
        if self.replicated:
            bits.append("MLA latent replicated per rank")
        if self.window and self.swa_layers_rank:
            bits.append(f"{self.swa_layers_rank:g} of {self.layers_rank:g} layers windowed at {self.window}")
        if self.state_bytes_rank:
            bits.append(f"+{self.state_bytes_rank / 2**20:.3g} MiB fixed state per sequence per rank")
        return ", ".join(bits)


def kv_size(config: dict[str, Any] | Geometry | None = None, dtype: str = "bf16", tp: int = 1, pp: int = 1,
            token_bytes_rank: float | None = None, state_bytes_total: float = 0.0) -> KVSize:
    """The ``KVSize`` of a model (config or geometry), or of a given per-rank per-token size.

    ``token_bytes_rank`` overrides the geometry's per-token size (an operator's measured figure);
    the geometry's window structure still applies when a geometry is given.
    """
    tp, pp = max(1, int(tp)), max(1, int(pp))
    state_rank = float(state_bytes_total) / (tp * pp)
    if config is None:
        if token_bytes_rank is None:
            raise ModelConfigError("KV size unknown: give a model, a model config or bytes per token")
        return KVSize(float(token_bytes_rank), 1.0, state_bytes_rank=state_rank, tp=tp, pp=pp)
    g = config if isinstance(config, Geometry) else geometry_from_config(config)
    layers = g.layers / pp
    lb = _layer_bytes(g, dtype, tp)
    if token_bytes_rank is not None:
        lb = float(token_bytes_rank) / layers
    swa = g.swa_layers / pp if g.sliding_window else 0.0
    return KVSize(lb, layers, swa, g.sliding_window, state_rank, tp, pp, replicated=g.mla)
