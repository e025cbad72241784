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
