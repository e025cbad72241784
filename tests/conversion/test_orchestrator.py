"""The one conversion path (ortpa.conversion): options, staging and its one move, typed progress."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import onnx
import pytest

import ortpa
from ortpa.conversion import ConvertOptions, convert_file
from ortpa.errors import ConversionError
from ortpa.progress import BytesWritten, LayerStarted, Stage, StageStarted
from ortpa.rewriter.options import RewriteOptions

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
DSV3 = FIXTURES / "dsv3_sdpa_op18.onnx"  # 2 MLA layers
LLAMA = FIXTURES / "llama_sdpa_op18.onnx"


def test_options_as_keywords_or_one_dataclass():
    flat = ConvertOptions.of(dtype="float16", portable=True, providers=["cpu"], verify=False)
    assert flat == ConvertOptions(
        rewrite=RewriteOptions(dtype="float16"), portable=True, providers=("cpu",), verify=False
    )
    with pytest.raises(TypeError, match="unexpected conversion options \\['dtpye'\\]"):
        ConvertOptions.of(dtpye="float16")
    with pytest.raises(ConversionError, match="logits: expected one of"):
        ConvertOptions.of(logits="first")
    with pytest.raises(TypeError, match="not both"):
        convert_file(DSV3, "x.onnx", ConvertOptions(), dtype="float16")


def test_options_that_cannot_go_together_are_refused_before_any_work(tmp_path):
    out = tmp_path / "out" / "model.onnx"
    with pytest.raises(ConversionError, match="float8e4m3fn"):
        convert_file(DSV3, out, portable=True, kv_cache_dtype="float8e4m3fn")
    assert list(tmp_path.iterdir()) == []


def test_progress_is_typed_and_in_stage_order(tmp_path):
    events: list = []
    convert_file(LLAMA, tmp_path / "out" / "model.onnx", progress=events.append)
    layers = [e for e in events if isinstance(e, LayerStarted)]
    assert [(e.index, e.total) for e in layers] == [(0, 2), (1, 2)]
    stages = [e.stage for e in events if isinstance(e, StageStarted)]
    order = [Stage.LOAD, Stage.OPTIMISE, Stage.MATCH, Stage.WRITE, Stage.CHECK, Stage.VERIFY, Stage.DEPLOY, Stage.DONE]
    ranks = [order.index(s) for s in stages if s in order]
    assert ranks == sorted(ranks) and set(order) <= set(stages), stages  # each stage, once the one before is done
    assert stages[-1] is Stage.DONE
    assert all(isinstance(e, (StageStarted, LayerStarted, BytesWritten)) for e in events)


def test_a_new_folder_is_published_whole_with_plain_modes(tmp_path):
    old = os.umask(0o022)
    try:
        result = convert_file(DSV3, tmp_path / "deploy" / "model.onnx", verify=False)
    finally:
        os.umask(old)
    folder = tmp_path / "deploy"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["deploy"]  # no staging or scratch folder left
    assert sorted(p.name for p in folder.iterdir()) == ["genai_config.json", "model.onnx"]
    assert stat.S_IMODE(folder.stat().st_mode) == 0o755  # not mkdtemp's 0700
    assert result.model == folder / "model.onnx" and result.genai_config == folder / "genai_config.json"
    assert result.paged_attention_nodes == 2 and result.verification is None


def test_a_shared_folder_keeps_its_files_and_gets_the_model_last(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    convert_file(DSV3, tmp_path / "model.onnx", verify=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["genai_config.json", "model.onnx", "notes.txt"]
    # converted again over itself: replaced, still nothing left over
    convert_file(DSV3, tmp_path / "model.onnx", verify=False, portable=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["genai_config.json", "model.onnx", "notes.txt"]
    proto = onnx.load(str(tmp_path / "model.onnx"), load_external_data=False)
    assert "ortpa.portable" in {p.key for p in proto.metadata_props}


def test_verification_figures_and_the_lowering_are_in_the_published_graph(tmp_path):
    out = tmp_path / "out" / "model.onnx"
    result = convert_file(LLAMA, out, portable=True)
    meta = {p.key: p.value for p in onnx.load(str(out), load_external_data=False).metadata_props}
    assert meta["ortpa.verified"] == "1" and "ortpa.portable" in meta
    assert result.portable is not None and result.portable.nodes == result.paged_attention_nodes == 2


def test_convert_is_in_memory_and_convert_file_is_the_deployment(tmp_path):
    proto = ortpa.convert(str(LLAMA), providers=())
    assert sum(n.op_type == "PagedAttention" for n in proto.graph.node) == 2
    with pytest.raises(TypeError, match=r"ortpa\.convert_file"):
        ortpa.convert(str(LLAMA), out_path=tmp_path / "m.onnx")
    assert list(tmp_path.iterdir()) == []
