"""Hugging Face configs of tiny models the tests export fresh (random weights)."""

from __future__ import annotations

__all__ = ["TINY_LLAMA"]

# GQA (4 query heads over 2 KV heads), small enough to export in seconds on 2 cores
TINY_LLAMA = {
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
