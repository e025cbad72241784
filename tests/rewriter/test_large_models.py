"""Models past protobuf's 2 GB: built straight to disk, converted, validated and run without one big proto.

A DeepSeek-V2-Lite-dimension dense model (hidden 2048, 16 heads, kv_lora 512, intermediate 10944, vocab 32000;
~0.33 GB per layer + 0.52 GB of embeddings) is written with external data into a temp folder (deleted after),
converted with ``ortpa convert``, validated, and greedy-decoded for 2 prompts on the dense original (plain ONNX
Runtime from its path) and on the converted model (PagedSession, portable CPU path): same tokens. Just below
2 GB (4 layers, 1.8 GB, behind ``slow``) and above it (6 layers, 2.5 GB, in CI: ~30 s of CPU and 5 GB of temp
disk; the weights are drawn uniform in float32: making them was most of the test's time with normal draws).
"""

from __future__ import annotations

import os
import shutil

import onnx
import onnxruntime as ort
import pytest
from support.flow_spy import record_sink_kinds

from ortpa.cli import main
from ortpa.ops.validate import validate_model
from ortpa.parity.greedy import dense_greedy, paged_greedy
from ortpa.runtime.session import PagedSession
from ortpa.testing.dense_mla import DenseMlaConfig
from ortpa.testing.dense_mla_file import write_dense_mla

V2_LITE = dict(hidden=2048, heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope=128, qk_rope=64, v_head=128,
               vocab=32000, intermediate=10944)  # fmt: skip
PROMPTS = [[11, 402, 9, 3310, 77, 5], [1201, 6]]
NEW_TOKENS = 3


@pytest.mark.parametrize(
    "layers",
    [pytest.param(4, id="below-2GB", marks=pytest.mark.slow), pytest.param(6, id="above-2GB")],
)
def test_large_model_converts_validates_and_generates_the_dense_tokens(tmp_path, layers, monkeypatch):
    sinks = record_sink_kinds(monkeypatch)  # the per-sequence flow's kinds at the logits and the PagedAttention inputs
    folder = tmp_path / f"v2lite{layers}"
    try:
        dense = write_dense_mla(
            DenseMlaConfig(layers=layers, **V2_LITE), folder / "dense" / "model.onnx", draw="uniform"
        )
        size = sum(p.stat().st_size for p in dense.parent.iterdir())
        assert (size > 2**31) == (layers == 6)
        assert dense.stat().st_size < 2**20  # the graph alone: the builder never made a proto with the weights
        out = folder / "paged" / "paged.onnx"
        # --no-verify: this test runs the same comparison itself, below (verification twice cost ~75 s here)
        assert main(["convert", str(dense), str(out), "--quiet", "--no-verify"]) == 0
        assert sorted(os.listdir(out.parent)) == ["genai_config.json", "paged.onnx", "paged.onnx.data"]
        assert sinks and sinks[-1] == {"token", "const"}, sinks  # followed per token to every sink, nothing lost
        report = validate_model(out, backend="cuda")
        assert report.ok and len(report.nodes) == layers
        header = onnx.load(str(out), load_external_data=False)
        assert header.ByteSize() < 2**20

        # no prepacking: the weights stay memory-mapped instead of copied per MatMul (GBs of resident memory
        # beside another test worker; about the same time for 2 x 3 tokens)
        so = ort.SessionOptions()
        so.add_session_config_entry("session.disable_prepacking", "1")
        dense_sess = ort.InferenceSession(str(dense), so, providers=["CPUExecutionProvider"])
        want = dense_greedy(dense_sess, PROMPTS, NEW_TOKENS).tokens
        del dense_sess
        paged = PagedSession(out, num_blocks=8, block_size=16, providers=["CPUExecutionProvider"], sess_options=so)
        got = paged_greedy(paged, PROMPTS, NEW_TOKENS).tokens
        assert got == want
    finally:
        shutil.rmtree(folder, ignore_errors=True)
