"""The If-free portable form (``lower_to_portable(..., if_free=True)``, ``convert --portable --if-free``).

Both attention groups run at every step, each padded to at least one member (a dummy sequence with no token when
the group is empty) and one key, so that no ``If`` is needed and no kernel sees an empty batch (issue 40). Every
case of the portable matrix agrees with the NumPy oracle, every kind of step (prompt chunks only, decodes only,
both, no token, an invalid sequence) agrees with the default form, the graph has no ``If`` and none of the
kernels OpenVINO's EP lacks, and the attention kernels never see an empty input.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from support.tolerances import assert_close
from test_portable import MATRIX, check, make_case, run, session

from ortpa.ops.portable import lower_to_portable, paged_attention_model

F16 = np.dtype(np.float16)
GQA = dict(num_heads=8, kv_num_heads=2, rotary=(32, False, 0))
LATENT = dict(latent=True, num_heads=4, kv_num_heads=1, head_size=64, v_head_size=48, rotary=(16, False, 48))
STEPS = {
    "prefills_only": dict(q_lens=(4, 6), pasts=(0, 3)),
    "decodes_only": dict(q_lens=(1, 1, 1), pasts=(9, 20, 40)),
    "mixed": dict(q_lens=(5, 1, 0, 1), pasts=(0, 12, 4, 33)),
    "zero_tokens": dict(q_lens=(0,), pasts=(5,)),
    "invalid_sequence": dict(q_lens=(1, 3), pasts=(10_000, 4)),
}


def _if_free(case) -> onnx.ModelProto:
    return lower_to_portable(paged_attention_model(case.inputs, case.attrs), if_free=True)


def _op_types(model: onnx.ModelProto) -> set[str]:
    """Every op type of the model's functions, subgraphs included."""

    def walk(nodes) -> set[str]:
        found = set()
        for node in nodes:
            found.add(node.op_type)
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    found |= walk(attr.g.node)
        return found

    return set().union(*(walk(f.node) for f in model.functions))


@pytest.mark.parametrize("name", sorted(MATRIX))
def test_matrix_matches_the_oracle(name: str) -> None:
    case = make_case(np.random.default_rng(sorted(MATRIX).index(name)), F16, **MATRIX[name])
    check(case, model=_if_free(case))


@pytest.mark.parametrize("layout", ["gqa", "latent"])
@pytest.mark.parametrize("step", sorted(STEPS))
def test_every_kind_of_step_equals_the_default_form(step: str, layout: str) -> None:
    case = make_case(np.random.default_rng(40), F16, **(GQA if layout == "gqa" else LATENT), **STEPS[step])
    if_free = check(case, model=_if_free(case))  # the oracle's outputs
    default = lower_to_portable(paged_attention_model(case.inputs, case.attrs))
    feed = {**case.inputs, "_width": if_free["output"].shape[1]}
    base = run(session(default), feed)
    assert_close(if_free["output"], base["output"], F16, what="output")
    for name in ("key_cache_out", "value_cache_out"):
        if name in base:  # the same rows written, bit for bit
            np.testing.assert_array_equal(if_free[name].view(np.uint16), base[name].view(np.uint16), err_msg=name)


@pytest.mark.parametrize("layout", ["gqa", "latent"])
def test_no_if_and_only_kernels_openvino_compiles(layout: str) -> None:
    """No ``If`` anywhere; no ``MultiHeadAttention`` or ``IsInf`` (the OpenVINO EP has neither: a kernel it leaves
    to the CPU EP between its subgraphs made the fused graph cyclic), no ``CastLike`` (typed function inputs)."""
    case = make_case(np.random.default_rng(1), F16, **(GQA if layout == "gqa" else LATENT), **STEPS["mixed"])
    ops = _op_types(_if_free(case))
    assert not ops & {"If", "MultiHeadAttention", "IsInf", "CastLike", "Size"}, sorted(ops)
    default_ops = _op_types(lower_to_portable(paged_attention_model(case.inputs, case.attrs)))
    assert "If" in default_ops and "CastLike" not in default_ops  # the default form keeps its Ifs, typed too


# the attention's kernels: each sees the group's padded batch, keys and query rows
_ATTENTION_KERNELS = ("MatMul", "FusedMatMul", "ReduceMax", "ReduceSum", "Exp", "Div")


def _kernel_shapes(model: onnx.ModelProto, inputs: dict, tmp_path) -> dict[str, list[list[list[int]]]]:
    """Each op type's kernel calls in one run, as their input shapes (ONNX Runtime's profiler)."""
    import json

    import onnxruntime as ort

    so = ort.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "profile")
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    run(sess, {**inputs, "_width": sess.get_outputs()[0].shape[1]})
    calls: dict[str, list[list[list[int]]]] = {}
    for e in json.loads(open(sess.end_profiling()).read()):
        if e.get("cat") == "Node" and "input_type_shape" in e.get("args", {}):
            shapes = [list(next(iter(s.values()))) for s in e["args"]["input_type_shape"]]
            calls.setdefault(e["args"]["op_name"], []).append(shapes)
    return calls


@pytest.mark.parametrize("step", ["prefills_only", "decodes_only", "mixed"])
def test_no_attention_kernel_sees_an_empty_input(step: str, tmp_path) -> None:
    """A step without prompt chunks (or without decodes) runs the other group on its dummy member: one row, one
    key; older kernels divide by zero on an empty batch (issue 40), so none is ever given one."""
    case = make_case(np.random.default_rng(3), F16, **GQA, **STEPS[step])
    calls = _kernel_shapes(_if_free(case), case.inputs, tmp_path)
    # Q K^T (ONNX Runtime fuses its Transpose: FusedMatMul) and P V of both groups: the profiler saw them all
    assert len(calls.get("MatMul", []) + calls.get("FusedMatMul", [])) == 4, calls.get("MatMul")
    for op_type in _ATTENTION_KERNELS:
        empty = [call for call in calls.get(op_type, []) if any(0 in shape for shape in call)]
        assert not empty, (op_type, empty)
