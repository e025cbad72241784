"""A served folder for structured output and tool calls: the Llama fixture (vocab 256) with a byte-level BPE
tokenizer that can spell JSON (the word-level one of ``helpers`` cannot), and a Hermes-style tool template."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ortpa.testing.byte_tokenizer import write_byte_tokenizer as _write
from serve.helpers import CONTEXT, EOS, VOCAB

__all__ = ["TOOL_TEMPLATE", "write_byte_tokenizer", "write_structured_folder"]

# Hermes / Qwen form: calls as JSON in <tool_call> tags, results as "tool" turns. The tools are listed by name only
# (real templates write their whole JSON): the fixture model has 256 positions and a byte-level vocabulary.
TOOL_TEMPLATE = (
    "{{ bos_token }}{% if tools %}system tools: {% for t in tools %}{{ t['function']['name'] }} {% endfor %}\n"
    "{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'tool' %}tool {{ m['content'] }}\n"
    "{% elif m['role'] == 'assistant' and m['tool_calls'] %}assistant "
    "{% for c in m['tool_calls'] %}<tool_call>"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}</tool_call>"
    "{% endfor %}\n{% else %}{{ m['role'] }} {{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)


def write_byte_tokenizer(path: Path):
    """The byte-level BPE of ``ortpa.testing`` at the fixture model's vocabulary size (ids 0..VOCAB-1)."""
    return _write(path, VOCAB)


def write_structured_folder(folder: Path, converted: Path) -> Path:
    """``folder`` served with ``converted`` (the Llama fixture converted), linked, not copied."""
    os.link(converted, folder / "model.onnx")
    write_byte_tokenizer(folder / "tokenizer.json")
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": TOOL_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS}))
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": CONTEXT}))
    return folder
