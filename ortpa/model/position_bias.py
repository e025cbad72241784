"""A Hugging Face checkpoint whose attention adds a position bias to the scores (ALiBi), told from its
``config.json`` before any export work.

PagedAttention takes no bias on the scores, so such a model cannot be converted (the rewriter also refuses every
form the bias takes in an ONNX graph: :mod:`ortpa.rewriter.recognisers.position_bias`). Saying so from the config
spares the user an export that can only be refused: minutes to hours for a large checkpoint.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ortpa.errors import UnsupportedModel

__all__ = ["config_position_bias", "refuse_position_bias"]

# families whose every checkpoint uses ALiBi (BLOOM has no other position scheme)
_ALWAYS = {"bloom": "BLOOM"}


def _true(value: Any) -> bool:
    return value is True


def config_position_bias(config: dict) -> str | None:
    """Why ``config`` (a ``config.json`` object; ``text_config`` read where it has one) describes attention with a
    position bias on the scores, or None."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    model_type = str(text.get("model_type", ""))
    if model_type in _ALWAYS:
        return f"model_type {model_type!r}: {_ALWAYS[model_type]} attention adds ALiBi biases to its scores"
    if _true(text.get("alibi")):  # falcon (falcon-rw), RefinedWeb
        return f'model_type {model_type!r} with "alibi": true'
    attn = text.get("attn_config")
    if isinstance(attn, dict) and _true(attn.get("alibi")):  # MPT
        return f'model_type {model_type!r} with "attn_config": {{"alibi": true}}'
    if _true(text.get("use_alibi")):
        return f'model_type {model_type!r} with "use_alibi": true'
    if str(text.get("position_embedding_type", "")).lower() == "alibi":  # Jais
        return f'model_type {model_type!r} with "position_embedding_type": "alibi"'
    return None


def refuse_position_bias(folder: str | os.PathLike) -> None:
    """:class:`~ortpa.errors.UnsupportedModel` when the checkpoint at ``folder`` uses ALiBi; a config that cannot
    be read is left to the export, which says why."""
    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return
    reason = config_position_bias(config) if isinstance(config, dict) else None
    if reason is not None:
        raise UnsupportedModel(
            os.fspath(folder),
            f"its attention adds a per-head position bias to the scores (ALiBi; config.json: {reason}); "
            "PagedAttention takes no bias on the scores, so ALiBi models are not converted (nothing was exported)",
        )
