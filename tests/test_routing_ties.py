"""Routing ties (ortpa.parity.routing): a float16 router whose k-th and (k+1)-th expert scores are closer than the
deployed precision tells apart may pick other experts in the deployed model; that step is excused like a greedy tie
(reported, counted against the same allowance), a routing change at a wide margin is not.

The tie width is the tie rule's: 2 * 2 * sqrt(2**-11) = 0.0884 for float16 (ortpa.tolerances.routing_tie_width).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from ortpa.parity.greedy import GreedyRun
from ortpa.parity.routing import Router, find_routers, routing_tie_steps
from ortpa.parity.rule import StructureResult, Verdict, judge_precision
from ortpa.tolerances import routing_tie_width

R1 = Router("groups", "g_scores", "g_idx", -1, True)
R2 = Router("experts", "e_scores", "e_idx", -1, True)


def test_the_tie_width_is_the_tie_rules_margin():
    assert routing_tie_width("float16", np.array([0.9, 0.6])) == pytest.approx(4 * np.sqrt(2.0**-11))


def _router_graph() -> onnx.ModelProto:
    """x -> MatMul -> Sigmoid -> TopK (indices -> GatherElements): a router; a TopK over a weight (not data) and a
    TopK whose indices select nothing (values only, as DeepSeek-V3's top-2-per-group sum): not routers."""
    w = numpy_helper.from_array(np.ones((4, 3), np.float32), "w")
    k = numpy_helper.from_array(np.array([2], np.int64), "k")
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["logits"]),
        helper.make_node("Sigmoid", ["logits"], ["scores"]),
        helper.make_node("TopK", ["scores", "k"], ["top", "chosen"], name="router", axis=-1),
        helper.make_node("Cast", ["chosen"], ["chosen64"], to=TensorProto.INT64),
        helper.make_node("GatherElements", ["scores", "chosen64"], ["weights"], axis=1),
        helper.make_node("TopK", ["w", "k"], ["wtop", "widx"], name="of_a_weight", axis=-1),
        helper.make_node("GatherElements", ["w", "widx"], ["wsel"], axis=1),
        helper.make_node("TopK", ["scores", "k"], ["vals", "unused"], name="values_only", axis=-1),
        helper.make_node("ReduceSum", ["vals"], ["total"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", 4])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("weights", "wsel", "total")],
        [w, k],
    )
    return helper.make_model(graph)


def test_routers_are_found_by_structure():
    assert find_routers(_router_graph()) == [Router("router", "scores", "chosen", -1, True)]


def _probed(*steps: dict) -> GreedyRun:
    """One prompt, one step per dict of probed values."""
    return GreedyRun([[0] * len(steps)], [np.zeros((len(steps), 2), np.float32)], 0.0, len(steps), [list(steps)])


def _step(g_idx, e_scores, e_idx, g_scores=((1.0, 0.0),)):
    return {
        "g_scores": np.array(g_scores, np.float32),
        "g_idx": np.array(g_idx),
        "e_scores": np.array(e_scores, np.float32),
        "e_idx": np.array(e_idx),
    }


NEAR = [[0.9, 0.6391, 0.6388, 0.1]]  # the 2nd and 3rd experts 3e-4 apart: below float16's tie width
WIDE = [[0.9, 0.8, 0.1, 0.0]]  # 0.7 apart


@pytest.mark.parametrize(
    "original,deployed,tie",
    [
        (_step([[0]], NEAR, [[0, 1]]), _step([[0]], NEAR, [[0, 2]]), True),  # a near-tie swapped
        (_step([[0]], WIDE, [[0, 1]]), _step([[0]], WIDE, [[0, 2]]), False),  # a wide-margin change: judged
        (_step([[0]], NEAR, [[0, 1]]), _step([[0]], NEAR, [[1, 0]]), False),  # the same experts, in another order
        # the one taken instead is near the k-th, but the one dropped was the top (0.9): no tie
        (_step([[0]], NEAR, [[0, 1]]), _step([[0]], NEAR, [[1, 2]]), False),
        # the groups router comes first and differs at a wide margin: the experts' near-tie after it excuses nothing
        (_step([[0]], NEAR, [[0, 1]]), _step([[1]], NEAR, [[0, 2]]), False),
        # a near-tie of the groups (first) explains a wide change of the experts after it
        (
            _step([[0]], WIDE, [[0, 1]], g_scores=((0.5, 0.4999),)),
            _step([[1]], WIDE, [[2, 3]], g_scores=((0.5, 0.4999),)),
            True,
        ),
    ],
    ids=["near", "wide", "same-set", "dropped-top", "wide-first", "near-first"],
)
def test_a_step_is_a_routing_tie_only_at_a_near_tie_of_its_first_difference(original, deployed, tie):
    assert routing_tie_steps(_probed(original), _probed(deployed), [R1, R2], "float16") == ({(0, 0)} if tie else set())


def _runs(shift_steps: int):
    """An original of 1 prompt x 4 steps and a deployed run whose first ``shift_steps`` steps' logits move by one
    nat on one token (KL far past float16's bound, the greedy token unchanged)."""
    ref = np.tile(np.array([[4.0, 1.0, 0.0, -1.0]], np.float32), (4, 1))
    got = ref.copy()
    got[:shift_steps, 1] += 1.0
    return GreedyRun([[0] * 4], [ref], 0.0, 4), GreedyRun([[0] * 4], [got], 0.0, 4)


def test_a_routing_tie_is_reported_not_judged_and_counted_as_a_tie():
    want, got = _runs(1)
    assert not judge_precision(want, got, "float16").ok  # the step's KL refuses it...
    p = judge_precision(want, got, "float16", {(0, 0)})  # ...unless a routing tie explains it
    assert p.ok and p.routing_ties == 1 and p.routing_tie_steps == ((0, 0),) and p.tokens_checked == 3
    assert p.routing_tie_kl_max > p.kl_bound > p.kl_max
    verdict = Verdict(StructureResult(True, "float32", True, 0.0, 0.0, 1.0), p)
    assert verdict.metadata()["ortpa.verify.routing_ties"] == "1"
    assert "1 routing tie(s) excused (steps [(0, 0)]" in verdict.format()
    # the allowance is the token ties' (one per run of < 100 tokens): two routing ties are too many
    want, got = _runs(2)
    assert not judge_precision(want, got, "float16", {(0, 0), (0, 1)}).ok


@pytest.mark.slow
def test_the_deepseek_v3_sweep_draw_with_a_router_near_tie_is_verified(tmp_path, monkeypatch):
    """Sweep draw deepseek_v3 seed 1 (5 layers, MoE x4, a float16 checkpoint), MLA prefill expanded: at decode step 2
    of its 19-token verification prompt the last MoE layer's router swaps two experts 3e-4 apart (KL 6e-2 at that
    step). Verified with the routing tie counted; refused when routing ties are not looked for."""
    import ortpa
    import ortpa.parity.verify as verify
    from ortpa.errors import ConversionError
    from ortpa.export.hf import export_hf
    from ortpa.testing.sweep.run import _save_checkpoint
    from ortpa.testing.sweep.space import draw

    d = draw("deepseek_v3", 1)
    _save_checkpoint(d, tmp_path / "ckpt")
    dense = tmp_path / "dense" / "model.onnx"
    export_hf(tmp_path / "ckpt", dense, random_weights=False, attn_implementation=d.attn_implementation)
    result = ortpa.convert_file(dense, tmp_path / "paged" / "model.onnx", mla_prefill="expanded")
    verdict = result.verification.verdict
    p = verdict.precision
    assert p.ok and p.routing_ties >= 1 and p.routing_tie_kl_max > p.kl_bound
    # its layers' outputs are heads-first ([1, heads, tokens, d]: the dynamo export's view before the transpose);
    # the probe finds the token axis and locates nothing in this correct conversion (it said layer 0, 3.17, before)
    from ortpa.parity.twin import float32_original, float32_twin
    from ortpa.parity.verify import first_diverging_layer, verification_prompts

    original_twin = float32_original(dense)
    twin = float32_twin(tmp_path / "paged" / "model.onnx", upcast=True, original=original_twin)
    where = first_diverging_layer(original_twin, twin.model, verification_prompts([])[1], verdict.structure.tolerance)
    assert where.startswith("none of 5 layers"), where
    monkeypatch.setattr(verify, "routing_ties", lambda *a, **k: (set(), 0))
    with pytest.raises(ConversionError, match="precision costs more than the rule allows"):
        ortpa.convert_file(dense, tmp_path / "again" / "model.onnx", mla_prefill="expanded")


def test_the_first_layer_probe_joins_chunks_along_the_token_axis():
    """A layer output ``[1, heads, tokens, d]`` (heads before tokens) from a 1-token chunk and an 18-token chunk
    joins into the rows of the 19-token prefill; where heads are as many as tokens, the runs' shapes together still
    tell the token axis; a value whose token axis cannot be told is not compared."""
    from ortpa.parity.locate import _token_axis, _token_rows

    whole = np.random.default_rng(0).standard_normal((1, 8, 19, 16)).astype(np.float32)
    rows = np.moveaxis(whole, 2, 0).reshape(19, -1)  # token t's row: every head's d values at t
    mine, joined = _token_rows(whole, [whole[:, :, :1], whole[:, :, 1:]], 19, [1, 18])
    np.testing.assert_array_equal(mine, rows)
    np.testing.assert_array_equal(joined, rows)
    eight = whole[:, :, :8]  # 8 heads, 8 tokens: the chunks of 1 and 7 tokens say which axis
    assert _token_axis([eight.shape, (1, 8, 1, 16), (1, 8, 7, 16)], [8, 1, 7]) == 2
    assert _token_axis([eight.shape], [8]) is None  # alone, it cannot tell
    assert _token_rows(eight, [eight[:, :, :1], eight[:, :, 1:]], 8, [1, 7]) is not None
    assert _token_rows(eight[0], [eight[:, :, :1], eight[:, :, 1:]], 8, [1, 7]) is None  # ranks differ, 8 twice


FIXTURES = Path(__file__).parent / "fixtures"
DSV2LITE_MOE = FIXTURES / "dsv2lite_moe_sdpa_op18.onnx"  # softmax routing, the dispatch sorts the chosen ids
DSV3_MOE = FIXTURES / "dsv3_moe_sdpa_op18.onnx"  # group-limited routing


def test_routers_of_dynamo_exports():
    """DeepSeek-V3's two TopKs per MoE layer (groups, then experts; not the top-2-per-group sum's), DeepSeek-V2-Lite's
    one (not the dispatch's sort of the chosen expert ids, a TopK over integers)."""
    v3 = find_routers(onnx.load(str(DSV3_MOE), load_external_data=False))
    assert [(r.scores, r.largest) for r in v3] == [("sum_1", True), ("masked_fill", True)]
    v2 = find_routers(onnx.load(str(DSV2LITE_MOE), load_external_data=False))
    assert [r.node for r in v2] == ["node_topk__1"]


def _nudged(model: onnx.ModelProto, offsets: np.ndarray) -> onnx.ModelProto:
    """``model`` with ``offsets`` (one per expert) added to its router's scores before its TopK."""
    from ortpa.testing.defects import _sorted

    (router,) = find_routers(model)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    node = next(n for n in out.graph.node if n.op_type == "TopK" and n.output[1] == router.indices)
    out.graph.initializer.append(numpy_helper.from_array(offsets.astype(np.float32), "nudge"))
    out.graph.node.append(helper.make_node("Add", [router.scores, "nudge"], ["nudged"]))
    node.input[0] = "nudged"
    return _sorted(out)


def test_routing_ties_through_the_probed_graphs(tmp_path):
    """The original and its conversion probed, teacher-forced: scores moved by less than float16's tie width
    (offsets in [0, 0.05)) swap only experts within that of each other: routing ties; the scores negated change
    routing at a wide margin: none."""
    from ortpa.conversion import convert_file
    from ortpa.parity.greedy import dense_greedy, open_dense
    from ortpa.parity.locate import lean_options
    from ortpa.parity.routing import routing_ties
    from ortpa.parity.verify import verification_prompts
    from ortpa.testing.defects import routing

    converted = tmp_path / "paged" / "paged.onnx"
    convert_file(DSV2LITE_MOE, converted, verify=False)
    prompts = verification_prompts([])
    dense = open_dense(DSV2LITE_MOE)
    follow = dense_greedy(dense.session, prompts, 3, interface=dense.interface).tokens
    del dense
    model = onnx.load(str(converted))

    def ties(deployed: onnx.ModelProto):
        path = tmp_path / "deployed.onnx"
        onnx.save(deployed, str(path))
        options = dict(original_options=lean_options(), paged_options=lean_options(), blocks=8, block_size=16)
        return routing_ties(DSV2LITE_MOE, path, prompts, follow, 3, "float16", **options)

    assert ties(model) == (set(), 1)  # routed the same: nothing to excuse
    near, routers = ties(_nudged(model, 0.05 * np.random.default_rng(0).random(4)))
    assert routers == 1 and near  # the fixture has rows that close: (1, 0) and (1, 1)
    assert ties(routing(model)) == (set(), 1)
