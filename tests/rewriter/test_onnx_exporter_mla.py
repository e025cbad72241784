"""Dense MLA through transformers 5's ``OnnxExporter`` (``onnxexporter_minicpm3``, made by
``scripts/make_fixtures_formats.py onnx_exporter``): its caches are named ``keys`` (the normalised latent) and
``values`` (the roped key part), and each attention's output passes a ``Where`` that zeroes fully masked rows.

The caches are told apart by what reads them: the latent reaches one Softmax both through the scores and as
what its probabilities multiply, so it is the layer's key cache (one latent head) whatever its name says; a
role read from the first use found made it the value cache and refused every layer (the sweep's onnx_exporter
deepseek_v3 seed 0)."""

from __future__ import annotations

from pathlib import Path

import onnx
import onnx_ir as ir
from support.parity import paged_nodes, run_parity

from ortpa.conversion import convert_file
from ortpa.rewriter.recognisers.caches import canonicalise_cache_io

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "formats" / "onnxexporter_minicpm3.onnx"


def test_the_latent_is_the_key_cache_whatever_its_name():
    graph = ir.load(FIXTURE).graph
    widths = {v.name: int(str(v.shape[3])) for v in graph.inputs if v.name.startswith("input.cache.")}
    canonicalise_cache_io(graph)
    renamed = {v.name: int(str(v.shape[3])) for v in graph.inputs if v.name.startswith("past_key_values.")}
    assert widths["input.cache.layers.0.keys"] == 32 and widths["input.cache.layers.0.values"] == 16
    assert renamed == {"past_key_values.0.key": 32, "past_key_values.0.value": 16,
                       "past_key_values.1.key": 32, "past_key_values.1.value": 16}  # fmt: skip


def test_onnx_exporter_mla_converts_verified_with_parity(tmp_path):
    out = tmp_path / "paged.onnx"
    verification = convert_file(FIXTURE, out).verification  # verification on (the default)
    assert verification is not None and verification.ok
    paged = onnx.load(str(out))
    layouts = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}["kv_cache_layout"] for n in
               paged_nodes(paged)]  # fmt: skip
    assert layouts == [b"LATENT", b"LATENT"]
    result = run_parity(paged, FIXTURE, steps=6)
    assert result.tokens_checked > 0


MOE = FIXTURE.with_name("onnxexporter_deepseek_v3.onnx")


def test_onnx_exporter_moe_counts_rows_per_expert_and_converts_verified(tmp_path):
    """DeepSeek-V3 (MoE in layers 1 and 2) through the OnnxExporter: its dispatch counts rows per expert by a
    ``ScatterElements`` add of ones at the sorted rows' expert ids (``histc``). Counted over every row, the counts
    are segment bounds like any other; the flow refused the scatter as regrouped rows (the sweep's onnx_exporter
    deepseek_v2 / deepseek_v3 seed 0). Verified, and batched = alone by the parity run."""
    out = tmp_path / "paged.onnx"
    verification = convert_file(MOE, out).verification
    assert verification is not None and verification.ok
    paged = onnx.load(str(out))
    assert len(paged_nodes(paged)) == 3
    assert "ScatterElements" in {n.op_type for n in paged.graph.node}  # the dispatch is kept, proven per token
    result = run_parity(paged, MOE, steps=6)
    assert result.tokens_checked > 0
