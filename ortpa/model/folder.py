"""The text side of a model folder: its ``tokenizer.json`` (the `tokenizers` library) and EOS ids.

``ortpa convert`` copies a source folder's ``tokenizer.json`` and ``generation_config.json`` beside the paged
model (:mod:`ortpa.model.ref`), so ``ortpa generate OUT --prompt ...`` finds them next to it.
"""

from __future__ import annotations

import json
from pathlib import Path

from ortpa.errors import InvalidModel

__all__ = ["eos_token_ids", "find_asset", "load_tokenizer"]


def find_asset(model_path: str | Path, name: str, folder: str | Path | None = None) -> Path | None:
    """``name`` in ``folder`` if given, else next to the model (a model path that is itself a folder counts)."""
    base = Path(folder) if folder is not None else Path(model_path)
    candidate = (base if base.is_dir() else base.parent) / name
    return candidate if candidate.is_file() else None


def load_tokenizer(model_path: str | Path, folder: str | Path | None = None):
    """The ``tokenizers.Tokenizer`` from ``tokenizer.json`` next to the model (or in ``folder``)."""
    path = find_asset(model_path, "tokenizer.json", folder)
    where = Path(folder) if folder is not None else Path(model_path).parent
    if path is None:
        raise InvalidModel(str(model_path), f"--prompt needs a tokenizer.json, none found in {where}")
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise InvalidModel(str(path), f"reading it needs the `tokenizers` package ({exc})") from None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust library raises a plain Exception on malformed files
        raise InvalidModel(str(path), f"not a tokenizers tokenizer.json: {exc}") from None


def eos_token_ids(model_path: str | Path, folder: str | Path | None = None) -> list[int]:
    """``eos_token_id`` (an id or a list) of ``generation_config.json`` next to the model; [] when absent."""
    path = find_asset(model_path, "generation_config.json", folder)
    if path is None:
        return []
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError) as exc:
        raise InvalidModel(str(path), f"expected a JSON object with eos_token_id, could not read it: {exc}") from None
    if eos is None:
        return []
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and i >= 0 for i in ids):
        raise InvalidModel(str(path), f"eos_token_id: expected a non-negative int or a list of them, found {eos!r}")
    return ids
