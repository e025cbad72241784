"""Live export (needs the `export` extra): a fresh tiny DeepSeek-V3 export converts and matches the dense model."""

from __future__ import annotations

import json

import pytest

from ortpa.rewriter.mla import MlaLayer, match_mla_layers


@pytest.mark.export
def test_export_tiny_deepseek_v3_converts(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import numpy as np
    import onnx_ir as ir
    import onnxruntime as ort
    import torch
    from tolerances import assert_close

    from ortpa.export import build_model, export_hf
    from ortpa.rewriter.pipeline import convert

    fixtures = json.loads(
        (__import__("pathlib").Path(__file__).parent / "fixtures" / "dsv3_sdpa_op18.json").read_text()
    )
    cfg = dict(fixtures["config"], num_hidden_layers=1)
    info = export_hf(cfg, tmp_path / "m.onnx", opset=18)
    assert info["output_names"] == ["logits", "present.0.key", "present.0.value"]
    # the export itself matches torch
    model = build_model(cfg)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        ref = model(input_ids=ids).logits.numpy()
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    out = sess.run(
        ["logits"],
        {
            "input_ids": ids.numpy(),
            "attention_mask": np.ones((1, 5), np.int64),
            "position_ids": np.arange(5)[None],
            "past_key_values.0.key": np.zeros((1, 1, 0, 64), np.float32),
            "past_key_values.0.value": np.zeros((1, 1, 0, 16), np.float32),
        },
    )[0]
    assert_close(out, ref, np.float32, what="ONNX export vs torch")
    model_ir = ir.load(str(tmp_path / "m.onnx"))
    assert all(isinstance(r, MlaLayer) for r in match_mla_layers(model_ir.graph))
    converted = convert(str(tmp_path / "m.onnx"))
    assert sum(n.op_type == "PagedAttention" for n in converted.graph.node) == 1
