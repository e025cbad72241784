"""validate_model on ONNX files, the CLI, and agreement with ONNX Runtime's own checks (CPU session creation).

ONNX Runtime has no CPU kernel for PagedAttention, so on CPU a node that passes graph resolution (type binding
and the schema's shape inference) fails with NOT_IMPLEMENTED, and one that does not fails with INVALID_GRAPH /
FAIL / INVALID_ARGUMENT. Agreement means: whatever ONNX Runtime rejects, ortpa rejects too; whatever ortpa
accepts, ONNX Runtime gets as far as looking for a kernel. (ortpa rejecting a NOT_IMPLEMENTED node is expected:
those are the kernel's own rules, which only run on CUDA/WebGPU.) The activations are bfloat16 here because
onnxruntime 1.31 inserts float casts around float16 nodes without a CPU kernel, which fails type binding first.
"""

from __future__ import annotations

import json
import random

import numpy as np
import onnx
import pytest
from onnx import helper
from validate_cases import ACCEPT, BF16, REJECT, SCHEMA_REJECT, Case, build, node_model, ort_verdict

from ortpa.cli import main
from ortpa.errors import InvalidModel
from ortpa.ops.validate import TensorInfo, validate, validate_model

_OUT = ("output", "key_cache_out", "value_cache_out")


def make_model(case: Case, t_dtype=BF16, *, num_outputs: int | None = None, name: str = "pa") -> onnx.ModelProto:
    """A one-node PagedAttention model whose graph inputs carry the case's shapes and types."""
    inputs, attrs = build(case, t_dtype)
    outputs = list(_OUT[: num_outputs or case.num_outputs])
    if case.rule == "schema.outputs.both":
        outputs = ["output", "key_cache_out"]
    return node_model(inputs, attrs, outputs, name=name)


# ------------------------------------------------------------------------------------------ ORT agreement
_CANDIDATES = [c for c in ACCEPT + REJECT + SCHEMA_REJECT if not c.symbolic and not c.kwargs]
_SAMPLE = random.Random(20261129).sample(_CANDIDATES, 40)


def test_agrees_with_onnxruntime() -> None:
    counts = {"both_reject": 0, "ortpa_rejects_kernel_rule": 0, "both_accept": 0}
    disagreements = []
    for case in _SAMPLE:
        model = make_model(case)
        ort_says, ort_text = ort_verdict(model)
        ours = validate_model(model)
        if ort_says == "reject" and not ours.ok:
            counts["both_reject"] += 1
            rule, _, message = ours.nodes[0].errors[0]
            if rule.startswith(("schema.", "type.T")):  # same stage, same words
                assert message in ort_text, (case.id, message, ort_text)
        elif ort_says == "kernel" and ours.ok:
            counts["both_accept"] += 1
        elif ort_says == "kernel" and not ours.ok:
            counts["ortpa_rejects_kernel_rule"] += 1
        else:
            disagreements.append((case.id, ort_says, ours.format()))
    print(f"ORT agreement over {len(_SAMPLE)} cases: {counts}, disagreements: {len(disagreements)}")
    assert not disagreements, disagreements
    # the sample exercises all three outcomes
    assert all(counts.values()), counts


# ------------------------------------------------------------------------------------------ validate_model
def test_model_from_file(tmp_path) -> None:
    path = tmp_path / "m.onnx"
    onnx.save(make_model(ACCEPT[0], num_outputs=3), path)
    report = validate_model(str(path))
    assert report.ok and [n.status for n in report.nodes] == ["valid"]
    assert report.to_dict()["nodes"][0]["node"] == "pa"
    assert validate(path.read_bytes()).ok  # bytes, and the public alias


def test_symbolic_dims_reported_unchecked() -> None:
    case = Case("sym", None, "separate", {"query": TensorInfo(("T", 64), BF16), "key": TensorInfo(("T", 32), BF16),
                                          "value": TensorInfo(("T2", 32), BF16)})  # fmt: skip
    report = validate_model(make_model(case))
    node = report.nodes[0]
    assert report.ok and node.status == "unchecked"
    assert ("1.2.separate.6b" in {r for r, _ in node.unchecked}) and "unchecked [1.2.separate.6b]" in report.format()


def test_invalid_node_makes_report_fail() -> None:
    bad = next(c for c in REJECT if c.rule == "1.5.2")
    report = validate_model(make_model(bad))
    assert not report.ok and report.nodes[0].status == "invalid"
    rule, name, message = report.nodes[0].errors[0]
    assert (rule, name) == ("1.5.2", "key_cache") and "block_size == 24" in message
    assert "INVALID" in report.format()


def test_no_nodes() -> None:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])],
    )
    report = validate_model(helper.make_model(graph))
    assert report.ok and "no PagedAttention nodes" in report.format()
    assert report.to_dict()["summary"] == "no PagedAttention nodes"


def test_nodes_inside_subgraphs_are_found() -> None:
    inner = make_model(ACCEPT[0]).graph
    bad = make_model(next(c for c in REJECT if c.rule == "1.5.3"), name="inner_bad").graph
    bad.node[0].input[3] = "kc_bad"  # its own key_cache, declared with the bad shape below
    kc_bad = next(i for i in bad.input if i.name == "key_cache")
    kc_bad.name = "kc_bad"
    then_g = helper.make_graph(list(inner.node), "then", [], [helper.make_tensor_value_info("output", 0, None)])
    else_g = helper.make_graph(list(bad.node), "else", [], [helper.make_tensor_value_info("output", 0, None)])
    cond = helper.make_tensor_value_info("c", onnx.TensorProto.BOOL, [])
    if_node = helper.make_node("If", ["c"], ["output"], name="branch", then_branch=then_g, else_branch=else_g)
    graph = helper.make_graph(
        [if_node], "g", [*inner.input, kc_bad, cond], [helper.make_tensor_value_info("output", 0, None)]
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 22), helper.make_opsetid("com.microsoft", 1)]
    )
    report = validate_model(model)
    status = {n.node: n.status for n in report.nodes}
    assert status == {"branch/then_branch/pa": "valid", "branch/else_branch/inner_bad": "invalid"}
    assert not report.ok


@pytest.mark.parametrize("content", [b"", b"not an onnx model at all \x00\xff\xfe", b"\x08"])
def test_not_onnx_is_invalid_model(tmp_path, content) -> None:
    path = tmp_path / "bad.onnx"
    path.write_bytes(content)
    with pytest.raises(InvalidModel) as info:
        validate_model(str(path))
    assert str(path) in str(info.value) and "Traceback" not in str(info.value)


def test_truncated_and_missing_files(tmp_path) -> None:
    data = make_model(ACCEPT[0]).SerializeToString()
    path = tmp_path / "cut.onnx"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(InvalidModel):
        validate_model(path)
    with pytest.raises(InvalidModel, match="no such file"):
        validate_model(tmp_path / "missing.onnx")


def test_backend_gate_in_report() -> None:
    latent = make_model(ACCEPT[2])
    assert validate_model(latent, backend="cuda").ok
    report = validate_model(latent, backend="webgpu")
    assert not report.ok and report.nodes[0].status == "unsupported"
    assert report.nodes[0].backend_errors[0][:2] == ("webgpu", "bfloat16 activations")
    one_out = validate_model(make_model(ACCEPT[0], np.float16, num_outputs=2), backend="webgpu")
    assert one_out.nodes[0].status == "invalid"  # the schema already rejects a single cache output


# ------------------------------------------------------------------------------------------ CLI
def test_cli_exit_codes_and_json(tmp_path, capsys) -> None:
    good, bad = tmp_path / "good.onnx", tmp_path / "bad.onnx"
    onnx.save(make_model(ACCEPT[0]), good)
    onnx.save(make_model(next(c for c in REJECT if c.rule == "1.6.4")), bad)
    assert main(["validate", str(good)]) == 0
    assert "pa: valid" in capsys.readouterr().out
    assert main(["validate", str(bad), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False and out["nodes"][0]["errors"][0]["rule"] == "1.6.4"
    assert main(["validate", str(good), "--backend", "portable", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["backend"] == "portable"
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"junk")
    assert main(["validate", str(junk)]) == 1
    assert "not an ONNX model" in capsys.readouterr().err
