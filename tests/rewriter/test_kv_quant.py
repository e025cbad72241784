"""int8 KV caches from the converter (``convert(..., kv_cache_dtype="int8")``, ortpa.rewriter.kv_quant).

One MLA fixture (LATENT: one ``k_scale`` over the ``[latent | k_pe]`` row) and one GQA fixture (SEPARATE:
``k_scale`` and ``v_scale``). The converted node must pass ortpa's CUDA validation, the caches must be int8
graph inputs, and the model must track the dense export within the int8 precision rule
(:func:`ortpa.tolerances.precision_kl_bound`) through :func:`parity.run_parity` and generate the dense model's
greedy tokens through the Engine. Expected scale shapes and values come from the dense model's own I/O, run here
independently of the calibration code.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from support.parity import FIXTURES, DenseModel, attrs, paged_nodes, run_parity

from ortpa.cli import main
from ortpa.errors import ConversionError
from ortpa.ops.validate import validate_model
from ortpa.rewriter.pipeline import convert
from ortpa.runtime.engine import Engine, SamplingParams

MLA, GQA = "dsv3_sdpa_op18", "llama_sdpa_op18"
CPU = ["CPUExecutionProvider"]
_CACHE: dict[tuple[str, str], onnx.ModelProto] = {}


def _int8(fixture: str, mode: str = "per-channel") -> onnx.ModelProto:
    if (fixture, mode) not in _CACHE:
        _CACHE[fixture, mode] = convert(str(FIXTURES / f"{fixture}.onnx"), kv_cache_dtype="int8", kv_scale=mode)
    return _CACHE[fixture, mode]


def _dense_dims(fixture: str) -> dict[str, tuple[int, int]]:
    """``past_key_values.{i}.{key,value}`` -> (heads, width) as the dense export declares them."""
    model = onnx.load(str(FIXTURES / f"{fixture}.onnx"), load_external_data=False)
    return {
        v.name: (v.type.tensor_type.shape.dim[1].dim_value, v.type.tensor_type.shape.dim[3].dim_value)
        for v in model.graph.input
        if v.name.startswith("past_key_values.")
    }


def _inits(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}


@pytest.mark.parametrize("mode", ["per-channel", "per-tensor"])
@pytest.mark.parametrize("fixture", [MLA, GQA])
def test_int8_model_is_valid_with_int8_caches_and_scales(fixture: str, mode: str) -> None:
    model = _int8(fixture, mode)
    report = validate_model(model, backend="cuda")
    assert report.ok, report.format() if hasattr(report, "format") else report
    dims = _dense_dims(fixture)
    latent = fixture == MLA
    io = {v.name: v for v in [*model.graph.input, *model.graph.output]}
    inits = _inits(model)
    nodes = paged_nodes(model)
    assert len(nodes) == 2
    for node in nodes:
        a = attrs(node)
        layer = int(node.input[3].split(".")[1])
        kh, kw = dims[f"past_key_values.{layer}.key"]
        vh, vw = dims[f"past_key_values.{layer}.value"]
        quant = {"per-channel": b"PER_CHANNEL", "per-tensor": b"PER_TENSOR"}[mode]
        assert a["k_quant_type"] == quant and a["k_cache_dtype"] == b"int8"
        if latent:  # one cached row [latent | k_pe]: kv_num_heads 1, width key + value; no value cache or v_scale
            caches, want = [f"past_key_values.{layer}.key"], {"k": (1, 1, kw + vw)}
            assert "v_quant_type" not in a and (len(node.input) <= 15 or node.input[15] == "")
        else:
            caches, want = [node.input[3], node.input[4]], {"k": (kh, 1, kw), "v": (vh, 1, vw)}
            assert a["v_quant_type"] == quant and a["v_cache_dtype"] == b"int8"
        for name in caches + [n.replace("past_key_values", "present") for n in caches]:
            assert io[name].type.tensor_type.elem_type == onnx.TensorProto.INT8, name
        for kind, shape in want.items():
            scale = inits[node.input[14 if kind == "k" else 15]]
            assert scale.dtype == np.float32 and scale.shape == (shape if mode == "per-channel" else (1,))
            assert np.all(scale > 0) and np.all(np.isfinite(scale))


def test_int8_with_whole_model_float16() -> None:
    """``dtype="float16"`` casts every float32 tensor; the scales are added after it and stay float32."""
    model = convert(str(FIXTURES / f"{GQA}.onnx"), dtype="float16", kv_cache_dtype="int8")
    assert validate_model(model, backend="cuda").ok
    scales = {k: v for k, v in _inits(model).items() if k.startswith("kv_quant.")}
    assert len(scales) == 4 and all(v.dtype == np.float32 for v in scales.values())


def test_kv_bytes_per_token_halve() -> None:
    """The figure int8 buys: cache bytes per token per layer, from the converted graphs' cache inputs."""
    for fixture in (MLA, GQA):
        per_layer = {}
        for kind, model in (("fp16", convert(str(FIXTURES / f"{fixture}.onnx"))), ("int8", _int8(fixture))):
            caches = [v for v in model.graph.input if v.name.startswith("past_key_values.0.")]
            per_layer[kind] = sum(
                v.type.tensor_type.shape.dim[2].dim_value
                * v.type.tensor_type.shape.dim[3].dim_value
                * onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type).itemsize
                for v in caches
            )
        # MLA: one 80-wide row (64 latent + 16 k_pe); GQA: K and V of 2 heads x 16
        want = {"fp16": 160, "int8": 80} if fixture == MLA else {"fp16": 128, "int8": 64}
        assert per_layer == want, (fixture, per_layer)


def _calibration_amax(fixture: str, prompts: list[list[int]]) -> dict[str, np.ndarray]:
    """|present| maxima per (head, channel), run through the test driver's own dense runner."""
    dense = DenseModel(FIXTURES / f"{fixture}.onnx")
    out: dict[str, np.ndarray] = {}
    for ids in prompts:
        state = dense.new()
        dense.step(state, ids)
        for past_name, kv in state["kv"].items():
            name = past_name.removeprefix("past_key_values.")
            amax = np.abs(kv).max(axis=(0, 2))
            out[name] = np.maximum(out[name], amax) if name in out else amax
    return out


@pytest.mark.parametrize("fixture", [MLA, GQA])
def test_scales_are_calibrated_cache_maxima(fixture: str) -> None:
    """With caller prompts: scale = |cache content| max * margin / 127, per channel, in the op's channel order."""
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [200, 17, 99], list(range(30, 60))]
    model = convert(str(FIXTURES / f"{fixture}.onnx"), kv_cache_dtype="int8", calibration_prompts=prompts)
    amax, inits = _calibration_amax(fixture, prompts), _inits(model)
    for layer in (0, 1):
        if fixture == MLA:  # the row is the dense key (latent) then the dense value (rotated k_pe)
            want = {"k": np.concatenate([amax[f"{layer}.key"], amax[f"{layer}.value"]], -1)[:, None, :]}
        else:
            want = {"k": amax[f"{layer}.key"][:, None, :], "v": amax[f"{layer}.value"][:, None, :]}
        for kind, a in want.items():
            got = inits[f"kv_quant.layers.{layer}.{kind}_scale"]
            np.testing.assert_allclose(got, a * 1.25 / 127, rtol=1e-5, err_msg=f"layer {layer} {kind}_scale")


@pytest.mark.parametrize("fixture", [MLA, GQA])
def test_int8_parity(fixture: str) -> None:
    """Continuous batching vs the dense export within the int8 precision rule; MLA keeps every greedy token."""
    result = run_parity(_int8(fixture), FIXTURES / f"{fixture}.onnx", dtype="int8", allow_ties=fixture != MLA)
    assert result.tokens_checked == 24
    assert result.max_abs_error > 1e-3  # really quantized: a float cache is ~30x closer


@pytest.mark.parametrize("factor", [0.01, 10.0, 100.0])
def test_scales_matter(factor: float) -> None:
    """Scales 100x too small (everything clamps) or 10x / 100x too large (coarse, then flushed to zero) break
    parity: the calibration is what makes int8 work (measured max |dlogit| 5.9, 0.86, 3.7 on this fixture)."""
    model = onnx.ModelProto()
    model.CopyFrom(_int8(GQA))
    for init in model.graph.initializer:
        if init.name.startswith("kv_quant."):
            init.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(init) * factor, init.name))
    with pytest.raises(AssertionError):
        run_parity(model, FIXTURES / f"{GQA}.onnx", dtype="int8")


@pytest.mark.parametrize("fixture", [MLA, GQA])
def test_engine_generates_dense_greedy_tokens(fixture: str) -> None:
    """Engine (int8 cache OrtValues) on 3 batched prompts = the dense model's greedy tokens (48 tokens).

    Measured once: the smallest dense top-2 gap on these prompts is 0.006, yet the int8 model keeps every
    token; a mismatch here means the int8 path changed, not a tie.
    """
    engine = Engine(_int8(fixture), num_blocks=32, block_size=16, providers=CPU)
    rng = np.random.default_rng(7)
    prompts = [[int(t) for t in rng.integers(0, 256, n)] for n in (5, 19, 33)]
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=8))
    dense = DenseModel(FIXTURES / f"{fixture}.onnx")
    for prompt, got in zip(prompts, outputs, strict=True):
        state, ids, want = dense.new(), prompt, []
        for _ in range(8):
            ids = [int(dense.step(state, ids).argmax())]
            want += ids
        assert got == want


def test_float8_rejected_with_reason() -> None:
    with pytest.raises(ConversionError, match=r"float8e4m3fn.*not supported.*no float8 form.*int8"):
        convert(str(FIXTURES / f"{GQA}.onnx"), kv_cache_dtype="float8e4m3fn")


def test_bad_calibration_requests_rejected() -> None:
    with pytest.raises(ConversionError, match=r"token ids must be in \[0, 256\), found 256"):
        convert(str(FIXTURES / f"{GQA}.onnx"), kv_cache_dtype="int8", calibration_prompts=[[1, 256]])
    with pytest.raises(ConversionError, match="only apply to a quantized cache"):
        convert(str(FIXTURES / f"{GQA}.onnx"), calibration_prompts=[[1, 2]])
    with pytest.raises(ConversionError, match="kv_scale: expected one of"):
        convert(str(FIXTURES / f"{GQA}.onnx"), kv_cache_dtype="int8", kv_scale="per-group")  # type: ignore[arg-type]


def test_cli_convert_int8(tmp_path) -> None:
    dense = str(FIXTURES / f"{MLA}.onnx")

    def cli(out: str, *extra: str) -> int:
        return main(["convert", dense, str(tmp_path / out), "--quiet", "--kv-cache-dtype", *extra])

    assert cli("c.onnx", "int8") == 0
    assert cli("t.onnx", "int8", "--kv-scale", "per-tensor") == 0
    for out, shape in (("c.onnx", (1, 1, 80)), ("t.onnx", (1,))):
        model = onnx.load(str(tmp_path / out))
        cache = {v.name: v for v in model.graph.input}["past_key_values.0.key"]
        assert cache.type.tensor_type.elem_type == onnx.TensorProto.INT8
        assert _inits(model)["kv_quant.layers.0.k_scale"].shape == shape
    assert cli("f8.onnx", "float8e4m3fn") != 0
    assert not (tmp_path / "f8.onnx").exists()
