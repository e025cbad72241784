"""``kv_cache_dtype="auto"`` (the default): the model's activation dtype, float16 for a float32 model (the op has no
float32); what was picked and why is in the model's metadata and convert's summary."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest

from ortpa.cli import main
from ortpa.errors import ConversionError
from ortpa.rewriter.options import RewriteOptions
from ortpa.rewriter.pipeline import convert

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
LLAMA32 = FIXTURES / "llama_sdpa_op18.onnx"  # float32, GQA
DSV3 = FIXTURES / "dsv3_sdpa_op18.onnx"  # float32, MLA
FP16 = FIXTURES / "formats" / "genai_llama_fp16.onnx"


def _element_type(model: onnx.ModelProto) -> int:
    return next(i.type.tensor_type.elem_type for i in model.graph.input if i.name == "past_key_values.0.key")


def _stored_float_type(path: Path) -> int:
    """The dense model's own activation type, read from its cache input (the dense export's past key)."""
    dense = onnx.load(str(path), load_external_data=False)
    return next(i.type.tensor_type.elem_type for i in dense.graph.input if i.name.startswith("past_key_values."))


def _meta(model: onnx.ModelProto) -> dict[str, str]:
    return {p.key: p.value for p in model.metadata_props}


@pytest.mark.parametrize("fixture", [LLAMA32, DSV3], ids=["gqa", "mla"])
def test_auto_gives_a_float32_model_the_more_precise_half_type_and_says_so(fixture):
    assert _stored_float_type(fixture) == onnx.TensorProto.FLOAT
    model = convert(str(fixture), providers=())
    assert _element_type(model) == onnx.TensorProto.FLOAT16
    meta = _meta(model)
    assert meta["ortpa.kv_cache_dtype"] == "float16"
    assert meta["ortpa.kv_cache_dtype_reason"].startswith("auto: ") and "float32" in meta["ortpa.kv_cache_dtype_reason"]


def test_auto_keeps_a_half_models_own_type():
    assert _stored_float_type(FP16) == onnx.TensorProto.FLOAT16
    model = convert(str(FP16), providers=())
    assert _element_type(model) == onnx.TensorProto.FLOAT16
    assert _meta(model)["ortpa.kv_cache_dtype_reason"] == "auto: the model's activation dtype (float16)"


def test_auto_follows_the_converted_dtype_and_an_asked_type_is_recorded_as_asked():
    converted = convert(str(LLAMA32), dtype="bfloat16", providers=())
    assert _element_type(converted) == onnx.TensorProto.BFLOAT16
    assert _meta(converted)["ortpa.kv_cache_dtype_reason"] == "auto: the converted model's dtype (bfloat16)"
    asked = convert(str(LLAMA32), kv_cache_dtype="bfloat16", providers=())
    assert _element_type(asked) == onnx.TensorProto.BFLOAT16
    assert _meta(asked)["ortpa.kv_cache_dtype"] == "bfloat16"
    assert _meta(asked)["ortpa.kv_cache_dtype_reason"] == "asked (bfloat16)"
    with pytest.raises(ConversionError, match="differs from the model's FLOAT16"):
        convert(str(FP16), kv_cache_dtype="bfloat16", providers=())
    assert RewriteOptions(kv_cache_dtype=None) == RewriteOptions()  # None: the default, auto
    with pytest.raises(ConversionError, match="kv_cache_dtype: expected one of"):
        convert(str(LLAMA32), kv_cache_dtype="float32", providers=())


def test_convert_prints_the_cache_type_and_reports_it_in_json(tmp_path, capsys):
    out = tmp_path / "a" / "model.onnx"
    assert main(["convert", str(LLAMA32), str(out), "--no-verify"]) == 0
    printed = capsys.readouterr().out
    assert "KV cache: float16 (auto: the model computes in float32" in printed, printed
    assert main(["convert", str(FP16), str(tmp_path / "b" / "model.onnx"), "--no-verify", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["kv_cache_dtype"] == "float16" and report["kv_cache_dtype_reason"].startswith("auto: ")
