"""optimum's decoder families (``optimum-cli export onnx --task text-generation-with-past``, optimum-onnx 0.1.0:
``scripts/make_fixtures_formats.py optimum``) convert with verification on and run batched as the original alone.

Falcon fuses q, k and v in one projection viewed per head (``[B, S, H + 2, D]``, multi-query) and cuts the query
as ``[:, :, :-2]``: its heads come from the projection width and that slice, and the flow follows the graph's own
reshapes to targets read with ``Shape``. StableLM computes its softmax scale ``1 / sqrt(head_dim)`` from
``Shape(q)[-1:]`` at run time; once shape inference has given q's head dim, the scale folds to a constant. The
other families (GPT-NeoX, Phi, Gemma, Mistral with a sliding window, Qwen2) are the same tool's output.
"""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import onnx_ir as ir
import pytest
from support.parity import paged_nodes, run_parity

from ortpa.conversion import convert_file
from ortpa.errors import UnsupportedModel
from ortpa.rewriter.pipeline import convert
from ortpa.rewriter.recognisers.position_bias import positional_bias

FORMATS = Path(__file__).resolve().parents[1] / "fixtures" / "formats"

# fixture -> (query heads, kv heads, head size); ~5-20 s each: Falcon and StableLM (the forms issue 28 names) in
# the default run
FAMILIES = {
    "optimum_falcon": (4, 1, 16),
    "optimum_stablelm": (4, 2, 16),
    "optimum_stablelm_qknorm": (4, 2, 16),  # per-head q/k LayerNorm (StableLM-2 12B), left in the graph
    "optimum_gptneox": (4, 4, 16),
    "optimum_phi": (4, 4, 16),
    "optimum_gemma": (4, 2, 16),
    "optimum_mistral": (4, 2, 16),
    "optimum_qwen2": (4, 2, 16),
}
DEFAULT = {"optimum_falcon", "optimum_stablelm"}


# Refused by today's verification bound (float16 logits 7.5e-3 off against atol 5e-3 on Gemma's sqrt(hidden)-scaled
# activations; the bound is being replaced, issue 28 part 1): converted without it, then checked by tokens below.
def _cases():
    for name in FAMILIES:
        yield name if name in DEFAULT else pytest.param(name, marks=pytest.mark.slow)


@pytest.mark.parametrize("name", list(_cases()))
def test_optimum_family_converts_verified_with_parity(name, tmp_path):
    info = json.loads((FORMATS / f"{name}.json").read_text())
    assert info["tool"] == "optimum", info["tool"]
    out = tmp_path / "paged.onnx"
    verification = convert_file(FORMATS / f"{name}.onnx", out).verification  # verification on (the default)
    assert verification is not None and verification.ok
    paged = onnx.load(str(out))
    nodes = paged_nodes(paged)
    heads, kv_heads, _head = FAMILIES[name]
    assert len(nodes) == info["config"]["num_hidden_layers"]
    for node in nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert (attrs["num_heads"], attrs["kv_num_heads"]) == (heads, kv_heads), attrs
        window = info["config"].get("sliding_window")  # Mistral's, from optimum's mask arithmetic
        assert attrs.get("local_window_size", -1) == (window if window else -1), attrs
    assert {n.op_type for n in paged.graph.node}.isdisjoint({"Softmax"})
    result = run_parity(paged, FORMATS / f"{name}.onnx", steps=8)
    assert result.tokens_checked == 24 and result.max_context >= 18


def test_stablelm_scale_is_folded_from_the_recovered_head_dim():
    """The source computes 1/sqrt(head_dim) from Shape(q)[-1:] (a Sqrt of a Cast of a Shape); the converted node's
    scale is that value (the op's default 0 means 1/sqrt(head_size))."""
    source = onnx.load(str(FORMATS / "optimum_stablelm.onnx"), load_external_data=False)
    by_output = {o: n for n in source.graph.node for o in n.output}
    sqrt = [n for n in source.graph.node if n.op_type == "Sqrt" and "layers.0/self_attn" in n.name]
    chain = {by_output[x].op_type for n in sqrt for x in n.input if x in by_output}
    assert "Cast" in chain, chain  # computed at run time in the source
    paged = convert(FORMATS / "optimum_stablelm.onnx", providers=())
    head = FAMILIES["optimum_stablelm"][2]
    for node in paged_nodes(paged):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert abs((attrs.get("scale", 0.0) or head**-0.5) - head**-0.5) < 1e-7, attrs


def _windows(paged: onnx.ModelProto) -> list[int]:
    return [
        {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}.get("local_window_size", -1)
        for n in paged_nodes(paged)
    ]


def test_gemma2_windows_stay_on_their_layers():
    """Gemma-2 through optimum (transformers 4.57): layer 0 slides over 8 positions, layer 1 attends to everything.
    optimum cuts layer 1's full mask to the key's length, ``Shape(key)``, and the key descends from layer 0, whose
    mask holds the window comparison; a window read through that ``Shape`` put layer 0's window on layer 1 (a wrong
    model, which verification refused: the sweep's optimum gemma2 seed 0)."""
    window = json.loads((FORMATS / "optimum_gemma2.json").read_text())["config"]["sliding_window"]
    assert _windows(convert(FORMATS / "optimum_gemma2.onnx", providers=())) == [window, -1]


@pytest.mark.slow
def test_gemma2_converts_verified_with_parity_past_its_window(tmp_path):
    name = "optimum_gemma2"
    window = json.loads((FORMATS / f"{name}.json").read_text())["config"]["sliding_window"]
    out = tmp_path / "paged.onnx"
    verification = convert_file(FORMATS / f"{name}.onnx", out).verification
    assert verification is not None and verification.ok
    paged = onnx.load(str(out))
    assert _windows(paged) == [window, -1]
    result = run_parity(paged, FORMATS / f"{name}.onnx", steps=8)
    assert result.max_context > window


def test_falcon_alibi_is_refused_by_name(tmp_path):
    """falcon-rw's ALiBi adds ``slope_h * position`` to the scores (positions from the mask's CumSum, slopes one
    per head); PagedAttention takes no bias, so the layer is refused up front by name, not converted without it
    (verification would refuse that as a mismatch) and not mistaken for a leak."""
    out = tmp_path / "paged.onnx"
    with pytest.raises(UnsupportedModel, match="ALiBi") as refused:
        convert_file(FORMATS / "optimum_falcon_alibi.onnx", out)
    assert not refused.value.mixes_sequences and "layer 0" in str(refused.value)
    assert not out.exists()


def _mask_graph(slopes: list[float], positions: bool) -> list[ir.Value]:
    """A one-layer mask: ``slopes * positions`` (ALiBi; positions from CumSum(attention_mask)) or ``slopes`` times a
    comparison of positions (a causal mask scaled to its minimum): the value a layer adds to its scores."""
    h = onnx.helper
    mask = h.make_tensor_value_info("attention_mask", onnx.TensorProto.INT64, ["B", "T"])
    nodes = [h.make_node("Constant", [], ["axis"], value=h.make_tensor("a", onnx.TensorProto.INT64, [], [1]))]
    if positions:
        nodes.append(h.make_node("CumSum", ["attention_mask", "axis"], ["pos"]))
    else:
        nodes.append(h.make_node("Greater", ["attention_mask", "axis"], ["pos"]))
    nodes.append(h.make_node("Cast", ["pos"], ["posf"], to=onnx.TensorProto.FLOAT))
    slope = h.make_tensor("slopes", onnx.TensorProto.FLOAT, [len(slopes), 1], slopes)
    nodes.append(h.make_node("Mul", ["slopes", "posf"], ["bias"]))
    out = h.make_tensor_value_info("bias", onnx.TensorProto.FLOAT, None)
    model = h.make_model(h.make_graph(nodes, "m", [mask], [out], [slope]))
    return [ir.from_proto(model).graph.outputs[0]]


def test_positional_bias_is_slopes_times_positions_only():
    """Per-head slopes times positions is ALiBi, with one head too; the same constant times a comparison of
    positions (a mask scaled to its minimum) is not, nor are slopes of another head count."""
    assert positional_bias(_mask_graph([0.5, 0.25], positions=True), heads=2) is not None
    assert positional_bias(_mask_graph([0.5], positions=True), heads=1) is not None
    assert positional_bias(_mask_graph([-3.0e38], positions=False), heads=1) is None
    assert positional_bias(_mask_graph([0.5, 0.25], positions=True), heads=4) is None
