"""What ``torch.onnx.export`` needs changed, for the length of one export, to take MLA models as they ship.

* MoE experts: transformers' default experts implementation, ``grouped_mm``, calls the custom op
  ``transformers::grouped_mm_fallback`` on CPU, which torchlib cannot translate. transformers 5.x ships an
  ONNX lowering for it (``transformers.exporters.exporter_onnx._aten_grouped_mm``: one ``MatMul`` per expert
  over the rows routed to it); :func:`translation_table` hands that to ``torch.onnx.export``. ``batched_mm``
  (a gather of one weight matrix per token and chosen expert) also exports, without a custom translation;
  ``eager`` does not (a data-dependent loop over the experts hit).
* DeepSeek-V2's RoPE is written with complex numbers (``torch.polar``, ``view_as_complex``), which torchlib
  cannot translate. :func:`real_rope` swaps in a real-valued equivalent for the export: the rotary module
  returns ``(cos, sin)`` stacked in a last axis of 2 instead of ``cos + i sin``, and ``apply_rotary_emb``
  multiplies the (even, odd) pairs by it with real arithmetic. The result keeps the interleaved layout of
  the complex version (the same numbers in the same places, so ``present.{i}.value`` matches PyTorch too).
  transformers' own ONNX patches (complex ``unsqueeze`` and ``exp`` through ``torch.complex``) are not used:
  they keep complex tensors in the traced graph, which ONNX Runtime's CPU kernels do not run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = [
    "EXPERTS_IMPLEMENTATIONS",
    "export_patches",
    "has_experts",
    "real_rope",
    "translation_table",
    "use_experts",
]

# What ``--experts`` accepts: the implementations that export (``eager`` loops over the experts hit).
EXPERTS_IMPLEMENTATIONS = ("grouped_mm", "batched_mm")


def translation_table() -> dict[Any, Any]:
    """Custom torchlib translations for ``torch.onnx.export``: transformers' lowering of the grouped MoE matmul."""
    import torch

    try:
        from transformers.exporters.exporter_onnx import _aten_grouped_mm
    except ImportError:  # a transformers without its exporters: batched_mm still exports
        return {}
    table: dict[Any, Any] = {torch.ops.aten._grouped_mm.default: _aten_grouped_mm}
    fallback = getattr(getattr(torch.ops, "transformers", None), "grouped_mm_fallback", None)
    if fallback is not None:
        table[fallback.default] = _aten_grouped_mm
    return table


def has_experts(model) -> bool:
    """Whether ``model`` runs MoE experts through transformers' experts implementations (which :func:`use_experts`
    chooses and :func:`translation_table` translates)."""
    return bool(getattr(model, "_can_set_experts_implementation", lambda: False)())


@contextlib.contextmanager
def use_experts(model, implementation: str | None) -> Iterator[None]:
    """Run ``model``'s MoE experts with ``implementation`` inside the block (models without MoE: no change)."""
    if implementation is not None and implementation not in EXPERTS_IMPLEMENTATIONS:
        raise ValueError(f"experts implementation must be one of {EXPERTS_IMPLEMENTATIONS}, got {implementation!r}")
    if implementation is None or not has_experts(model):
        yield
        return
    original = model.get_experts_implementation()
    model.set_experts_implementation(implementation)
    try:
        yield
    finally:
        model.set_experts_implementation(original)


def _rotary_forward_real(self, x, position_ids):
    """DeepSeek-V2's rotary embedding as ``[..., dim/2, 2]`` = (cos, sin) * scaling instead of a complex tensor."""
    import torch

    freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
    return torch.stack((freqs.cos(), freqs.sin()), dim=-1) * self.attention_scaling


def _apply_rotary_emb_real(xq, xk, freqs_cis):
    """``view_as_real(view_as_complex(x pairs) * (cos + i sin))`` with real arithmetic, same layout and values."""
    import torch

    cos = freqs_cis[..., 0].unsqueeze(1)  # [batch, 1, seq, dim/2]: broadcast over heads
    sin = freqs_cis[..., 1].unsqueeze(1)

    def rotate(x):
        pairs = x.float().reshape(*x.shape[:-1], -1, 2)
        re, im = pairs[..., 0], pairs[..., 1]
        out = torch.stack((re * cos - im * sin, re * sin + im * cos), dim=-1)
        return out.flatten(3).type_as(x)

    return rotate(xq), rotate(xk)


@contextlib.contextmanager
def real_rope(model) -> Iterator[bool]:
    """Inside the block, DeepSeek-V2-style complex RoPE runs as its real-valued equivalent; yields whether it did.

    Recognised by the modeling module defining ``apply_rotary_emb(xq, xk, freqs_cis)`` and a rotary module whose
    forward builds ``torch.polar``; other models are left alone.
    """
    import inspect
    import sys

    module = sys.modules.get(type(model).__module__)
    rotary = _find_rotary(model)
    apply = getattr(module, "apply_rotary_emb", None)
    complex_rope = rotary is not None and apply is not None and "polar" in inspect.getsource(type(rotary).forward)
    if not complex_rope:
        yield False
        return
    from transformers.modeling_rope_utils import dynamic_rope_update

    rotary_cls = type(rotary)
    old_forward = rotary_cls.forward
    rotary_cls.forward = dynamic_rope_update(_rotary_forward_real)  # as the original: a no-op for static RoPE
    module.apply_rotary_emb = _apply_rotary_emb_real
    try:
        yield True
    finally:
        rotary_cls.forward = old_forward
        module.apply_rotary_emb = apply


def _find_rotary(model):
    for name, sub in model.named_modules():
        if name.endswith("rotary_emb"):
            return sub
    return None


@contextlib.contextmanager
def export_patches(model, experts: str | None = "grouped_mm") -> Iterator[dict[str, Any]]:
    """All of the above for one export; yields what was applied (recorded in the export info)."""
    with use_experts(model, experts), real_rope(model) as rope:
        applied: dict[str, Any] = {"real_rope": rope}
        if has_experts(model):
            applied["experts_implementation"] = experts
        yield applied
