"""onnxruntime-genai LongRoPE (Phi-3.x 128k / Phi-4-mini style) converts, and batched = alone.

The builder gives every GroupQueryAttention the outputs of ``If(Greater(total_sequence_length, 32), long, short)``:
one cos/sin table per step for the whole batch. Converted (``rewriter.per_sequence.rope_choice``), each token is rotated
with the table its own sequence's total length picks, before PagedAttention. Prompts of 5 (short throughout),
45 (long from the prefill) and 28 tokens (crossing 32 at its 5th decode step, its cached keys keeping the short
rotation as in the original) are decoded batched and compared with each run alone by ONNX Runtime on the
original file (fp32, fp16 and int4 builds; the converted model's attention runs in float16).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from ortpa.errors import ConversionError
from ortpa.parity.greedy import dense_greedy, open_dense, paged_greedy
from ortpa.parity.rule import judge_precision, kl_divergence
from ortpa.rewriter.per_sequence import rope_choice
from ortpa.rewriter.pipeline import convert
from ortpa.runtime.session import PagedSession
from ortpa.tolerances import precision_kl_bound

FORMATS = Path(__file__).resolve().parents[1] / "fixtures" / "formats"
THRESHOLD = 32  # the fixtures' original_max_position_embeddings
NEW_TOKENS = 8
LENGTHS = (5, 45, 28)
# fp32 / int4: GroupQueryAttention with in-op RoPE (RoPE moves into the graph); fp16: RotaryEmbedding nodes in the
# graph, whose tables become one row per packed token (ortpa.rewriter.per_sequence.rope_choice)
NAMES = ("genai_phi3_longrope_fp32", "genai_phi3_longrope_fp16", "genai_phi3_longrope_int4")


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [[int(t) for t in rng.integers(3, 250, n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def alone():
    """Each prompt alone on each original (ONNX Runtime CPU), computed once."""
    runs = {}
    for name in NAMES:
        dense = open_dense(FORMATS / f"{name}.onnx", threads=2)
        runs[name] = dense_greedy(dense.session, _prompts(), NEW_TOKENS, interface=dense.interface)
    return runs


def _batched(converted: onnx.ModelProto, follow):
    session = PagedSession(converted, num_blocks=16, block_size=16, providers=["CPUExecutionProvider"])
    return paged_greedy(session, _prompts(), NEW_TOKENS, follow=follow)


@pytest.mark.parametrize("name", NAMES)
def test_genai_longrope_batched_equals_alone(name, alone):
    prompts = _prompts()
    assert [len(p) + NEW_TOKENS > THRESHOLD for p in prompts] == [False, True, True]
    assert len(prompts[2]) < THRESHOLD  # the third crosses the threshold while decoding
    converted = convert(FORMATS / f"{name}.onnx")
    ops = {n.op_type for n in converted.graph.node}
    assert "If" not in ops and "GroupQueryAttention" not in ops
    attention = [n for n in converted.graph.node if n.op_type == "PagedAttention"]
    assert len(attention) == json.loads((FORMATS / f"{name}.json").read_text())["num_layers"]
    assert all(a.i == 0 for n in attention for a in n.attribute if a.name == "do_rotary")
    ref = alone[name]
    # the precision rule: int8 where the original quantizes activations (its int4 build), else float16
    result = judge_precision(ref, _batched(converted, ref.tokens), "int8" if "int4" in name else "float16")
    assert result.ok and result.tokens_agree == result.tokens_checked, result


def test_genai_longrope_needs_the_per_sequence_choice(alone, monkeypatch):
    """Every token rotated with the long table (what one table for the whole batch gives the short prompt):
    prompt 0 differs far outside the tolerance, so the test above can fail."""
    real = rope_choice.chosen_rotary

    def always_long(*args):
        found = real(*args)
        return dataclasses.replace(found, threshold=-1) if isinstance(found, rope_choice.ChosenRotary) else found

    monkeypatch.setattr("ortpa.rewriter.recognisers.gqa.chosen_rotary", always_long)
    converted = convert(FORMATS / "genai_phi3_longrope_fp32.onnx")
    ref = alone["genai_phi3_longrope_fp32"]
    batched = _batched(converted, ref.tokens)
    bound = precision_kl_bound("float16")
    kls = [
        max(kl_divergence(r, g) for r, g in zip(rs, gs, strict=True))
        for rs, gs in zip(ref.logits, batched.logits, strict=True)
    ]
    assert kls[0] > 10 * bound and kls[1] < bound, kls


def test_genai_longrope_on_another_length_is_refused():
    """The choice read from the number of new tokens (not the op's total length) is not each sequence's own
    total length: refused, naming the layer and why."""
    model = onnx.load(str(FORMATS / "genai_phi3_longrope_fp32.onnx"))
    greater = next(n for n in model.graph.node if n.op_type == "Greater")
    at = list(model.graph.node).index(greater)
    for node in reversed(
        [
            onnx.helper.make_node("Shape", ["input_ids"], ["near_miss/shape"]),
            onnx.helper.make_node(
                "Gather", ["near_miss/shape", "/model/constants/INT64/1"], ["near_miss/new_tokens"], axis=0
            ),
        ]
    ):
        model.graph.node.insert(at, node)
    greater.input[0] = "near_miss/new_tokens"
    with pytest.raises(ConversionError) as info:
        convert(model, providers=())
    where, why = info.value.failures[0]
    assert where.startswith("layer 0") and "total_sequence_length" in why, info.value.failures
