"""Batched = alone for MoE dispatch: the per-sequence flow proves a sort-based dispatch undone, and refuses the
MoE-shaped leaks, naming them.

The probe is transformers' ``grouped_mm`` dispatch written by hand after a Llama fixture's embedding: route each
token to its top-2 of 4 experts, sort every (token, expert) row of the step by expert, run each expert on its
segment of the sorted rows (bounds from a histogram of the sorted ids, over the whole step), weight, put the rows
back through the inverse permutation and sum each token's two rows. The leaks change one thing each: a routing
normalised over every token of the step, a capacity per expert (rows past it dropped: tokens compete across
sequences), rows read from a neighbouring token, rows never put back in token order, a sort that drops a row.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from test_per_sequence import _prompts
from test_per_sequence_flow import LENGTHS, _assert_batched_equals_alone, _ints, _probe

from ortpa.errors import ConversionError
from ortpa.rewriter.pipeline import convert

EXPERTS, TOP_K = 4, 2


def _moe(leak: str | None = None):
    def extra(emb, hidden):
        rng = np.random.default_rng(7)
        f = np.float32
        inits = [
            numpy_helper.from_array(rng.standard_normal((hidden, EXPERTS)).astype(f), "moe/router"),
            numpy_helper.from_array(np.arange(EXPERTS + 1, dtype=np.int64).reshape(-1, 1), "moe/thresholds"),
            _ints("moe/rows", [-1, hidden]),
            _ints("moe/flat", [-1]),
            _ints("moe/k", [TOP_K]),
            _ints("moe/kk", TOP_K),
            _ints("moe/zero", 0),
            _ints("moe/one", 1),
            _ints("moe/ax0", [0]),
            _ints("moe/ax1", [1]),
            _ints("moe/from1", [1]),
            _ints("moe/big", [2**62]),
            _ints("moe/to_last", [-1]),
            _ints("moe/back", [1, -1, hidden]),
            _ints("moe/per_token", [-1, TOP_K, hidden]),
            _ints("moe/cap", 1),
        ]
        for e in range(EXPERTS):
            w = (rng.standard_normal((hidden, hidden)) / np.sqrt(hidden)).astype(f)
            inits.append(numpy_helper.from_array(w, f"moe/w{e}"))
        n = [
            helper.make_node("Reshape", [emb, "moe/rows"], ["moe/x"]),
            helper.make_node("MatMul", ["moe/x", "moe/router"], ["moe/logits"]),
            # the leak "batch_norm_routing": the routing normalised over every token of the step
            helper.make_node(
                "Softmax",
                ["moe/logits"],
                ["moe/probs"],
                axis=0 if leak == "batch_norm_routing" else -1,
                name="router_softmax",
            ),
            helper.make_node("TopK", ["moe/probs", "moe/k"], ["moe/topw", "moe/ids"], axis=-1),
            helper.make_node("Reshape", ["moe/ids", "moe/flat"], ["moe/flat_ids"]),
            helper.make_node("Reshape", ["moe/topw", "moe/flat"], ["moe/flat_w"]),
            helper.make_node("Shape", ["moe/flat_ids"], ["moe/n"]),
            # the leak "truncated_sort": the sort keeps all rows but one (which token loses depends on the others)
            helper.make_node("Sub", ["moe/n", "moe/one"], ["moe/n_minus_1"]),
            helper.make_node(
                "TopK",
                ["moe/flat_ids", "moe/n_minus_1" if leak == "truncated_sort" else "moe/n"],
                ["moe/sorted", "moe/perm"],
                largest=0,
                name="sort",
            ),
            helper.make_node("Div", ["moe/perm", "moe/kk"], ["moe/tok0"]),
        ]
        if leak == "neighbour":  # each sorted row reads the next token's hidden state (never run: refused)
            n += [helper.make_node("Add", ["moe/tok0", "moe/one"], ["moe/tok"])]
        else:
            n += [helper.make_node("Identity", ["moe/tok0"], ["moe/tok"])]
        n += [
            helper.make_node("Gather", ["moe/x", "moe/tok"], ["moe/xsorted"], axis=0, name="dispatch_gather"),
            # a histogram of the sorted ids: counts below each threshold, then per expert, then segment ends
            helper.make_node("Unsqueeze", ["moe/sorted", "moe/ax0"], ["moe/sorted_row"]),
            helper.make_node("Less", ["moe/sorted_row", "moe/thresholds"], ["moe/below"]),
            helper.make_node("Cast", ["moe/below"], ["moe/below_i"], to=onnx.TensorProto.INT64),
            helper.make_node("ReduceSum", ["moe/below_i", "moe/ax1"], ["moe/cum"], keepdims=0),
            helper.make_node("Slice", ["moe/cum", "moe/from1", "moe/big"], ["moe/ends"]),
            helper.make_node("Split", ["moe/ends"], [f"moe/end{e}_1" for e in range(EXPERTS)], axis=0, num_outputs=4),
        ]
        outs = []
        for e in range(EXPERTS):
            n.append(helper.make_node("Squeeze", [f"moe/end{e}_1"], [f"moe/end{e}"]))
            start = "moe/zero" if e == 0 else f"moe/end{e - 1}"
            end = f"moe/end{e}"
            if leak == "capacity":  # each expert takes at most `cap` rows: the others are dropped
                n.append(helper.make_node("Add", [start, "moe/cap"], [f"moe/capend{e}"]))
                n.append(helper.make_node("Min", [f"moe/capend{e}", end], [f"moe/cutend{e}"]))
                end = f"moe/cutend{e}"
            n += [
                helper.make_node("Range", [start, end, "moe/one"], [f"moe/seg{e}"]),
                helper.make_node("Gather", ["moe/xsorted", f"moe/seg{e}"], [f"moe/in{e}"], axis=0),
                helper.make_node("MatMul", [f"moe/in{e}", f"moe/w{e}"], [f"moe/out{e}"]),
            ]
            outs.append(f"moe/out{e}")
        n += [
            helper.make_node("Concat", outs, ["moe/ysorted"], axis=0, name="experts_concat"),
            helper.make_node("Gather", ["moe/flat_w", "moe/perm"], ["moe/wsorted"], axis=0),
            helper.make_node("Unsqueeze", ["moe/wsorted", "moe/ax1"], ["moe/wcol"]),
            helper.make_node("Mul", ["moe/ysorted", "moe/wcol"], ["moe/yw"]),
        ]
        if leak == "not_put_back":  # the sorted rows summed as if they were in token order
            n += [helper.make_node("Identity", ["moe/yw"], ["moe/ytok"], name="not_put_back")]
        else:
            n += [
                helper.make_node(
                    "ConstantOfShape",
                    ["moe/n"],
                    ["moe/zeros"],
                    value=helper.make_tensor("z", onnx.TensorProto.INT64, [1], [0]),
                ),
                helper.make_node("Squeeze", ["moe/n"], ["moe/n0"]),
                helper.make_node("Range", ["moe/zero", "moe/n0", "moe/one"], ["moe/arange"]),
                helper.make_node("Unsqueeze", ["moe/perm", "moe/ax1"], ["moe/perm_col"]),
                helper.make_node("ScatterND", ["moe/zeros", "moe/perm_col", "moe/arange"], ["moe/inverse"]),
                helper.make_node("Unsqueeze", ["moe/inverse", "moe/ax1"], ["moe/inverse_col"]),
                helper.make_node("GatherND", ["moe/yw", "moe/inverse_col"], ["moe/ytok"], name="undo"),
            ]
        n += [
            helper.make_node("Reshape", ["moe/ytok", "moe/per_token"], ["moe/y3"], name="per_token_rows"),
            helper.make_node("ReduceSum", ["moe/y3", "moe/ax1"], ["moe/y"], keepdims=0),
            helper.make_node("Reshape", ["moe/y", "moe/back"], ["moe/yb"]),
            helper.make_node("Add", [emb, "moe/yb"], ["moe/out"]),
        ]
        return n, inits, "moe/out"

    return extra


def test_sort_dispatch_converts_and_batched_equals_alone(tmp_path):
    """The flow shows the sorted rows put back, each on its own token: converted, and each prompt batched gives
    what it gives alone (ONNX Runtime on the dense probe)."""
    model = _probe(_moe())
    dense = tmp_path / "moe.onnx"
    onnx.save(model, str(dense))
    _assert_batched_equals_alone(convert(model), dense, prompts=_prompts(LENGTHS))


@pytest.mark.parametrize(
    ("leak", "node", "reason"),
    [
        ("batch_norm_routing", "router_softmax", "normalises across the token axis"),
        ("capacity", "experts_concat", "do not tile the rows sorted by the sort 'sort'"),
        ("neighbour", "dispatch_gather", "reads rows of other tokens"),
        ("not_put_back", "per_token_rows", "folds rows regrouped by the sort 'sort' together"),
        ("truncated_sort", "sort", "TopK keeps some rows of the whole step"),
    ],
)
def test_moe_leaks_are_refused_and_named(leak, node, reason):
    with pytest.raises(ConversionError, match="cannot be made per sequence") as info:
        convert(_probe(_moe(leak)))
    assert any(repr(node) in where and reason in why for where, why in info.value.failures), info.value.failures
