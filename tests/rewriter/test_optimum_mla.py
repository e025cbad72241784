"""DeepSeek-V3 through optimum (``optimum_deepseek_v3``, made by ``scripts/make_fixtures_formats.py optimum``):
transformers 4.57 caches the *expanded* per-head keys ``Concat(k_nope, Expand(rope(k_pe)))`` and values, not the
latent, and its MoE (layers 1 and 2) is the eager per-expert loop as traced: ``one_hot`` of the top-k experts, per
expert ``NonZero`` of its mask, ``x[token]``, the expert, and ``index_add`` (``ScatterElements``) back onto the
tokens.

The caches are traced back to kv_b_proj's input (the normalised latent) and the one roped k_pe head, and absorbed
into PagedAttention LATENT like transformers 5's latent cache: the paged cache holds ``[latent | k_pe]`` (48 wide
here, not 4 heads x 32 keys + 16 values); main refused every layer ("expected one latent head (MLA)"). The
per-sequence flow proves the NonZero dispatch: each selected row is read from, and added back onto, its own token
(its leaks: tests/rewriter/test_per_sequence_selection.py).
"""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from support.parity import paged_nodes, run_parity

from ortpa.conversion import convert_file
from ortpa.errors import ConversionError
from ortpa.rewriter.pipeline import convert

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "formats" / "optimum_deepseek_v3.onnx"


def test_expanded_cache_mla_converts_to_latent_verified_batched_equals_alone(tmp_path):
    out = tmp_path / "paged.onnx"
    verification = convert_file(FIXTURE, out).verification  # verification on (the default)
    assert verification is not None and verification.ok
    paged = onnx.load(str(out))
    nodes = paged_nodes(paged)
    layouts = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}["kv_cache_layout"] for n in nodes]
    assert layouts == [b"LATENT"] * 3
    caches = [i for i in paged.graph.input if i.name.startswith("past_key_values.")]
    # one cache per layer, one head of kv_lora_rank 32 + qk_rope 16: no value cache, no per-head keys
    assert [i.name for i in caches] == [f"past_key_values.{i}.key" for i in range(3)]
    assert {tuple(d.dim_value for d in i.type.tensor_type.shape.dim[2:]) for i in caches} == {(1, 48)}
    assert "ScatterElements" in {n.op_type for n in paged.graph.node}  # the index_add is kept, proven per token
    result = run_parity(paged, FIXTURE, steps=6)  # continuous batching against each sequence run alone
    assert result.tokens_checked > 0


def test_a_cached_value_not_kv_b_projs_v_is_refused_by_layer():
    """The latent cache can only stand for values kv_b_proj computes from it: layer 1's cached value scaled by 2
    (a cache the absorbed form cannot express) is refused, naming the layer and why."""
    model = onnx.load(str(FIXTURE))
    graph = model.graph
    at, concat = next(
        (i, n) for i, n in enumerate(graph.node) if n.op_type == "Concat" and n.input[0] == "past_key_values.1.value"
    )
    graph.initializer.append(onnx.helper.make_tensor("near_miss.two", onnx.TensorProto.FLOAT, [], [2.0]))
    graph.node.insert(at, onnx.helper.make_node("Mul", [concat.input[1], "near_miss.two"], ["near_miss.v"]))
    concat.input[1] = "near_miss.v"
    with pytest.raises(ConversionError) as info:
        convert(model, providers=())
    (where, why), *rest = info.value.failures
    assert not rest and where.startswith("layer 1") and "is not the v of a Split" in why, info.value.failures
