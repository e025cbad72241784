"""Streaming conversion and sessions from paths (ortpa.rewriter.model_store, ortpa.conversion.staging,
ortpa.runtime.ort_session)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
import pytest

import ortpa.ops.validate.model as node_check
import ortpa.runtime.session as session_module
from ortpa.conversion import convert_file
from ortpa.errors import ConversionError
from ortpa.parity.greedy import paged_greedy
from ortpa.rewriter import model_store, ort_check
from ortpa.rewriter.pipeline import convert
from ortpa.runtime.session import InferenceSession, PagedSession

FIXTURE = Path(__file__).parents[1] / "fixtures" / "dsv3_sdpa_op18.onnx"
PROMPTS = [[5, 9, 3, 7, 1], [2, 4]]


def _external_copy(folder: Path) -> Path:
    """The fixture with every tensor of 1 KiB or more in ``model.onnx.data``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.onnx"
    proto = onnx.load(str(FIXTURE))
    onnx.save_model(proto, str(path), save_as_external_data=True, location="model.onnx.data", size_threshold=1024)
    return path


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _tokens(model, n: int = 4) -> list[list[int]]:
    sess = PagedSession(model, num_blocks=16, block_size=16, providers=["CPUExecutionProvider"])
    return paged_greedy(sess, PROMPTS, n).tokens


def test_external_input_gives_external_output_and_is_not_modified(tmp_path):
    src = _external_copy(tmp_path / "in")
    before = _digests(src.parent)
    out = tmp_path / "out" / "paged.onnx"
    assert convert_file(src, out).model == out
    assert _digests(src.parent) == before
    assert sorted(p.name for p in out.parent.iterdir()) == ["genai_config.json", "paged.onnx", "paged.onnx.data"]
    # the written graph references the written data file, which exists
    header = onnx.load(str(out), load_external_data=False)
    locations = {e.value for t in header.graph.initializer for e in t.external_data if e.key == "location"}
    assert locations == {"paged.onnx.data"}
    # the same conversion of the inline fixture, in memory, gives the same greedy tokens
    assert _tokens(out) == _tokens(convert(FIXTURE))


def test_past_the_threshold_weights_go_to_external_data(tmp_path, monkeypatch):
    """Weights past EXTERNAL_DATA_THRESHOLD go to <out>.data, and the model read back from its path is whole."""
    monkeypatch.setattr(model_store, "EXTERNAL_DATA_THRESHOLD", 1)
    out = tmp_path / "paged.onnx"
    convert_file(FIXTURE, out)
    assert (tmp_path / "paged.onnx.data").is_file()
    full = onnx.load(str(out))
    onnx.checker.check_model(full)
    assert _tokens(full) == _tokens(out)


def test_inline_input_under_threshold_stays_inline(tmp_path):
    out = tmp_path / "paged.onnx"
    convert_file(FIXTURE, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["genai_config.json", "paged.onnx"]
    written = onnx.load(str(out), load_external_data=False)
    assert not any(t.data_location == onnx.TensorProto.EXTERNAL for t in written.graph.initializer)


# a shared folder differs from a new one only in the move: the other stages once, into a new folder
@pytest.mark.parametrize(
    ("where", "folder"),
    [*((w, "new") for w in ("write", "checks", "verify", "deploy", "move")), ("move", "shared")],
)
def test_interrupted_conversion_leaves_no_output(tmp_path, monkeypatch, where, folder):
    """Interrupted anywhere, even inside the move: no model, no half deployment, no temp folder. A new output
    folder is published by one rename; in a folder shared with other files the model is moved last."""
    import ortpa.conversion.orchestrator as orchestrator
    from ortpa.conversion.staging import Staging

    src = _external_copy(tmp_path / "in")
    out = tmp_path / "out" / "paged.onnx"
    if folder == "shared":
        out.parent.mkdir()
        (out.parent / "notes.txt").write_text("kept")
    target = {
        "write": (model_store, "write"),
        "checks": (model_store, "check_session_from_path"),
        "verify": (orchestrator, "_verify"),
        "deploy": (orchestrator, "build_genai_config"),
        "move": (orchestrator.os, "replace"),  # the first rename of the commit
    }[where]

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    if where == "move":
        real_commit = Staging.commit

        def commit(self):
            monkeypatch.setattr(*target, interrupt)
            real_commit(self)

        monkeypatch.setattr(Staging, "commit", commit)
    else:
        monkeypatch.setattr(*target, interrupt)
    with pytest.raises(KeyboardInterrupt):
        convert_file(src, out)
    monkeypatch.undo()
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == (["in", "out"] if folder == "shared" else ["in"]), left
    if folder == "shared":
        assert sorted(p.name for p in out.parent.iterdir()) == ["notes.txt"]


def test_refuses_to_replace_the_input_data_file(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    path = folder / "model.onnx"
    proto = onnx.load(str(FIXTURE))
    onnx.save_model(proto, str(path), save_as_external_data=True, location="paged.onnx.data", size_threshold=1024)
    before = _digests(folder)
    with pytest.raises(ConversionError, match="input's own external data"):
        convert_file(path, folder / "paged.onnx")
    assert _digests(folder) == before


def test_session_check_runs_without_weights():
    proto = convert(FIXTURE)
    light = ort_check.weightless(proto)
    big = {t.name for t in proto.graph.initializer if len(t.raw_data) >= 4096}
    assert big and not big & {t.name for t in light.graph.initializer}
    assert big <= {i.name for i in light.graph.input}
    model_store.check_session_from_path(proto)  # opens on CPU (portable PagedAttention) without the weights


def test_one_shape_inference_and_one_validation_per_session(tmp_path, monkeypatch):
    out = tmp_path / "paged.onnx"
    convert_file(FIXTURE, out)
    counts = {"infer": 0, "rules": 0}
    real_infer, real_rules = session_module.infer_shapes, node_check._check_rules

    def infer(*args, **kwargs):
        counts["infer"] += 1
        return real_infer(*args, **kwargs)

    def rules(*args, **kwargs):
        counts["rules"] += 1
        return real_rules(*args, **kwargs)

    monkeypatch.setattr(session_module, "infer_shapes", infer)
    monkeypatch.setattr(node_check, "infer_shapes", infer)
    monkeypatch.setattr("ortpa.ops.portable.lower.infer_shapes", infer)
    monkeypatch.setattr(node_check, "_check_rules", rules)
    sess = InferenceSession(out, providers=["CPUExecutionProvider"], paged_attention="portable")
    nodes = sum(n.op_type == "PagedAttention" for n in onnx.load(str(out)).graph.node)
    assert sess.portable_nodes and nodes == len(sess.portable_nodes)
    assert counts == {"infer": 1, "rules": nodes}


def test_session_weights_are_not_copied_into_a_serialized_model(tmp_path, monkeypatch):
    """The lowered model handed to ORT holds no weight bytes: they come from the data file (memory-mapped)."""
    src = _external_copy(tmp_path / "in")
    out = tmp_path / "paged.onnx"
    convert_file(src, out)
    sizes = []
    real = session_module.open_ort_session

    def spy(loaded, graph_only, external, **kwargs):
        sizes.append(sum(len(t.raw_data) for t in graph_only.graph.initializer))
        names, arrays = external.arrays()
        assert all(isinstance(a, np.memmap) for a in arrays) and names
        return real(loaded, graph_only, external, **kwargs)

    monkeypatch.setattr(session_module, "open_ort_session", spy)
    InferenceSession(out, providers=["CPUExecutionProvider"])
    data = (tmp_path / "paged.onnx.data").stat().st_size
    assert sizes and sizes[0] < data / 10


def test_session_options_are_not_reused_across_models(tmp_path):
    """External initializers are registered on a fresh SessionOptions: the caller's can serve another model."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    out = tmp_path / "paged.onnx"
    convert_file(FIXTURE, out)
    first = InferenceSession(out, opts, providers=["CPUExecutionProvider"])
    second = InferenceSession(convert(FIXTURE), opts, providers=["CPUExecutionProvider"])
    assert first.get_inputs()[0].name == second.get_inputs()[0].name


def test_in_memory_convert_of_an_external_data_model_is_complete(tmp_path):
    """ortpa.convert(path) returns a whole ModelProto even when the input's weights are external (lazy inside)."""
    src = _external_copy(tmp_path / "in")
    proto = convert(src)
    assert not any(t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer)
    assert _tokens(proto) == _tokens(convert(FIXTURE))


def test_int8_calibration_runs_on_an_external_data_model(tmp_path):
    """The int8 KV calibration runs the dense model from bytes: it gets the weights read in, not references."""
    src = _external_copy(tmp_path / "in")
    out = tmp_path / "paged.onnx"
    convert_file(src, out, kv_cache_dtype="int8")
    inputs = onnx.load(str(out), load_external_data=False).graph.input
    assert sum(i.type.tensor_type.elem_type == onnx.TensorProto.INT8 for i in inputs) == 2  # one cache per layer
