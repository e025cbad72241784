"""A small byte-level BPE ``tokenizer.json`` built offline (no downloads), for structured output on test models.

Word-level tokenizers cannot spell JSON, and a grammar engine cannot read their token bytes (a WordPiece
decoder); this one is GPT-2's kind: ``<s>`` and ``</s>`` (ids 0 and 1), the printable ASCII bytes and newline,
then merges learnt from a fixed corpus up to ``vocab_size`` ids, so the same call writes the same file.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["write_byte_tokenizer"]

_CORPUS = [
    '{"name": "paged", "value": 12, "ok": true, "tags": ["a", "b"]}',
    "the paged latent cache holds one row per token and layer",
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
    "user hello world assistant system tool null false 0123456789",
]
# every two-letter word: enough pairs that merges fill a vocabulary of several hundred ids (a model's logits
# row wider than the tokenizer would otherwise produce ids that decode to nothing)
_PAIRS = " ".join(a + b for a in "abcdefghijklmnopqrstuvwxyz" for b in "abcdefghijklmnopqrstuvwxyz")


def write_byte_tokenizer(path: Path, vocab_size: int):
    """Write the tokenizer to ``path`` and return it loaded (a ``tokenizers.Tokenizer``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    ((alphabet, _),) = byte_level.pre_tokenize_str("".join(map(chr, [10, *range(32, 127)])))
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<s>", "</s>"], initial_alphabet=list(alphabet), show_progress=False
    )
    tokenizer.train_from_iterator(_CORPUS * 50 + [_PAIRS] * 3, trainer)
    tokenizer.save(str(path))
    return Tokenizer.from_file(str(path))
