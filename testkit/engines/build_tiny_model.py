"""Build the tiny random-weight Llama used by the real-vLLM tests, deterministically.

Run with the vLLM venv's python (it has torch, transformers and tokenizers):
    python build_tiny_model.py OUT_DIR

The weights are random, so the output text is gibberish; what matters to kvtop is that vLLM's
scheduling, paged KV cache and preemption behave exactly as they do for a real model. Shape (see
docs/real-engines.md): 2 layers, hidden 128, 4 heads, 2 KV heads, head_dim 32 ->
1 KiB of KV per token in fp32, so a 1,081,344-byte KV cache holds 1,056 token slots.

One deliberate difference from the reference's shape: the MLP is wide (intermediate 32,768, not
256). It changes no KV figure, but it makes a decode step cost ~10 ms instead of ~1 ms. With the
narrow MLP, on an idle 2-core machine the engine outran vLLM's API server, which then merged up to
~300 tokens into one SSE event (a 900-token stream arrived as 4-5 events): per-token timing, the
thing kvtop measures, was gone.
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

# Tokenizer training is parallel; one thread keeps merges identical from run to run.
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SEED = 20261129
INTERMEDIATE = 32768
VERSION = f"tiny-llama v2 intermediate={INTERMEDIATE}"
VOCAB = 2048
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


def corpus(n_lines: int = 4000) -> list[str]:
    rng = random.Random(SEED)
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "ze", "qu", "th", "er", "an", "is", "or"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(600)]
    words += ["the", "cache", "token", "block", "stream", "engine", "latency", "memory", "request"]
    lines = []
    for _ in range(n_lines):
        line = " ".join(rng.choice(words) for _ in range(rng.randint(5, 20)))
        if rng.random() < 0.3:
            line += f" {rng.randint(0, 99999)}."
        lines.append(line.capitalize())
    return lines


def build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=1024,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def build_model(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: build_tiny_model.py OUT_DIR", file=sys.stderr)
        return 2
    out = Path(argv[1])
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    build_tokenizer(tmp)
    build_model(tmp)
    (tmp / ".kvtop-ready").write_text(VERSION + "\n")
    # Rename last so a crash mid-build never leaves a model that looks complete.
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
    print(f"tiny model written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
