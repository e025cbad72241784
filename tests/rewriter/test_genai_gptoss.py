"""onnxruntime-genai gpt-oss (attention sinks, alternating sliding windows, ``com.microsoft::MoE``) converts.

Fixture ``genai_gptoss_fp32`` (``scripts/make_fixtures_formats.py genai``): the 0.18 builder's gpt-oss from a tiny
random-weight config. Every GroupQueryAttention reads ``model.layers.{i}.attn.sinks`` as its ``head_sink``; layer 0
has ``local_window_size=8``; each MLP is one MoE node. The sinks become PagedAttention's ``head_sink`` input, the
window carries over, MoE stays as it is (per token). Prompts of 5, 20 and 9 tokens (one under the window, crossing
it while decoding) batched give each prompt its alone logits within the float16 tolerance plus the family's
measured term, and its tokens. ``smooth_softmax=1`` is the same softmax with zero sinks (checked against ONNX
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
from ortpa.parity.check import compare_runs
from ortpa.parity.greedy import dense_greedy, open_dense, paged_greedy
from ortpa.rewriter.pipeline import convert
from ortpa.rewriter.recognisers import gqa
from ortpa.runtime.session import PagedSession
from ortpa.tolerances import logit_tolerance

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


def _parity(converted: onnx.ModelProto, ref, family: str | None):
    session = PagedSession(converted, num_blocks=16, block_size=16, providers=["CPUExecutionProvider"])
    batched = paged_greedy(session, _prompts(), NEW_TOKENS, follow=ref.tokens)
    rtol, atol = logit_tolerance("float16", family)
    return compare_runs(ref, batched, rtol=rtol, atol=atol)


def test_gptoss_converts_with_sinks_windows_and_moe(gptoss_alone):
    original = onnx.load(str(GPTOSS))
    sinks = {i.name: numpy_helper.to_array(i) for i in original.graph.initializer if i.name.endswith("attn.sinks")}
    assert len(sinks) == 2
    converted = convert(GPTOSS)
    inits = {i.name: numpy_helper.to_array(i) for i in converted.graph.initializer}
    attention = [n for n in converted.graph.node if n.op_type == "PagedAttention"]
    assert len(attention) == 2
    for layer, node in enumerate(attention):
        carried = inits[node.input[11]]
        expected = sinks[f"model.layers.{layer}.attn.sinks"]
        np.testing.assert_array_equal(carried, expected.astype(np.float16))
    windows = [next((a.i for a in n.attribute if a.name == "local_window_size"), -1) for n in attention]
    assert windows == [8, -1]
    assert sum(n.op_type == "MoE" for n in converted.graph.node) == 2
    result = _parity(converted, gptoss_alone, "gptoss-genai")
    assert result.ok and result.tokens_identical, result.format()


def test_gptoss_needs_the_sinks(gptoss_alone, monkeypatch):
    """Dropping the sinks moves the logits by ~1 and flips tokens: the test above can fail."""
    monkeypatch.setattr(gqa, "_head_sink", lambda node, sink, heads: None)
    result = _parity(convert(GPTOSS), gptoss_alone, "gptoss-genai")
    assert not result.ok and result.max_abs_logit_error > 0.1, result.format()


def test_smooth_softmax_is_zero_sinks(tmp_path):
    """GQA's smooth_softmax=1 (no head_sink input) converts to a zero head_sink and matches ONNX Runtime alone."""
    model = onnx.load(str(FORMATS / "genai_llama_fp32.onnx"))
    for node in model.graph.node:
        if node.op_type == "GroupQueryAttention":
            node.attribute.append(onnx.helper.make_attribute("smooth_softmax", 1))
    path = tmp_path / "smooth.onnx"
    onnx.save(model, str(path))
    converted = convert(path)
    inits = {i.name: numpy_helper.to_array(i) for i in converted.graph.initializer}
    attention = [n for n in converted.graph.node if n.op_type == "PagedAttention"]
    assert all(not inits[n.input[11]].any() and inits[n.input[11]].shape == (4,) for n in attention)
    result = _parity(converted, _alone(path), None)
    assert result.ok and result.tokens_identical, result.format()


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
