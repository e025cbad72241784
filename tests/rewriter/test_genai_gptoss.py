"""onnxruntime-genai gpt-oss (attention sinks, alternating sliding windows, ``com.microsoft::MoE``) converts.

Fixture ``genai_gptoss_fp32`` (``scripts/make_fixtures_formats.py genai``): the 0.18 builder's gpt-oss from a tiny
random-weight config. Every GroupQueryAttention reads ``model.layers.{i}.attn.sinks`` as its ``head_sink``; layer 0
has ``local_window_size=8``; each MLP is one MoE node. The sinks become PagedAttention's ``head_sink`` input, the
window carries over, MoE stays as it is (per token). Prompts of 5, 20 and 9 tokens (one under the window, crossing
it while decoding) batched give each prompt its alone next-token distributions within the float16 precision rule
(ortpa.parity.rule), and its tokens. ``smooth_softmax=1`` is the same softmax with zero sinks (checked against ONNX
Runtime's GQA on the Llama build). The int4 build cannot be made from a float checkpoint: the 0.18 builder's
gpt-oss int4 path reads the original MXFP4 expert blocks (``...experts.gate_up_proj_blocks``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from ortpa.errors import ConversionError
from ortpa.parity.greedy import dense_greedy, open_dense, paged_greedy
from ortpa.parity.rule import judge_precision
from ortpa.rewriter.pipeline import convert
from ortpa.rewriter.recognisers import gqa
from ortpa.runtime.session import PagedSession

FORMATS = Path(__file__).resolve().parents[1] / "fixtures" / "formats"
GPTOSS = FORMATS / "genai_gptoss_fp32.onnx"
NEW_TOKENS = 8
LENGTHS = (5, 20, 9)  # the window is 8: under it, past it from the prefill, crossing it in decode


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [[int(t) for t in rng.integers(3, 250, n)] for n in LENGTHS]


def _alone(path: Path):
    dense = open_dense(path, threads=2)
    return dense_greedy(dense.session, _prompts(), NEW_TOKENS, interface=dense.interface)


@pytest.fixture(scope="module")
def gptoss_alone():
    return _alone(GPTOSS)


def _parity(converted: onnx.ModelProto, ref):
    """The precision rule of the one verification rule (ortpa.parity.rule) on the batched converted model."""
    session = PagedSession(converted, num_blocks=16, block_size=16, providers=["CPUExecutionProvider"])
    batched = paged_greedy(session, _prompts(), NEW_TOKENS, follow=ref.tokens)
    return judge_precision(ref, batched, "float16")


def _op_constant(model: onnx.ModelProto, name: str) -> np.ndarray:
    """The value of an op input stored in the source's precision and cast to T in the graph (op_constant)."""
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    if name in inits:
        return inits[name]
    cast = next(n for n in model.graph.node if name in n.output)
    assert cast.op_type == "Cast", cast
    return inits[cast.input[0]]


def test_gptoss_converts_with_sinks_windows_and_moe(gptoss_alone):
    original = onnx.load(str(GPTOSS))
    sinks = {i.name: numpy_helper.to_array(i) for i in original.graph.initializer if i.name.endswith("attn.sinks")}
    assert len(sinks) == 2
    converted = convert(GPTOSS)
    attention = [n for n in converted.graph.node if n.op_type == "PagedAttention"]
    assert len(attention) == 2
    for layer, node in enumerate(attention):
        carried = _op_constant(converted, node.input[11])
        np.testing.assert_array_equal(carried, sinks[f"model.layers.{layer}.attn.sinks"])  # exact, cast to T
    windows = [next((a.i for a in n.attribute if a.name == "local_window_size"), -1) for n in attention]
    assert windows == [8, -1]
    assert sum(n.op_type == "MoE" for n in converted.graph.node) == 2
    result = _parity(converted, gptoss_alone)
    assert result.ok and result.tokens_agree == result.tokens_checked, result


def test_gptoss_needs_the_sinks(gptoss_alone, monkeypatch):
    """Dropping the sinks moves the logits by ~1 and flips tokens: the test above can fail."""
    monkeypatch.setattr(gqa, "_head_sink", lambda node, sink, heads: None)
    result = _parity(convert(GPTOSS), gptoss_alone)
    assert not result.ok and result.kl_max > 10 * result.kl_bound, result


def test_smooth_softmax_is_zero_sinks(tmp_path):
    """GQA's smooth_softmax=1 (no head_sink input) converts to a zero head_sink and matches ONNX Runtime alone."""
    model = onnx.load(str(FORMATS / "genai_llama_fp32.onnx"))
    for node in model.graph.node:
        if node.op_type == "GroupQueryAttention":
            node.attribute.append(onnx.helper.make_attribute("smooth_softmax", 1))
    path = tmp_path / "smooth.onnx"
    onnx.save(model, str(path))
    converted = convert(path)
    attention = [n for n in converted.graph.node if n.op_type == "PagedAttention"]
    sinks = [_op_constant(converted, n.input[11]) for n in attention]
    assert all(not s.any() and s.shape == (4,) for s in sinks)
    result = _parity(converted, _alone(path))
    assert result.ok and result.tokens_agree == result.tokens_checked, result


def _sink_refused(edit, reason: str) -> None:
    model = onnx.load(str(GPTOSS))
    edit(model)
    with pytest.raises(ConversionError) as info:
        convert(model, providers=())
    assert any(where.startswith("layer 1") and reason in why for where, why in info.value.failures), info.value


def test_sinks_of_another_shape_are_refused():
    def edit(model):
        sink = next(i for i in model.graph.initializer if i.name == "model.layers.1.attn.sinks")
        sink.CopyFrom(numpy_helper.from_array(np.zeros(2, np.float32), sink.name))

    _sink_refused(edit, "head_sink has shape (2,), expected (4,)")


def test_sinks_computed_at_run_time_are_refused():
    def edit(model):
        gqa_node = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"][1]
        # sinks scaled by the mask's sum: a value per batch, not a constant of the model
        model.graph.node.insert(
            list(model.graph.node).index(gqa_node),
            onnx.helper.make_node(
                "Mul",
                [gqa_node.input[11], "/model/attn_mask_reformat/attn_mask_subgraph/ReduceSum/output_0"],
                ["near_miss/sinks"],
            ),
        )
        gqa_node.input[11] = "near_miss/sinks"

    _sink_refused(edit, "computed at run time")
