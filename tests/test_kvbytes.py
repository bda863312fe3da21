"""KV bytes per token: the test vectors of kv-science §1.3."""

from __future__ import annotations

import json

import pytest

from kvtop.analysis.kvbytes import (
    BUILTIN,
    ModelConfigError,
    kv_bytes_per_token,
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


def test_lookup_served_names():
    assert lookup_model("meta-llama/Llama-3.1-8B-Instruct")[0] == "llama-3.1-8b"
    assert lookup_model("meta-llama/Meta-Llama-3.1-70B-Instruct")[0] == "llama-3.1-70b"
    assert lookup_model("Qwen/Qwen2.5-7B-Instruct")[0] == "qwen2.5-7b"
    assert lookup_model("mistralai/Mistral-7B-v0.1")[0] == "mistral-7b-v0.1"
    assert lookup_model("mistralai/Mistral-7B-Instruct-v0.3")[0] == "mistral-7b"
    assert lookup_model("sim-llama-3.1-70b-tp4")[0] == "llama-3.1-70b"
    assert lookup_model("tiny-llama") is None
