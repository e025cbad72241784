"""A checkpoint's export with its weights streamed after a weightless trace computes what the export of the same
checkpoint loaded whole and traced with its weights computes (the path before issue 37): ONNX Runtime's outputs are
compared element for element, every family from its committed fixture's config, bfloat16 and FP8 folders."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from support.dense_run import dense_outputs
from support.parity import FIXTURES

from ortpa.errors import InvalidModel
from ortpa.export import streamed
from ortpa.export.hf import build_model, export_hf
from ortpa.export.streamed import Placeholders
from ortpa.testing.checkpoints import save_checkpoint, save_fp8_checkpoint

pytestmark = pytest.mark.export

_TIED_LLAMA = {
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "tie_word_embeddings": True,
}


def _streamed_equals_whole(
    folder: Path, tmp_path: Path, reference_folder: Path | None = None, attn_implementation: str = "sdpa"
) -> list[str]:
    """Export ``folder`` streamed and (from ``reference_folder``, default the same) loaded whole; assert equal
    outputs; return the streamed export's progress lines."""
    lines: list[str] = []
    streamed = tmp_path / "streamed" / "model.onnx"
    export_hf(folder, streamed, random_weights=False, progress=lines.append, attn_implementation=attn_implementation)
    whole_model = build_model(
        reference_folder or folder, random_weights=False, dtype="float16", attn_implementation=attn_implementation
    )
    whole = tmp_path / "whole" / "model.onnx"
    export_hf(whole_model, whole, attn_implementation=attn_implementation)
    new, old = dense_outputs(streamed, vocab=256), dense_outputs(whole, vocab=256)
    assert len(new) == len(old)
    for a, b in zip(new, old, strict=True):
        np.testing.assert_array_equal(a, b)
    return lines


def test_streamed_export_of_tied_llama_equals_the_whole_export(tmp_path, monkeypatch):
    """Tied embeddings: read by Gather and (transposed) by the logits MatMul; streamed once from the checkpoint,
    written in both layouts (the transposed one in row blocks, made small here so that it takes many); the announced
    size counts the shared tensor once. The allocator's freed pages are returned after every parameter (without
    that, glibc's fragmented heap grew the streaming's peak with the checkpoint's size, issue 37)."""
    released: list[int] = []
    monkeypatch.setattr(streamed, "release_freed", lambda: released.append(1) or True)
    monkeypatch.setattr(streamed, "_BLOCK_BYTES", 1024)  # the 256x64 embedding, transposed: 32 blocks of 2 rows
    model = build_model(_TIED_LLAMA, seed=3)
    folder = tmp_path / "ckpt"
    save_checkpoint(model, folder, torch.bfloat16)
    lines = _streamed_equals_whole(folder, tmp_path)
    unique = {p.data_ptr(): p.numel() * 2 for p in model.parameters()}  # float16: 2 bytes a weight
    assert len(released) >= len(unique), (len(released), len(unique))
    traced = next(line for line in lines if line.startswith("tracing"))
    assert f"{sum(unique.values()) / 1e6:.1f} MB of weights (not read" in traced, traced
    graph = onnx.load(str(tmp_path / "streamed" / "model.onnx"), load_external_data=False).graph
    # no Transpose of a weight left for an optimizer to fold in memory
    initializers = {t.name for t in graph.initializer}
    assert not [n for n in graph.node if n.op_type == "Transpose" and n.input[0] in initializers]
    assert all(t.data_location == onnx.TensorProto.EXTERNAL for t in graph.initializer if t.name.endswith(".weight.T"))


@pytest.mark.slow  # two exports per family (~30-90 s each on 2 cores)
@pytest.mark.parametrize(
    "name",
    [
        "llama_sdpa_op18",
        "qwen2_sliding_sdpa_op18",
        "qwen3_sdpa_op18",
        "gemma2_eager_op18",
        "phi3_longrope_sdpa_op18",
        "dsv2lite_moe_sdpa_op18",
        "dsv3_moe_sdpa_op18",
        "minicpm3_sdpa_op18",
    ],
)
def test_streamed_export_equals_the_whole_export(name, tmp_path):
    info = json.loads((FIXTURES / f"{name}.json").read_text())
    folder = tmp_path / "ckpt"
    attn = info.get("attn_implementation", "sdpa")
    save_checkpoint(build_model(info["config"], seed=5, attn_implementation=attn), folder, torch.bfloat16)
    _streamed_equals_whole(folder, tmp_path, attn_implementation=attn)


def test_streamed_export_of_an_fp8_moe_checkpoint_equals_the_whole_export(tmp_path):
    """DeepSeek-V3 FP8 (block scales, fused MoE experts): dequantized one tensor at a time while streaming, the
    same bytes as the dequantized copy the whole export loads."""
    from ortpa.export.fp8 import dequantized_copy, fp8_spec

    config = json.loads((FIXTURES / "dsv3_moe_sdpa_op18.json").read_text())["config"]
    folder = tmp_path / "ckpt"
    assert save_fp8_checkpoint(build_model(config, seed=5), folder) > 0
    with dequantized_copy(folder, fp8_spec(folder), "float16", scratch_parent=tmp_path) as plain:
        _streamed_equals_whole(folder, tmp_path, reference_folder=plain)


def test_a_transposed_weight_is_written_in_row_blocks(monkeypatch):
    """Never a whole contiguous copy of a transposed weight: blocks of at most the budget, together the weight."""
    monkeypatch.setattr(streamed, "_BLOCK_BYTES", 96)
    weight = torch.arange(7 * 10, dtype=torch.float16).reshape(7, 10).T  # 10 rows of 7 float16: 14 bytes a row
    blocks = list(streamed._row_blocks(weight))
    assert [b.shape[0] for b in blocks] == [6, 4]
    assert all(b.numel() * b.element_size() <= 96 for b in blocks)
    assert torch.equal(torch.cat([b.contiguous() for b in blocks]), weight.contiguous())
    contiguous = weight.contiguous()
    assert [b.data_ptr() for b in streamed._row_blocks(contiguous)] == [contiguous.data_ptr()]


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_the_float16_range_check_finds_an_overflow_anywhere(bad):
    """The check of a weight cast to float16 finds an infinity or a NaN anywhere, in a contiguous weight, a
    transposed view or a slice; an empty weight passes."""
    weight = torch.randn(40, 30).half()
    assert streamed._finite(weight) and streamed._finite(weight.T) and streamed._finite(weight[:0])
    for index in ((0, 0), (17, 3), (39, 29)):
        w = weight.clone()
        w[index] = bad
        assert not streamed._finite(w) and not streamed._finite(w.T)
        assert not streamed._finite(w[index[0] :, index[1] :])
        assert streamed._finite(w[index[0] + 1 :]) and bool(torch.isfinite(w[index[0] + 1 :]).all())


def test_a_stored_weight_is_cast_a_block_of_rows_at_a_time(tmp_path, monkeypatch):
    """Streaming reads a weight stored in another dtype into the export's dtype a block of rows at a time (the
    loader's own copy reads it whole and then casts: both whole copies at once); the same values as the cast."""
    import transformers.core_model_loading as loading
    from safetensors import safe_open
    from safetensors.torch import save_file

    monkeypatch.setattr(streamed, "_BLOCK_BYTES", 6000)  # 300 bfloat16 a row: 10 rows a block
    weight = torch.randn(95, 300).bfloat16()
    save_file({"w": weight}, str(tmp_path / "w.safetensors"))

    class Recorded:
        def __init__(self, inner):
            self.inner, self.asked = inner, []

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def __getitem__(self, index):
            self.asked.append(index)
            return self.inner[index]

    with safe_open(str(tmp_path / "w.safetensors"), "pt") as handle:
        stored = Recorded(handle.get_slice("w"))
        with streamed._intercepted(lambda name, tensor: tensor, read=True):
            got = loading._materialize_copy(stored, torch.device("cpu"), torch.float16)
    assert torch.equal(got, weight.to(torch.float16))
    assert stored.asked == [slice(start, start + 10) for start in range(0, 95, 10)]


def test_a_view_of_a_placeholder_is_refused():
    placeholders = Placeholders()
    weight = placeholders.make("w", torch.empty((4, 8), dtype=torch.float16, device="meta"))
    assert placeholders.name_of(weight) == "w"
    assert placeholders.name_of(torch.zeros(3)) is None
    with pytest.raises(InvalidModel, match="through a view"):
        placeholders.name_of(weight[1:])
