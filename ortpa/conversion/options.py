"""Everything a conversion is asked for, in one frozen dataclass: :class:`ConvertOptions`.

It holds the rewrite's own options (:class:`~ortpa.rewriter.options.RewriteOptions`: what the paged graph is) and
what the orchestrator does around the rewrite: where the model must open (``providers``), verification, the
``--portable`` lowering, ``genai_config.json``'s settings, and how a Hugging Face checkpoint is exported first.
:meth:`ConvertOptions.of` takes them all as flat keywords, as ``ortpa.convert_file(model, out, dtype="float16",
portable=True)`` spells them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ortpa.deploy.genai_config import GenaiOptions
from ortpa.errors import ConversionError
from ortpa.parity.verify import DEFAULT_STEPS
from ortpa.rewriter.options import RewriteOptions
from ortpa.rewriter.ort_check import DEFAULT_PROVIDERS

__all__ = ["ConvertOptions", "ExportOptions"]


@dataclass(frozen=True)
class ExportOptions:
    """How a Hugging Face checkpoint is exported to dense ONNX (:func:`ortpa.export.hf.export_hf`'s options)."""

    opset: int = 18
    attn_implementation: str = "sdpa"
    experts: str = "grouped_mm"
    dtype: str | None = None  # default: float16 for a bfloat16 or FP8 checkpoint, else as stored
    external_data: bool | None = None  # default: only past 1 GB of weights
    verbose: bool = False  # the libraries' own warnings and bars
    # trace every decoder layer instead of two of each kind copied to the others (ortpa.export.repeat)
    trace_every_layer: bool = False


@dataclass(frozen=True)
class ConvertOptions:
    """* ``rewrite``: what the paged graph is (dtype, RoPE, logits rows, caches, absorption...).
    * ``providers``: where the model is meant to run (``"cpu"``, ``"cuda"``): ONNX Runtime must open it on each
      (CUDA where this machine has a device); ``()`` skips the check.
    * ``verify``: run the converted model against its original before it is published (``verify_steps`` greedy
      steps on seeded prompts; one rule for every model, docs/verification.md). Skip only for a model this
      machine cannot run.
    * ``portable``: lower every PagedAttention node to standard ONNX ops (any execution provider, genai on CPU).
    * ``if_free``: with ``portable``, the form without ``If`` (both attention groups at every step, padded so that
      nothing is empty): the OpenVINO EP compiles it; slower on the CPU EP (docs/portable.md).
    * ``genai``: ``genai_config.json``'s ``engine.dynamic_batching`` settings.
    * ``revision``: branch, tag or commit when the model is a Hugging Face repo id in the local cache.
    * ``export``: how a Hugging Face checkpoint folder (config.json, weights, no ONNX file) is exported first;
      ``keep_dense``: a folder that keeps that dense export (default: a temporary folder, removed).
    """

    rewrite: RewriteOptions = field(default_factory=RewriteOptions)
    providers: tuple[str, ...] = tuple(DEFAULT_PROVIDERS)
    verify: bool = True
    verify_steps: int = DEFAULT_STEPS
    portable: bool = False
    if_free: bool = False
    genai: GenaiOptions = field(default_factory=GenaiOptions)
    revision: str | None = None
    export: ExportOptions = field(default_factory=ExportOptions)
    keep_dense: Path | None = None

    @classmethod
    def of(cls, **fields: Any) -> ConvertOptions:
        """The options spelled as flat keywords: the rewrite's fields and this class's own."""
        mine = {f.name for f in dataclasses.fields(cls)}
        rewrite_fields = RewriteOptions.field_names()
        unknown = set(fields) - mine - rewrite_fields
        if unknown:
            raise TypeError(
                f"unexpected conversion options {sorted(unknown)}; expected some of {sorted(mine | rewrite_fields)}"
            )
        rewrite = RewriteOptions(**{k: v for k, v in fields.items() if k in rewrite_fields})
        own = {k: v for k, v in fields.items() if k in mine}
        if "providers" in own:
            own["providers"] = tuple(own["providers"])
        if "rewrite" in own and rewrite != RewriteOptions():
            raise TypeError("give the rewrite options as rewrite=RewriteOptions(...) or as keywords, not both")
        return cls(**{"rewrite": rewrite, **own})

    def check(self) -> None:
        """Options that cannot be honoured together, refused before any work (one line each)."""
        self.genai.check()
        if self.portable and self.rewrite.kv_cache_dtype == "float8e4m3fn":
            raise ConversionError(
                "--portable cannot honour --kv-cache-dtype float8e4m3fn: ONNX Gather/ScatterND have no float8 form; "
                "use float16, bfloat16 or int8"
            )
        if self.if_free and not self.portable:
            raise ConversionError("--if-free is a form of --portable: expected --portable with it, found it alone")
        if self.verify_steps < 1:
            raise ConversionError(f"verify_steps: expected >= 1, found {self.verify_steps}")
