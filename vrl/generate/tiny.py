"""The `tiny` model: a small random-weight causal LM and a byte-level tokenizer, built locally.

It lets `vrl train` and the test suite run offline in seconds. Weights are a pure function of the
seed, so an ES history recorded against `tiny` replays exactly anywhere.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

EOS = "<|endoftext|>"
CHAT_TEMPLATE = (  # tools, when given, as a system block of their JSON schemas (tools are never sent unseen)
    "{% if tools %}<|system|>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer: one token per byte (256) plus an end-of-text token."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS, padding_side="left")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(
    seed: int = 0, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, vocab_size: int = 257
) -> Qwen2ForCausalLM:
    """A Qwen2-architecture model with deterministic random weights (float32, CPU)."""
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=max(1, num_heads // 2),
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=vocab_size - 1,
        eos_token_id=vocab_size - 1,
        pad_token_id=vocab_size - 1,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = vocab_size - 1
    model.generation_config.eos_token_id = vocab_size - 1
    return model.eval()
