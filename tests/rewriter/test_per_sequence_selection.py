"""Batched = alone for MoE dispatch by selection: transformers 4.x's eager MoE loop (DeepSeek-V3 as optimum traces
it) written by hand after a Llama fixture's embedding, and the leaks of its form, each refused by name.

Route each token to its top-2 of 4 experts; ``one_hot`` the picks; per expert, ``NonZero`` of its mask gives the
(token, slot) of each row it computes, ``x[token]`` its input and ``weights[token * 2 + slot]`` its weight, and a
``ScatterElements`` into zeros (``index_add``) puts each row back on its token. Which rows ``NonZero`` selects
depends on each token alone; its output is positions in the step, exact only as the indices of each row's own token.
The leaks: an expert reading the next token's row, writing onto the next token, and a position used as a value.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from test_per_sequence_flow import _ints, _probe

from ortpa.errors import ConversionError
from ortpa.rewriter.pipeline import convert

EXPERTS, TOP_K = 4, 2


def _eager_moe(leak: str | None = None):
    def extra(emb, hidden):
        rng = np.random.default_rng(11)
        f = np.float32
        inits = [
            numpy_helper.from_array(rng.standard_normal((hidden, EXPERTS)).astype(f), "sel/router"),
            _ints("sel/rows", [-1, hidden]),
            _ints("sel/col", [-1, 1]),
            _ints("sel/k", [TOP_K]),
            _ints("sel/kk", TOP_K),
            _ints("sel/one", 1),
            _ints("sel/ax1", [1]),
            _ints("sel/halves", [1, 1]),
            _ints("sel/depth", EXPERTS),
            _ints("sel/onoff", [0, 1]),
            _ints("sel/back", [1, -1, hidden]),
        ]
        n = [
            helper.make_node("Reshape", [emb, "sel/rows"], ["sel/x"]),
            helper.make_node("MatMul", ["sel/x", "sel/router"], ["sel/logits"]),
            helper.make_node("Softmax", ["sel/logits"], ["sel/probs"], axis=-1),
            helper.make_node("TopK", ["sel/probs", "sel/k"], ["sel/topw", "sel/ids"], axis=-1),
            helper.make_node("Reshape", ["sel/topw", "sel/col"], ["sel/flat_w"]),  # [T * k, 1]
            helper.make_node("OneHot", ["sel/ids", "sel/depth", "sel/onoff"], ["sel/onehot"], axis=-1),
            helper.make_node("Transpose", ["sel/onehot"], ["sel/masks"], perm=[2, 0, 1]),  # [experts, T, k]
            helper.make_node("Shape", ["sel/x"], ["sel/xshape"]),
            helper.make_node(
                "ConstantOfShape", ["sel/xshape"], ["sel/acc0"], value=helper.make_tensor("z", 1, [1], [0])
            ),
        ]
        acc = "sel/acc0"
        for e in range(EXPERTS):
            w = (rng.standard_normal((hidden, hidden)) / np.sqrt(hidden)).astype(f)
            inits += [numpy_helper.from_array(w, f"sel/w{e}"), _ints(f"sel/e{e}", e)]
            p = f"sel/{e}/"
            n += [
                helper.make_node("Gather", ["sel/masks", f"sel/e{e}"], [p + "mask"], axis=0),
                helper.make_node("Cast", [p + "mask"], [p + "bool"], to=onnx.TensorProto.BOOL),
                helper.make_node("NonZero", [p + "bool"], [p + "nz"], name=f"select{e}"),
                helper.make_node("Transpose", [p + "nz"], [p + "coords"], perm=[1, 0]),
                helper.make_node("Split", [p + "coords", "sel/halves"], [p + "tok1", p + "slot1"], axis=1),
                helper.make_node("Squeeze", [p + "tok1", "sel/ax1"], [p + "tok"]),
                helper.make_node("Squeeze", [p + "slot1", "sel/ax1"], [p + "slot"]),
                helper.make_node("Mul", [p + "tok", "sel/kk"], [p + "tok_k"]),
                helper.make_node("Add", [p + "slot", p + "tok_k"], [p + "widx"]),
                helper.make_node("Gather", ["sel/flat_w", p + "widx"], [p + "w"], axis=0),
            ]
            read, write = p + "tok", p + "tok"
            if e == 1 and leak == "neighbour":  # the expert reads the next token's row (never run: refused)
                n.append(helper.make_node("Add", [p + "tok", "sel/one"], [p + "next"]))
                read = p + "next"
            if e == 1 and leak == "scatter_neighbour":  # the rows are added onto the next token
                n.append(helper.make_node("Add", [p + "tok", "sel/one"], [p + "next"]))
                write = p + "next"
            n += [
                helper.make_node("Gather", ["sel/x", read], [p + "in"], axis=0, name=f"dispatch{e}"),
                helper.make_node("MatMul", [p + "in", f"sel/w{e}"], [p + "out"]),
                helper.make_node("Mul", [p + "out", p + "w"], [p + "weighted"]),
            ]
            rows = p + "weighted"
            if e == 1 and leak == "position_value":  # each row's token index added to its value
                n.append(helper.make_node("Cast", [p + "tok"], [p + "tokf"], to=onnx.TensorProto.FLOAT))
                n.append(helper.make_node("Unsqueeze", [p + "tokf", "sel/ax1"], [p + "tokcol"]))
                n.append(helper.make_node("Add", [rows, p + "tokcol"], [p + "tainted"], name="position_as_value"))
                rows = p + "tainted"
            n += [
                helper.make_node("Unsqueeze", [write, "sel/ax1"], [p + "idxcol"]),
                helper.make_node("Shape", [rows], [p + "rshape"]),
                helper.make_node("Expand", [p + "idxcol", p + "rshape"], [p + "idx"]),
                helper.make_node(
                    "ConstantOfShape", ["sel/xshape"], [p + "zeros"], value=helper.make_tensor("z", 1, [1], [0])
                ),
                helper.make_node(
                    "ScatterElements", [p + "zeros", p + "idx", rows], [p + "back"], axis=0, name=f"index_add{e}"
                ),
                helper.make_node("Add", [acc, p + "back"], [p + "acc"]),
            ]
            acc = p + "acc"
        n += [
            helper.make_node("Reshape", [acc, "sel/back"], ["sel/y"]),
            helper.make_node("Add", [emb, "sel/y"], ["sel/out"]),
        ]
        return n, inits, "sel/out"

    return extra


def test_selection_dispatch_converts():
    """The probe itself is accepted (each leak below changes one thing of it). That the converted form gives each
    prompt batched what it gives alone is tests/rewriter/test_optimum_mla.py's, on optimum's own export."""
    assert convert(_probe(_eager_moe()), providers=()) is not None


@pytest.mark.parametrize(
    ("leak", "node", "reason"),
    [
        ("neighbour", "dispatch1", "reads rows of other tokens than those 'select1' selected"),
        ("scatter_neighbour", "index_add1", "onto other tokens than their own"),
        ("position_value", "position_as_value", "with their positions"),
    ],
)
def test_selection_leaks_are_refused_and_named(leak, node, reason):
    with pytest.raises(ConversionError, match="cannot be made per sequence") as info:
        convert(_probe(_eager_moe(leak)))
    assert any(repr(node) in where and reason in why for where, why in info.value.failures), info.value.failures
