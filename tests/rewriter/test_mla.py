"""Dense MLA -> PagedAttention LATENT: parity of converted fixtures against the dense exports on ORT CPU.

The converted model runs through ``ortpa.ops.portable.lower_to_portable`` (PagedAttention in standard ops);
the reference is the dense export run by ONNX Runtime, one sequence at a time with its own past/present KV.
Three prompts are prefilled together, then decoded with continuous batching: at step 4 one sequence leaves
and a new prompt's prefill joins the running decodes in the same packed step.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from tolerances import assert_close

from ortpa.errors import ConversionError
from ortpa.ops.portable import lower_to_portable
from ortpa.ops.validate import validate_model
from ortpa.rewriter.mla import LayerFailure, MlaLayer, match_mla_layers
from ortpa.rewriter.pipeline import convert, convert_file

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
BLOCK_SIZE, NUM_BLOCKS, BLOCKS_PER_SEQ = 16, 24, 4
_CACHE_NP = {"tensor(float16)": np.float16, "tensor(bfloat16)": ml_dtypes.bfloat16}


def _session(model: onnx.ModelProto | str) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    opts.log_severity_level = 3
    data = model if isinstance(model, str) else model.SerializeToString()
    return ort.InferenceSession(data, opts, providers=["CPUExecutionProvider"])


class _Dense:
    """The dense export, one sequence at a time, feeding present KV back as past KV."""

    def __init__(self, path: Path) -> None:
        self.sess = _session(str(path))
        inputs = {i.name: i for i in self.sess.get_inputs()}
        self.layers = sum(1 for n in inputs if n.startswith("past_key_values.") and n.endswith(".key"))
        self.widths = (inputs["past_key_values.0.key"].shape[3], inputs["past_key_values.0.value"].shape[3])

    def new(self) -> dict:
        k, v = (np.zeros((1, 1, 0, w), np.float32) for w in self.widths)
        return {"len": 0, "kv": [(k, v)] * self.layers}

    def step(self, state: dict, ids: list[int]) -> np.ndarray:
        past, n = state["len"], len(ids)
        feed = {
            "input_ids": np.array([ids], np.int64),
            "attention_mask": np.ones((1, past + n), np.int64),
            "position_ids": np.arange(past, past + n, dtype=np.int64)[None],
        }
        for i, (k, v) in enumerate(state["kv"]):
            feed[f"past_key_values.{i}.key"], feed[f"past_key_values.{i}.value"] = k, v
        out = self.sess.run(None, feed)
        state["kv"], state["len"] = list(zip(out[1::2], out[2::2], strict=True)), past + n
        return out[0][0, -1]


def _run_paged(converted: onnx.ModelProto, dense_path: Path, *, logits: str = "last", positions: bool = False):
    """Continuous batching on the converted model vs the dense one; returns the worst |logit difference|."""
    sess = _session(lower_to_portable(converted))
    dense = _Dense(dense_path)
    cache_in = [i for i in sess.get_inputs() if i.name.startswith("past_key_values.")]
    caches = {i.name: np.zeros((NUM_BLOCKS, BLOCK_SIZE, 1, i.shape[3]), _CACHE_NP[i.type]) for i in cache_in}
    rng = np.random.default_rng(0)
    free = [int(b) for b in rng.permutation(NUM_BLOCKS)]  # scattered blocks: the table really is a page table
    seqs: dict[str, dict] = {}

    def add(name: str, length: int) -> None:
        blocks = [free.pop() for _ in range(BLOCKS_PER_SEQ)]
        seqs[name] = {"blocks": blocks, "len": 0, "pending": [int(t) for t in rng.integers(0, 256, length)]}
        seqs[name]["dense"] = dense.new()

    for name, length in (("A", 5), ("B", 11), ("C", 3)):
        add(name, length)
    worst = 0.0
    for step in range(8):
        if step == 4:
            free.extend(seqs.pop("C")["blocks"])
            add("D", 6)
        names = list(seqs)
        ids, cu, past = [], [0], []
        for name in names:
            ids += seqs[name]["pending"]
            cu.append(len(ids))
            past.append(seqs[name]["len"])
        q_lens = np.diff(cu)
        feed = {
            "input_ids": np.array(ids, np.int64),
            "cumulative_sequence_lengths": np.array(cu, np.int32),
            "past_sequence_lengths": np.array(past, np.int32),
            "block_table": np.array([seqs[n]["blocks"] for n in names], np.int32),
            "attention_metadata": np.array(
                [q_lens.max(), max(p + q for p, q in zip(past, q_lens, strict=True)), 0], np.int32
            ),
            **caches,
        }
        if positions:
            feed["position_ids"] = np.concatenate(
                [np.arange(p, p + q) for p, q in zip(past, q_lens, strict=True)]
            ).astype(np.int64)
        out = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feed), strict=True))
        caches = {name: out[name.replace("past_key_values", "present")] for name in caches}
        rows = out["logits"] if logits == "last" else out["logits"][np.array(cu[1:]) - 1]
        assert rows.shape == (len(names), out["logits"].shape[-1])
        for j, name in enumerate(names):
            seq = seqs[name]
            ref = dense.step(seq["dense"], seq["pending"])
            assert_close(rows[j], ref, np.float16, what=f"step {step}, sequence {name}")
            worst = max(worst, float(np.abs(rows[j] - ref).max()))
            token = int(rows[j].argmax())
            assert token == int(ref.argmax()), f"step {step}, sequence {name}: greedy token differs"
            seq["len"] += len(seq["pending"])
            seq["pending"] = [token]
    return worst


# (fixture, convert options, harness options): each real export, plus the option matrix on the headline one.
CASES = [
    ("dsv3_sdpa_op18", {}, {}),
    ("dsv3_eager_op18", {}, {}),
    ("dsv3_sdpa_op23", {}, {}),
    ("dsv3_sdpa_op18", {"rope_in_op": True}, {}),
    ("dsv3_sdpa_op18_noil_noqlora", {"absorb": "matmul"}, {}),
    ("dsv3_sdpa_op18_noil_noqlora", {"rope_in_op": True}, {}),
    ("dsv3_sdpa_op18_rope32", {"rope_in_op": True, "absorb": "matmul"}, {}),
    ("kimi_sdpa_op18", {"absorb": "fold", "logits": "all"}, {"logits": "all"}),
    ("glm4moelite_sdpa_op18", {"position_ids": "input", "attention_metadata": True}, {"positions": True}),
    ("minicpm3_sdpa_op18", {}, {}),
]


@pytest.mark.parametrize(("fixture", "options", "harness"), CASES, ids=[c[0] + str(c[1] or "") for c in CASES])
def test_parity_continuous_batching(fixture, options, harness):
    dense_path = FIXTURES / f"{fixture}.onnx"
    converted = convert(str(dense_path), **options)
    assert sum(n.op_type == "PagedAttention" for n in converted.graph.node) == 2
    _run_paged(converted, dense_path, **harness)


def test_wrong_scale_breaks_parity():
    """The parity harness can fail: a 10% error in the absorbed softmax scale is caught."""
    converted = convert(str(FIXTURES / "dsv3_sdpa_op18.onnx"))
    for node in converted.graph.node:
        for attr in node.attribute:
            if node.op_type == "PagedAttention" and attr.name == "scale":
                attr.f *= 1.1
    with pytest.raises(AssertionError):
        _run_paged(converted, FIXTURES / "dsv3_sdpa_op18.onnx")


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def test_node_attributes_and_interface():
    converted = convert(str(FIXTURES / "dsv3_sdpa_op18.onnx"))
    nodes = [n for n in converted.graph.node if n.op_type == "PagedAttention"]
    a = _attrs(nodes[0])
    assert a["kv_cache_layout"] == b"LATENT" and a["kv_num_heads"] == 1 and a["num_heads"] == 4
    assert a["v_head_size"] == 64  # kv_lora_rank
    # 1/sqrt(qk_nope + qk_rope) * mscale(4, 1)^2, not 1/sqrt(head_size = 80)
    mscale = 0.1 * np.log(4.0) + 1.0
    assert a["scale"] == pytest.approx(mscale**2 / np.sqrt(48), rel=1e-6)
    assert "do_rotary" not in a
    names = [i.name for i in converted.graph.input]
    assert names == [
        "input_ids",
        "cumulative_sequence_lengths",
        "past_sequence_lengths",
        "block_table",
        "attention_metadata",
        "past_key_values.0.key",
        "past_key_values.1.key",
    ]
    assert [o.name for o in converted.graph.output] == ["logits", "present.0.key", "present.1.key"]
    assert nodes[0].output[1] == "present.0.key" and nodes[0].input[3] == "past_key_values.0.key"
    cache = converted.graph.input[5].type.tensor_type
    assert cache.elem_type == onnx.TensorProto.FLOAT16
    assert [d.dim_value or d.dim_param for d in cache.shape.dim] == ["num_blocks", "block_size", 1, 80]
    assert validate_model(converted, backend="cuda").ok


def test_rope_in_op_attributes():
    converted = convert(str(FIXTURES / "dsv3_sdpa_op18_rope32.onnx"), rope_in_op=True, max_positions=128)
    node = next(n for n in converted.graph.node if n.op_type == "PagedAttention")
    a = _attrs(node)
    assert (a["do_rotary"], a["rotary_offset"], a["rotary_interleaved"]) == (1, 64, 1)
    cos = next(i for i in converted.graph.initializer if i.name == node.input[8])
    assert list(cos.dims) == [128, 16]
    assert "position_ids" not in {i.name for i in converted.graph.input}
    assert not any(n.op_type in ("Cos", "Sin") for n in converted.graph.node)  # the graph's RoPE is gone


def test_dtype_float16_and_bfloat16_cache():
    fp16 = convert(str(FIXTURES / "dsv3_sdpa_op18.onnx"), dtype="float16")
    assert all(i.data_type != onnx.TensorProto.FLOAT for i in fp16.graph.initializer)
    assert fp16.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    assert not any(
        n.op_type == "Cast" and n.output[0] in {x for p in fp16.graph.node for x in p.input[:2]}
        for n in fp16.graph.node
        if n.op_type == "PagedAttention"
    )
    bf16 = convert(str(FIXTURES / "dsv3_sdpa_op18.onnx"), kv_cache_dtype="bfloat16")
    cache = next(i for i in bf16.graph.input if i.name == "past_key_values.0.key")
    assert cache.type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16
    assert validate_model(bf16, backend="cuda").ok


def _near_miss() -> onnx.ModelProto:
    """The headline fixture with layer 1's Softmax turned into a Sigmoid: attention, but not softmax attention."""
    model = onnx.load(str(FIXTURES / "dsv3_sdpa_op18.onnx"))
    softmaxes = [n for n in model.graph.node if n.op_type == "Softmax"]
    assert len(softmaxes) == 2
    softmaxes[1].op_type = "Sigmoid"
    del softmaxes[1].attribute[:]
    return model


def test_near_miss_is_reported_and_left_alone():
    import onnx_ir as ir

    model = _near_miss()
    before = hashlib.sha256(model.SerializeToString()).hexdigest()
    with pytest.raises(ConversionError, match="1 of 2 layers") as info:
        convert(model)
    assert hashlib.sha256(model.SerializeToString()).hexdigest() == before  # the input is never modified
    (where, why), *rest = info.value.failures
    assert not rest and where.startswith("layer 1") and "not a Softmax" in why
    results = match_mla_layers(ir.serde.deserialize_model(model).graph)
    assert isinstance(results[0], MlaLayer) and isinstance(results[1], LayerFailure)


def test_not_mla_is_rejected():
    x = onnx.helper.make_tensor_value_info("input_ids", onnx.TensorProto.INT64, ["b", "s"])
    y = onnx.helper.make_tensor_value_info("logits", onnx.TensorProto.INT64, ["b", "s"])
    graph = onnx.helper.make_graph([onnx.helper.make_node("Identity", ["input_ids"], ["logits"])], "g", [x], [y])
    with pytest.raises(ConversionError, match="no attention layers found"):
        convert(onnx.helper.make_model(graph))


def test_convert_file_is_atomic(tmp_path):
    src = FIXTURES / "dsv3_sdpa_op18.onnx"
    digest = hashlib.sha256(src.read_bytes()).hexdigest()
    out = tmp_path / "sub" / "paged.onnx"
    convert_file(src, out)
    assert hashlib.sha256(src.read_bytes()).hexdigest() == digest
    assert sorted(p.name for p in out.parent.iterdir()) == ["paged.onnx"]  # no temp files left behind
    assert sum(n.op_type == "PagedAttention" for n in onnx.load(str(out)).graph.node) == 2
    bad = tmp_path / "near_miss.onnx"
    onnx.save(_near_miss(), str(bad))
    with pytest.raises(ConversionError):
        convert_file(bad, tmp_path / "never.onnx")
    assert not (tmp_path / "never.onnx").exists()
    with pytest.raises(ConversionError, match="overwrite the input"):
        convert_file(bad, bad)


def test_external_data_over_threshold(tmp_path, monkeypatch):
    """Models over protobuf's 2 GB limit are saved with external data (threshold lowered to exercise it)."""
    import ortpa.rewriter.pipeline as pipeline

    monkeypatch.setattr(pipeline, "_EXTERNAL_DATA_THRESHOLD", 1)
    out = tmp_path / "paged.onnx"
    convert_file(FIXTURES / "dsv3_sdpa_op18.onnx", out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["paged.onnx", "paged.onnx.data"]
    assert out.stat().st_size < (tmp_path / "paged.onnx.data").stat().st_size
    assert sum(n.op_type == "PagedAttention" for n in onnx.load(str(out)).graph.node) == 2
