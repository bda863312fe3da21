"""KV bytes per token: the test vectors of docs/kv-science.md §1.3."""

from __future__ import annotations

import json

import pytest

from kvtop.analysis.advice.kvbytes import (
    BUILTIN,
    ModelConfigError,
    kv_bytes_per_token,
    kv_size,
    load_config_file,
    lookup_model,
    seq_bytes,
)


@pytest.mark.parametrize("model,dtype,tp,expected", [
    ("llama-3.1-8b", "bf16", 1, 131072),
    ("llama-3.1-8b", "fp8", 1, 65536),
    ("llama-3.1-70b", "bf16", 1, 327680),
    ("llama-3.1-70b", "bf16", 4, 81920),
    ("llama-3.1-70b", "bf16", 8, 40960),
    ("llama-3.1-70b", "fp8", 1, 163840),
    ("qwen2.5-7b", "bf16", 1, 57344),
    ("qwen2.5-7b", "fp8", 1, 28672),
    ("mistral-7b", "bf16", 1, 131072),
    ("gemma-2-9b", "bf16", 1, 344064),
    ("gemma-2-9b", "fp8", 1, 172032),
    ("deepseek-v3", "bf16", 1, 70272),
    ("deepseek-v3", "bf16", 8, 70272),  # MLA latent is replicated per rank, never divided
    ("deepseek-v3", "fp8", 1, 35136),
    ("deepseek-v3", "fp8_ds_mla", 1, 40016),
])
def test_vectors(model, dtype, tp, expected):
    assert kv_bytes_per_token(BUILTIN[model], dtype, tp) == expected


def test_sliding_window_sequence_bytes():
    assert seq_bytes(BUILTIN["gemma-2-9b"], 8192) == 2_113_929_216  # 2,016 MiB, not the naive 2,688
    assert seq_bytes(BUILTIN["gemma-2-9b"], 4096) == 4096 * 344064
    mib = 1 << 20
    # Mistral-7B-v0.1: SWA 4096 on every layer caps a sequence at 512 MiB
    assert seq_bytes(BUILTIN["mistral-7b-v0.1"], 4096) == 512 * mib
    assert seq_bytes(BUILTIN["mistral-7b-v0.1"], 32768) == 512 * mib
    # gpt-oss-20b: 12 full + 12 SWA-128 layers, 771 MiB at 32K (24,672 B/token average)
    b = seq_bytes(BUILTIN["gpt-oss-20b"], 32768)
    assert b / 32768 == 24672
    assert round(b / mib) == 771


def test_block_sizes_match_vllm_blog():
    # 16-token block across all layers, one rank: 2 MB (8B), 1.25 MB (70B TP4), 0.875 MiB (Qwen2.5-7B)
    assert 16 * kv_bytes_per_token(BUILTIN["llama-3.1-8b"]) == 2 * (1 << 20)
    assert 16 * kv_bytes_per_token(BUILTIN["llama-3.1-70b"], tp=4) == 1.25 * (1 << 20)
    assert 16 * kv_bytes_per_token(BUILTIN["qwen2.5-7b"]) == 0.875 * (1 << 20)


def test_tp_beyond_kv_heads_replicates():
    # 8 KV heads on 16 ranks: each rank holds one head (replicated), not half a head
    assert kv_bytes_per_token(BUILTIN["llama-3.1-70b"], tp=16) == 40960


def test_hf_config_file(tmp_path):
    cfg = {"num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "hidden_size": 3584,
           "sliding_window": 131072, "use_sliding_window": False, "model_type": "qwen2"}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    assert kv_bytes_per_token(load_config_file(p)) == 57344
    assert seq_bytes(load_config_file(p), 200_000) == 200_000 * 57344  # window not applied
    bad = tmp_path / "bad.json"
    bad.write_text('{"hidden_size": 4096}')
    with pytest.raises(ModelConfigError):
        load_config_file(bad)


def _key(name: str) -> str:
    hit = lookup_model(name)
    assert hit is not None, name
    return hit[0]


def test_lookup_served_names():
    assert _key("meta-llama/Llama-3.1-8B-Instruct") == "llama-3.1-8b"
    assert _key("meta-llama/Meta-Llama-3.1-70B-Instruct") == "llama-3.1-70b"
    assert _key("Qwen/Qwen2.5-7B-Instruct") == "qwen2.5-7b"
    assert _key("mistralai/Mistral-7B-v0.1") == "mistral-7b-v0.1"
    assert _key("mistralai/Mistral-7B-Instruct-v0.3") == "mistral-7b"
    assert _key("sim-llama-3.1-70b-tp4") == "llama-3.1-70b"
    assert lookup_model("tiny-llama") is None


def test_one_size_function_splits_and_counts_consistently():
    """Llama-3.1-70B at TP4 x PP2: 80 layers / 2 stages = 40 per GPU, 8 KV heads / 4 = 2 per GPU.

    per GPU per token = 40 · 2·2·128·2 = 40,960 B; all 8 GPUs = 327,680 B (the unsplit model).
    DeepSeek-V3 at TP8: 70,272 B on every GPU (replicated latent), 562,176 B over the 8 GPUs.
    """
    s = kv_size(BUILTIN["llama-3.1-70b"], "bf16", tp=4, pp=2)
    assert s.token_bytes_rank == 40 * 2 * 2 * 128 * 2 == 40_960
    assert s.token_bytes_total == 327_680
    assert s.total_bytes(1000) == 1000 * 327_680
    mla = kv_size(BUILTIN["deepseek-v3"], "bf16", tp=8)
    assert mla.token_bytes_rank == 70_272 and mla.token_bytes_total == 8 * 70_272


def test_private_bytes_with_a_prefix_that_slid_out_of_the_window():
    """Mistral-7B-v0.1 (all 32 layers windowed at 4,096), 8,192-token sequence, 131,072 B/token unwindowed.

    The layers hold tokens [4096, 8192). A 2,048-token shared prefix lies outside: all 4,096 held
    tokens are private, 4,096 · 131,072 = 512 MiB. A 6,000-token shared prefix overlaps: private
    tokens [6000, 8192) = 2,192 · 131,072 = 287,309,824 B.
    """
    s = kv_size(BUILTIN["mistral-7b-v0.1"])
    assert s.private_rank_bytes(8192, 2048) == 4096 * 131072 == 512 * (1 << 20)
    assert s.private_rank_bytes(8192, 6000) == 2192 * 131072 == 287_309_824
    # Gemma-2-9B: 21 global + 21 windowed layers at 8 KiB per token-layer; prefix 2,000 of 8,192:
    # global 21·6,192 + windowed 21·4,096 token-layers = 216,048 · 8,192 B
    g = kv_size(BUILTIN["gemma-2-9b"])
    assert g.private_rank_bytes(8192, 2000) == (21 * 6192 + 21 * 4096) * 8192


def test_hybrid_config_keeps_kv_only_in_attention_layers():
    """48 layers, one in four full attention (12): 12 · 2·2·256·2 = 24,576 B/token; a 50 MiB state
    per sequence over TP2 is 25 MiB per GPU, added once per sequence."""
    cfg = {"num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
           "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 12}
    assert kv_bytes_per_token(cfg) == 24_576
    s = kv_size(cfg, tp=2, state_bytes_total=50 * (1 << 20))
    assert s.token_bytes_rank == 12_288  # 2 KV heads over 2 ranks
    assert s.rank_bytes(1000) == 1000 * 12_288 + 25 * (1 << 20)
    assert s.rank_bytes(0) == 0
