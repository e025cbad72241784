"""The export traces two layers of each kind and writes the others as their copies (``ortpa.export.repeat``): the
graph it writes is the one the full trace writes, for every family the export supports.

Each case exports one model twice, with the copies and with every layer traced, and asserts (a) the copies were
used (the progress line says how many layers were traced: a test of the full trace against itself proves nothing),
(b) the two graphs compute the same outputs by the same nodes from the same parameters (``fingerprint``: structural
hashes of every output, parameters by name), (c) ONNX Runtime's outputs are equal element for element (each
parameter's bytes are the right layer's). Configs are the sweep's draws (``ortpa.testing.sweep``) with enough
layers that some are copies of each kind: Gemma-2 alternates sliding and global layers, Qwen-2 turns sliding after
``max_window_layers``, DeepSeek-V3 has a dense first layer before its MoE layers, Gemma-3 has rotary tables as wide
as the model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
import torch
from support.dense_run import dense_outputs

from ortpa.export import repeat
from ortpa.export.hf import build_model, export_hf
from ortpa.testing.checkpoints import save_checkpoint
from ortpa.testing.sweep.space import draw

pytestmark = pytest.mark.export

_LAYERS = 5  # past the traced layers of every kind below (at most 2 kinds x 2 layers)


def _export_both(model, tmp_path: Path, **kw) -> tuple[list[str], Path, Path]:
    lines: list[str] = []
    copied, full = tmp_path / "copied" / "model.onnx", tmp_path / "full" / "model.onnx"
    export_hf(model, copied, repeat_layers=True, progress=lines.append, **kw)
    export_hf(model, full, repeat_layers=False, **kw)
    return lines, copied, full


def _assert_same(copied: Path, full: Path) -> None:
    a, b = repeat.fingerprint(ir.load(copied).graph), repeat.fingerprint(ir.load(full).graph)
    assert a[0] == b[0], "graph inputs differ"
    for x, y in zip(a[1], b[1], strict=True):
        assert x == y, f"output {y[0]} computed differently"
    for x, y in zip(dense_outputs(copied, vocab=200), dense_outputs(full, vocab=200), strict=True):
        np.testing.assert_array_equal(x, y)


def _traced_line(lines: list[str]) -> str:
    return next(line for line in lines if line.startswith("tracing"))


def _config(family: str) -> tuple[dict, str]:
    d = draw(family, 0)
    config = {k: v for k, v in d.config.items() if k != "layer_types"}  # per-layer lists follow the layer count
    return {**config, "num_hidden_layers": _LAYERS}, d.attn_implementation


_DEFAULT = ["gemma3", "deepseek_v3"]
_MORE = ["llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "deepseek_v2", "minicpm3"]


@pytest.mark.parametrize(
    "family", [*_DEFAULT, *(pytest.param(f, marks=pytest.mark.slow) for f in _MORE)]
)  # fmt: skip
def test_copied_layers_are_the_full_trace(family, tmp_path):
    config, attn = _config(family)
    lines, copied, full = _export_both(config, tmp_path, random_weights=True, optimize=False, attn_implementation=attn)
    line = _traced_line(lines)
    assert f"of {_LAYERS} layers (the others repeat them)" in line, lines
    assert not any("tracing all" in ln for ln in lines), lines
    _assert_same(copied, full)


def test_copied_layers_of_a_checkpoint_hold_each_layers_weights(tmp_path, capsys):
    """The default path: a bfloat16 checkpoint folder, weights streamed after the trace into the copies' own
    initializers (each layer's bytes, by the placeholder it holds); ``ortpa export --trace-every-layer`` traces
    them all."""
    from ortpa.cli import main

    config, _ = _config("llama")
    folder = tmp_path / "ckpt"
    save_checkpoint(build_model(config, seed=5), folder, torch.bfloat16)
    lines: list[str] = []
    export_hf(folder, tmp_path / "copied" / "model.onnx", random_weights=False, progress=lines.append)
    assert f"2 of {_LAYERS} layers" in _traced_line(lines), lines
    assert main(["export", str(folder), str(tmp_path / "full" / "model.onnx"), "--trace-every-layer"]) == 0
    assert f"tracing llama: {_LAYERS} layers," in capsys.readouterr().err
    _assert_same(tmp_path / "copied" / "model.onnx", tmp_path / "full" / "model.onnx")


def test_layers_that_differ_by_index_are_all_traced(tmp_path, monkeypatch):
    """A layer whose graph depends on its index where no config entry or module attribute says so: the two traced
    copies differ, the export says why and traces every layer; the result is the full trace's."""
    from transformers.models.llama import modeling_llama

    original = modeling_llama.LlamaDecoderLayer.forward

    def scaled(self, *args, **kwargs):
        return original(self, *args, **kwargs) * float(self.self_attn.layer_idx + 1)

    monkeypatch.setattr(modeling_llama.LlamaDecoderLayer, "forward", scaled)
    config, _ = _config("llama")
    lines, copied, full = _export_both(config, tmp_path, random_weights=True, optimize=False)
    assert any(ln.startswith(f"tracing all {_LAYERS} layers: the traced ones do not stand") for ln in lines), lines
    _assert_same(copied, full)


def test_plan_groups_layers_by_what_their_modules_are():
    """Kinds come from the modules and the config's per-layer entries: DeepSeek-V3's dense first layer is its own
    kind, Gemma-2's sliding and global layers alternate; two of each kind are traced."""
    dsv3, _ = _config("deepseek_v3")
    plan = repeat.plan(build_model({**dsv3, "first_k_dense_replace": 1}, seed=0))
    assert plan is not None and plan.kinds == (0, 1, 1, 1, 1) and plan.traced == (0, 1, 2)
    gemma2, attn = _config("gemma2")
    plan = repeat.plan(build_model(gemma2, seed=0, attn_implementation=attn))
    assert plan is not None and plan.kinds == (0, 1, 0, 1, 0) and plan.traced == (0, 1, 2, 3)
    assert repeat.plan(build_model({**dsv3, "num_hidden_layers": 3, "first_k_dense_replace": 1}, seed=0)) is None


def test_traced_layers_renamed_past_one_another(tmp_path):
    """Kinds [full x 3, sliding x 3] (Qwen-2 sliding past ``max_window_layers`` 3): layers 0, 1, 3 and 4 traced, so
    the third traced copy takes the name of layer 3 while the fourth still holds it; every one lands on its own."""
    config, attn = _config("qwen2")
    config.update(num_hidden_layers=6, use_sliding_window=True, sliding_window=4, max_window_layers=3)
    lines, copied, full = _export_both(config, tmp_path, random_weights=True, optimize=False, attn_implementation=attn)
    assert "4 of 6 layers (the others repeat them)" in _traced_line(lines), lines
    _assert_same(copied, full)
