"""Sliding-window layers through transformers 5's ``OnnxExporter`` (``onnxexporter_mistral``, window 8, made by
``scripts/make_fixtures_formats.py onnx_exporter``): each layer's cache round-trips a scalar graph input
``input.cache.layers.N._sliding_window_tensor`` through an ``Identity`` to its output, unread (the mask takes
the window from constants). The dense runner did not feed it, so every verified conversion of Mistral, Qwen2,
Gemma-2 and Gemma-3 from this tool failed (the sweep's onnx_exporter seed 0 of each)."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from support.parity import paged_nodes, run_parity

from ortpa.conversion import convert_file
from ortpa.errors import InvalidModel
from ortpa.formats import dense_interface

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "formats" / "onnxexporter_mistral.onnx"
WINDOW = 8  # the fixture's config (sliding_window)
SCALARS = [f"input.cache.layers.{i}._sliding_window_tensor" for i in range(2)]


def test_the_unread_window_scalars_are_fed():
    model = onnx.load(str(FIXTURE), load_external_data=False)
    io = dense_interface(model)
    assert list(io.pass_throughs) == SCALARS
    feed = io.feed([5, 6], 0, io.empty_past())
    assert all(feed[name].shape == () for name in SCALARS)


def test_a_window_scalar_the_graph_computes_with_is_refused_by_name():
    model = onnx.load(str(FIXTURE), load_external_data=False)
    model.graph.node.append(onnx.helper.make_node("Add", [SCALARS[1], SCALARS[1]], ["twice"], name="reads_the_window"))
    with pytest.raises(InvalidModel, match="reads_the_window") as err:
        dense_interface(model)
    assert SCALARS[1] in str(err.value)


def test_sliding_onnx_exporter_converts_verified_with_the_graphs_window(tmp_path):
    out = tmp_path / "paged.onnx"
    verification = convert_file(FIXTURE, out).verification  # verification on (the default)
    assert verification is not None and verification.ok
    paged = onnx.load(str(out))
    windows = [{a.name: a.i for a in n.attribute}.get("local_window_size") for n in paged_nodes(paged)]
    assert windows == [WINDOW, WINDOW]
    assert not [i.name for i in paged.graph.input if "sliding_window" in i.name]
    assert not [o.name for o in paged.graph.output if "sliding_window" in o.name]
    # prompt B (11 tokens) and every sequence's decode run past the window: batched = alone, the dense tokens
    result = run_parity(paged, FIXTURE, steps=6)
    assert result.tokens_checked > 0
