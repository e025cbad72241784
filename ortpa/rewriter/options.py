"""What the rewrite is asked to make: one frozen dataclass, read by every step of :mod:`ortpa.rewriter.pipeline`.

The conversion's other options (where the model must run, verification, ``--portable``, genai's settings) are the
orchestrator's (:class:`ortpa.conversion.ConvertOptions`, which holds one of these).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from ortpa.errors import ConversionError
from ortpa.rewriter.kv_quant import DEFAULT_MARGIN, KVScaleMode
from ortpa.rewriter.mla import AbsorbMode
from ortpa.rewriter.mla_expanded import PrefillForm
from ortpa.rewriter.paged_io import LogitsMode, PositionMode

__all__ = ["DType", "RewriteOptions"]

DType = Literal["float16", "bfloat16"]

_CHOICES = {
    "dtype": (None, "float16", "bfloat16"),
    "logits": ("last", "all"),
    "kv_cache_dtype": ("auto", "float16", "bfloat16", "int8", "float8e4m3fn"),
    "absorb": ("auto", "fold", "matmul"),
    "mla_prefill": ("expanded", "absorbed"),
    "position_ids": ("derive", "input"),
    "kv_scale": ("per-channel", "per-tensor"),
}


@dataclass(frozen=True)
class RewriteOptions:
    """* ``dtype``: convert the whole model to float16/bfloat16; None keeps its precision and casts to the op's
      half type at the attention boundary.
    * ``rope_in_op``: move RoPE into the op (``do_rotary=1``, cos/sin caches of ``max_positions`` rows: default
      the model's ``max_position_embeddings``, else 4096); default keeps the model's own RoPE in the graph.
    * ``logits``: ``"last"`` one row per sequence (its last new token), ``"all"`` one row per packed token.
    * ``kv_cache_dtype``: the caches' element type. ``"auto"`` (default): the model's activation dtype (``dtype``
      when given, else the model's own float16 / bfloat16); a float32 model gets float16, because PagedAttention
      computes and caches in float16 or bfloat16 only and float16 keeps 3 more mantissa bits than bfloat16.
      ``"float16"`` / ``"bfloat16"`` pick one for a float32 model; ``"int8"`` with static scales (``kv_scale``
      per-channel or per-tensor, times ``kv_scale_margin``) calibrated on ``calibration_prompts`` (default: seeded
      random prompts), see :mod:`ortpa.rewriter.kv_quant`. What was picked, and why, is in the model's metadata
      (``ortpa.kv_cache_dtype``, ``ortpa.kv_cache_dtype_reason``). ``None`` is taken as ``"auto"``.
    * ``absorb`` (MLA): ``"auto"`` folds W_UK / W_UV into q_proj / o_proj where exact and not larger, ``"fold"``
      wherever exact, ``"matmul"`` never (per-head MatMuls).
    * ``mla_prefill`` (MLA): ``"expanded"`` (default) attends the rows of fresh prompts (no cached prefix) in the
      expanded form (``kv_b_proj`` up-projects their own latent rows, 192 / 128 per head) and everything else
      with the LATENT node; ``"absorbed"`` attends every row with the LATENT node. Where the expanded form cannot
      apply (int8 caches, ``rope_in_op``) the conversion stays absorbed and says why in the model's metadata
      (``ortpa.mla_prefill``); see :mod:`ortpa.rewriter.mla_expanded`.
    * ``attention_metadata``: add the host-side ``attention_metadata`` input; ``position_ids``: ``"derive"``
      positions in the graph from the sequence lengths, or take an ``"input"``.
    """

    dtype: DType | None = None
    rope_in_op: bool = False
    logits: LogitsMode = "last"
    kv_cache_dtype: str | None = "auto"
    absorb: AbsorbMode = "auto"
    mla_prefill: PrefillForm = "expanded"
    attention_metadata: bool = True
    position_ids: PositionMode = "derive"
    max_positions: int | None = None
    kv_scale: KVScaleMode = "per-channel"
    kv_scale_margin: float = DEFAULT_MARGIN
    calibration_prompts: Sequence[Sequence[int]] | None = None

    def __post_init__(self) -> None:
        if self.kv_cache_dtype is None:  # what callers passed for "the default" before `auto` had a name
            object.__setattr__(self, "kv_cache_dtype", "auto")
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ConversionError(f"{name}: expected one of {list(allowed)}, found {getattr(self, name)!r}")
        if self.max_positions is not None and self.max_positions < 1:
            raise ConversionError(f"max_positions: expected a positive row count, found {self.max_positions}")

    @classmethod
    def field_names(cls) -> frozenset[str]:
        return frozenset(f.name for f in dataclasses.fields(cls))
