"""``lower_file`` / ``convert_file(portable=True)``: what the written file is, and what is refused (no genai here)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import onnx
import onnxruntime as ort
import pytest

import ortpa
from ortpa.cli import main
from ortpa.deploy import lower_file, portable_info
from ortpa.errors import ConversionError, RequestTooLong
from ortpa.runtime.engine import Engine
from ortpa.runtime.sampling import SamplingParams

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
LLAMA = FIXTURES / "formats" / "genai_llama_fp32.onnx"  # RoPE in the op: cos/sin tables of 256 rows
DSV3 = FIXTURES / "dsv3_sdpa_op18.onnx"


@pytest.fixture(scope="module")
def native_llama(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("native") / "model.onnx"
    ortpa.convert_file(LLAMA, out)
    return out


def test_lowered_file_runs_in_plain_onnxruntime_with_the_same_interface(native_llama, tmp_path):
    lowered = tmp_path / "model.onnx"
    shutil.copyfile(native_llama, lowered)
    os.chmod(lowered, 0o640)
    info = lower_file(lowered)
    assert os.stat(lowered).st_mode & 0o777 == 0o640  # the file's own mode survives the atomic replace
    native = onnx.load(str(native_llama), load_external_data=False)
    proto = onnx.load(str(lowered), load_external_data=False)
    assert [i.name for i in proto.graph.input] == [i.name for i in native.graph.input]
    assert [o.name for o in proto.graph.output] == [o.name for o in native.graph.output]
    assert not [n for n in proto.graph.node if n.op_type == "PagedAttention"]
    calls = [n for n in proto.graph.node if n.domain == "ortpa.portable"]
    assert sum(not n.name.endswith("/plan") for n in calls) == 2  # one call per layer, beside the shared step plan
    assert portable_info(proto) == info and info.kv_cache_layout == "SEPARATE" and not info.split_latent
    assert info.configs[0]["num_heads"] == 4 and info.configs[0]["kv_num_heads"] == 2
    # plain ONNX Runtime (no ortpa) opens it on CPU
    ort.InferenceSession(str(lowered), providers=["CPUExecutionProvider"])
    with pytest.raises(ConversionError, match="already lowered"):
        lower_file(lowered)


def test_engine_keeps_the_rope_table_limit_of_a_lowered_file(native_llama, tmp_path):
    lowered = tmp_path / "model.onnx"
    shutil.copyfile(native_llama, lowered)
    lower_file(lowered)
    rows = json.loads((FIXTURES / "formats" / "genai_llama_fp32.json").read_text())["max_position_embeddings"]
    engine = Engine(lowered, num_blocks=32)  # (the lowered file has no PagedAttention node to read it from)
    with pytest.raises(RequestTooLong):
        engine.add_request(list(range(3, rows)), SamplingParams(max_new_tokens=8))


def test_split_latent_halves_the_row_over_key_and_value(tmp_path):
    cfg = json.loads((FIXTURES / "dsv3_sdpa_op18.json").read_text())["config"]
    width = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    out = tmp_path / "model.onnx"
    ortpa.convert_file(DSV3, out, portable=True)
    proto = onnx.load(str(out), load_external_data=False)
    caches = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim[2:]] for i in proto.graph.input}
    layers = cfg["num_hidden_layers"]
    for i in range(layers):
        assert caches[f"past_key_values.{i}.key"] == caches[f"past_key_values.{i}.value"] == [1, width // 2]
    outputs = [o.name for o in proto.graph.output]
    assert outputs[1:] == [f"present.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
    info = portable_info(proto)
    assert info.split_latent and info.head_size == width and info.cache_head_size == width // 2
    # tokens against the original: tests/deploy/test_genai_engine.py (DeepSeek-V3 MoE, MiniCPM3)


def test_int8_latent_cannot_be_split_and_leaves_nothing(tmp_path, capsys):
    out = tmp_path / "out" / "model.onnx"
    code = main(["convert", str(DSV3), str(out), "--portable", "--kv-cache-dtype", "int8", "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code != 0 and "cannot split the latent cache" in err and "\n" not in err, err
    assert not out.exists() and not (out.parent / "genai_config.json").exists()


def test_external_weights_are_not_touched_by_the_lowering(tmp_path):
    """A model with external data: lowering rewrites the graph file only; the weights file stays byte for byte."""
    import hashlib

    src = tmp_path / "src" / "model.onnx"
    src.parent.mkdir()
    onnx.save_model(
        onnx.load(str(LLAMA)), str(src), save_as_external_data=True, location="model.onnx.data", size_threshold=1024
    )
    out = tmp_path / "out" / "model.onnx"
    ortpa.convert_file(src, out)
    data = out.parent / "model.onnx.data"
    digest = hashlib.sha256(data.read_bytes()).hexdigest()
    graph_bytes = out.stat().st_size
    prompts, params = [[5, 6, 7], list(range(10, 30))], SamplingParams(max_new_tokens=4)
    want = Engine(out, num_blocks=16).generate(prompts, params)  # the native file, lowered by the session
    lower_file(out)
    assert hashlib.sha256(data.read_bytes()).hexdigest() == digest
    # the graph grew by the functions and their calls only: no weight came inline
    lowered = onnx.load(str(out), load_external_data=False)
    functions = sum(f.ByteSize() for f in lowered.functions)
    assert out.stat().st_size < graph_bytes + functions + 10_000
    assert all(i.data_location == onnx.TensorProto.EXTERNAL for i in lowered.graph.initializer if len(i.dims) > 1)
    assert Engine(out, num_blocks=16).generate(prompts, params) == want


def test_a_checkpoint_is_exported_beside_the_output_and_removed_unless_kept(tmp_path, monkeypatch):
    """`convert HF_DIR OUT` exports into a temporary folder beside the output's (same disk), removed when the
    conversion ends; keep_dense (--keep-dense DIR) keeps it (the export itself: tests/test_export.py)."""
    import ortpa.conversion.orchestrator as orchestrator

    exported: list[Path] = []

    def export(model, out_path, options=None, *, random_weights, progress, node_metadata=True):
        exported.append(Path(out_path))
        shutil.copyfile(DSV3, out_path)  # the export's stand-in: a dense model where it was asked for

    monkeypatch.setattr(orchestrator, "export_dense", export)
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "torch_dtype": "float32"}))
    result = ortpa.convert_file(checkpoint, tmp_path / "out" / "model.onnx", verify=False)
    assert exported[0].parent.parent == tmp_path and not exported[0].exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "out"]  # nothing else left beside the output
    assert "config.json" in result.copied and result.paged_attention_nodes == 2
    kept = tmp_path / "dense"
    ortpa.convert_file(checkpoint, tmp_path / "out2" / "model.onnx", verify=False, keep_dense=kept)
    assert exported[1] == kept / "model.onnx" and exported[1].is_file()


def test_keep_dense_with_an_onnx_input_is_one_line(tmp_path, capsys):
    out = tmp_path / "out" / "model.onnx"
    assert main(["convert", str(LLAMA), str(out), "--keep-dense", str(tmp_path / "d")]) != 0
    err = capsys.readouterr().err.strip()
    assert "--keep-dense): expected a Hugging Face checkpoint folder" in err and "\n" not in err, err
    assert not out.exists()


def test_a_deployment_without_any_eos_says_so(tmp_path, capsys):
    """A bare .onnx with no config beside it: genai_config.json cannot name an EOS, and genai would stop at id 0."""
    out = tmp_path / "out" / "model.onnx"
    assert main(["convert", str(FIXTURES / "formats" / "onnxexporter_llama.onnx"), str(out), "--portable"]) == 0
    assert "no eos_token_id found" in capsys.readouterr().err
    assert "eos_token_id" not in json.loads((out.parent / "genai_config.json").read_text())["model"]


def _functions_have_if(proto: onnx.ModelProto) -> bool:
    return any(n.op_type == "If" for f in proto.functions for n in f.node)


def test_if_free_file_gives_the_default_forms_tokens_without_any_if(native_llama, tmp_path):
    """``--if-free`` (what the OpenVINO EP compiles): no If, the unread ``attention_metadata`` input dropped (the
    OpenVINO EP binds inputs by position after OpenVINO drops unread ones), both recorded in the metadata; ortpa's
    Engine gives the default form's tokens on it."""
    prompts, params = [[5, 6, 7], list(range(10, 30))], SamplingParams(max_new_tokens=6)
    files = {}
    for form in ("default", "if_free"):
        files[form] = tmp_path / form / "model.onnx"
        files[form].parent.mkdir()
        shutil.copyfile(native_llama, files[form])
        lower_file(files[form], if_free=form == "if_free")
    default, if_free = (onnx.load(str(files[f]), load_external_data=False) for f in ("default", "if_free"))
    assert _functions_have_if(default) and not _functions_have_if(if_free)
    info = portable_info(if_free)
    assert info.if_free and info.dropped_inputs == ("attention_metadata",) and not portable_info(default).if_free
    names = [i.name for i in default.graph.input]
    assert [i.name for i in if_free.graph.input] == [n for n in names if n != "attention_metadata"]
    tokens = {f: Engine(files[f], num_blocks=16).generate(prompts, params) for f in files}
    assert tokens["if_free"] == tokens["default"]


def test_if_free_without_portable_is_refused(tmp_path, capsys):
    out = tmp_path / "out" / "model.onnx"
    assert main(["convert", str(LLAMA), str(out), "--if-free", "--quiet"]) != 0
    err = capsys.readouterr().err.strip()
    assert "--if-free is a form of --portable" in err and "\n" not in err, err
    assert not out.exists()
