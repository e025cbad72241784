"""Attention forms one exporter writes (transformers 5.x OnnxExporter; scripts/make_fixtures_forms.py).

* GPT-NeoX: one fused QKV projection viewed per head ``[B, S, H, 3*D]`` and split along the last axis (each head's
  q, k, v adjacent), partial rotary;
* Falcon multi-query: one K/V head that the attention reads broadcast over the query heads (no repeat_kv), which
  the recogniser used to refuse as "attention value has 1 heads, query has 4".

Each converts and passes ``convert_file``'s verification against the original (batched against alone, a prompt
past one cache block), with the head counts the config states.
"""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
from support.parity import attrs, paged_nodes

import ortpa

FORMS = Path(__file__).parents[1] / "fixtures" / "forms"


@pytest.mark.parametrize("name", ["onnxexporter_neox", "onnxexporter_falcon_mqa"])
def test_form_converts_verified(name, tmp_path):
    config = json.loads((FORMS / f"{name}.json").read_text())["config"]
    heads = config["num_attention_heads"]
    kv_heads = 1 if config.get("multi_query") else heads
    out = tmp_path / "paged.onnx"
    verified = [ortpa.convert_file(FORMS / f"{name}.onnx", out).verification]
    precision = verified[0].verdict.precision
    assert verified[0].ok and verified[0].verdict.structure.twin and precision.tokens_agree == precision.tokens_checked
    nodes = paged_nodes(onnx.load(str(out)))
    assert len(nodes) == config["num_hidden_layers"]
    for node in nodes:
        a = attrs(node)
        assert (a["num_heads"], a["kv_num_heads"]) == (heads, kv_heads)
