"""What one server (one Ray replica) holds: an :class:`~ortpa.runtime.engine.Engine` over the converted
model, its tokenizer, its EOS ids, its chat template and its context length."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ortpa.errors import InvalidModel, InvalidParameter
from ortpa.serve.chat import ChatTemplate, load_chat_template

__all__ = ["ServingModel"]


@dataclass
class ServingModel:
    engine: Any  # ortpa.runtime.engine.Engine
    tokenizer: Any  # tokenizers.Tokenizer
    eos_token_ids: list[int]
    chat_template: ChatTemplate | None
    max_model_len: int | None  # prompt + generated tokens; None: bounded by the KV pool only
    name: str

    @property
    def vocab_size(self) -> int:
        """Token ids the model takes: its logits' width, else the tokenizer's vocabulary."""
        return self.engine.io.vocab or self.tokenizer.get_vocab_size()

    def limit_context(self, tokens: int) -> None:
        """Serve at most ``tokens`` per request (prompt + completion): ``--max-model-len``."""
        if self.max_model_len is not None and tokens > self.max_model_len:
            raise InvalidParameter(
                self.name, "--max-model-len", f"at most the model's context, {self.max_model_len}", tokens
            )
        self.max_model_len = tokens

    @classmethod
    def load(
        cls,
        model: str | os.PathLike,
        *,
        revision: str | None = None,
        tokenizer: str | os.PathLike | None = None,
        name: str | None = None,
        num_blocks: int | None = None,
        kv_budget_bytes: int | None = None,
        block_size: int = 16,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int | None = None,
        provider: str | None = None,
        threads: int | None = None,
        ray_address: str | None = None,
        placement: str = "pack",
        micro_batches: int | None = None,
    ) -> ServingModel:
        """Open ``model`` (a file, a folder, or a repo id in the local cache) and what lies beside it.

        The tokenizer files (``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``,
        ``generation_config.json``, ``config.json``) are read from ``tokenizer`` if given, else from the
        model's folder, where ``ortpa convert`` copies them. ``threads``: ONNX Runtime's intra-op threads
        (default: its own, one per core; 1 is faster on a machine whose cores are busy with other work).
        ``max_num_batched_tokens``: the Engine's step budget (None: its default).
        """
        from ortpa.model.folder import eos_token_ids, find_asset, load_tokenizer
        from ortpa.model.ref import ModelRef, locate_model
        from ortpa.providers import providers_for
        from ortpa.runtime.engine import Engine
        from ortpa.runtime.stage_folder import MANIFEST, is_stage_folder

        # a stage folder (`ortpa split`: docs/distributed.md) holds its tokenizer files beside its manifest
        staged = is_stage_folder(model)
        ref = ModelRef(Path(model) / MANIFEST, Path(model)) if staged else locate_model(model, revision)
        where = Path(tokenizer) if tokenizer is not None else (ref.folder or Path(ref.path).parent)
        if find_asset(ref.path, "tokenizer.json", where) is None:
            raise InvalidModel(
                str(ref.path),
                f"serving needs a tokenizer.json (clients send and receive text), none found in {where}; "
                "`ortpa convert` copies it from a Hugging Face folder, or pass --tokenizer FOLDER",
            )
        tok = load_tokenizer(ref.path, where)
        sess_options = None
        if threads is not None:
            import onnxruntime as ort

            sess_options = ort.SessionOptions()
            sess_options.intra_op_num_threads = threads
        engine = Engine(
            ref.folder if staged else ref.path,
            num_blocks=num_blocks,
            kv_budget_bytes=kv_budget_bytes,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            providers=providers_for(provider) if provider else None,
            sess_options=sess_options,
            ray_address=ray_address,
            placement=placement,
            micro_batches=micro_batches,
        )
        max_len = engine.scheduler.max_model_len or _config_context(where)
        return cls(
            engine=engine,
            tokenizer=tok,
            eos_token_ids=eos_token_ids(ref.path, where),
            chat_template=load_chat_template(where),
            max_model_len=max_len,
            name=name or os.fspath(model),
        )


def _config_context(folder: Path) -> int | None:
    """``max_position_embeddings`` of the ``config.json`` beside the model, where there is one."""
    path = folder / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InvalidModel(str(path), f"expected a JSON object, could not read it: {exc}") from None
    for source in (config, config.get("text_config") or {}) if isinstance(config, dict) else ():
        value = source.get("max_position_embeddings")
        if isinstance(value, int) and value > 0:
            return value
    return None
