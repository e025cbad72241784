"""A word-level ``tokenizer.json`` built offline with the `tokenizers` library (no downloads), for text tests."""

from __future__ import annotations

from pathlib import Path

__all__ = ["WORDS", "write_tokenizer"]

WORDS = ("hello", "world", "the", "paged", "latent", "cache")


def write_tokenizer(path: Path, vocab_size: int):
    """Words of :data:`WORDS` then ``w6``, ``w7``, ... up to ``vocab_size`` ids; unknown words map to the last id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = list(WORDS) + [f"w{i}" for i in range(len(WORDS), vocab_size - 1)] + ["[UNK]"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer.save(str(path))
    return Tokenizer.from_file(str(path))
