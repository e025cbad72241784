"""The export-time patches and error summaries, without exporting: fast unit checks (the `export` extra)."""

from __future__ import annotations

import json

import pytest
import torch

from ortpa.export.errors import ExportError, summarize
from ortpa.export.hf import build_model
from ortpa.export.patches import real_rope, translation_table, use_experts
from ortpa.model.folder import eos_token_ids

pytestmark = pytest.mark.export

_DSV2 = {
    "model_type": "deepseek_v2",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "q_lora_rank": None,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 16,
    "v_head_dim": 16,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 64,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
}


def test_real_rope_equals_complex_rope():
    """Same numbers in the same (interleaved) places as the complex version, whole model and cache included."""
    import transformers.models.deepseek_v2.modeling_deepseek_v2 as v2
    from transformers import DynamicCache

    model = build_model(_DSV2)
    ids = torch.tensor([[5, 3, 9, 1, 7, 2]])
    with torch.no_grad():
        want = model(input_ids=ids, cache=DynamicCache(config=model.config), use_cache=True)
        original = v2.apply_rotary_emb
        with real_rope(model) as applied:
            assert applied and v2.apply_rotary_emb is not original
            got = model(input_ids=ids, cache=DynamicCache(config=model.config), use_cache=True)
        assert v2.apply_rotary_emb is original  # restored
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=1e-6)
    torch.testing.assert_close(got.cache.layers[0].values, want.cache.layers[0].values, rtol=0, atol=1e-6)


def test_real_rope_leaves_other_models_alone():
    model = build_model({**_DSV2, "model_type": "deepseek_v3", "n_group": 1, "topk_group": 1})
    with real_rope(model) as applied:
        assert applied is False


def test_use_experts_sets_and_restores():
    model = build_model(_DSV2)
    before = model.get_experts_implementation()
    with use_experts(model, "batched_mm"):
        assert model.config._experts_implementation == "batched_mm"
    assert model.get_experts_implementation() == before
    with pytest.raises(ValueError, match="eager"), use_experts(model, "eager"):
        pass
    assert torch.ops.transformers.grouped_mm_fallback.default in translation_table()


def _raise_chain():
    try:
        raise RuntimeError(
            "No ONNX function found for <OpOverload(op='transformers.grouped_mm_fallback', overload='default')>\n"
            '  File "/x/transformers/models/deepseek_v3/modeling_deepseek_v3.py", line 77, in forward\n'
        )
    except RuntimeError as inner:
        raise ValueError("\x1b[96mFailed to convert the exported program to an ONNX model.\x1b[0m\nmore") from inner


def test_summarize_names_op_module_and_remedy():
    with pytest.raises(ValueError) as info:
        _raise_chain()
    failure = summarize(info.value)
    assert failure.op == "transformers.grouped_mm_fallback"
    assert failure.module == "modeling_deepseek_v3.py:77 in forward"
    assert "--experts batched_mm" in failure.hint
    line = str(ExportError("cfg.json", failure))
    assert "\n" not in line and line.startswith("cfg.json: export failed: no ONNX translation for transformers.")
    complex_failure = summarize(RuntimeError("No ONNX function found for aten.unsqueeze.default complex-valued"))
    assert complex_failure.op == "aten.unsqueeze.default" and "complex" in complex_failure.hint
    plain = summarize(KeyError("x"))
    assert plain.op is None and plain.detail == "KeyError: 'x'" and "--verbose" in plain.hint


def test_cli_traceback_only_with_verbose(tmp_path, capsys, monkeypatch):
    import ortpa.export.hf as export
    from ortpa.cli import main

    def failing(*args, **kwargs):
        try:
            _raise_chain()
        except ValueError as exc:
            raise ExportError("cfg.json", summarize(exc)) from exc

    monkeypatch.setattr(export, "export_hf", failing)
    argv = ["export", "cfg.json", str(tmp_path / "p.onnx"), "--random-weights"]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ortpa export: error: cfg.json: export failed:"), err
    assert main([*argv, "--verbose"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "grouped_mm_fallback" in err and err.strip().splitlines()[-1].startswith("ortpa")


def test_eos_ids(tmp_path):
    model = tmp_path / "m.onnx"
    assert eos_token_ids(model) == []
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert eos_token_ids(model) == [7]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    assert eos_token_ids(model) == [1, 2]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(ValueError, match="eos_token_id"):
        eos_token_ids(model)


def test_generate_prompt_without_tokenizer_is_one_line(tmp_path, capsys):
    from support.parity import FIXTURES

    from ortpa.cli import main

    paged = tmp_path / "paged.onnx"
    assert main(["convert", str(FIXTURES / "dsv3_sdpa_op18.onnx"), str(paged), "--quiet"]) == 0
    assert main(["generate", str(paged), "--prompt", "hello"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tokenizer.json" in err[0] and str(tmp_path) in err[0], err
