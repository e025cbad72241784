"""Batched = alone for the probes of issue 21: one op inserted after a Llama fixture's token embedding.

The dataflow (``ortpa.rewriter.per_sequence.flow``) must find every value that depends on more than one packed
sequence, make it per sequence (learned absolute positions gathered with ``Range(0, seq_len, 1)``, the last
token ``x[:, -1:]`` broadcast back) or refuse it naming the node (fixed tokens picked from the step, a
contraction across tokens). Each modified dense model run alone by ONNX Runtime is the reference.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import helper, numpy_helper
from support.flow_spy import record_sink_kinds
from support.tolerances import assert_close
from test_per_sequence import FIXTURES, NEW_TOKENS, _paged, _prompts, _toposorted

from ortpa.errors import ConversionError
from ortpa.parity.greedy import dense_greedy, open_dense, paged_greedy
from ortpa.rewriter.per_sequence import segments as per_sequence_segments
from ortpa.rewriter.pipeline import convert

LLAMA = FIXTURES / "llama_sdpa_op18.onnx"
LENGTHS = (5, 11, 3)


GENAI_LLAMA = FIXTURES / "formats" / "genai_llama_fp32.onnx"  # the review: a genai builder Llama


def _assert_batched_equals_alone(converted: onnx.ModelProto, dense_path, prompts) -> None:
    """Each prompt alone on the dense model (ONNX Runtime, in its own format) against all of them batched."""
    dense = open_dense(dense_path, threads=2)
    alone = dense_greedy(dense.session, prompts, NEW_TOKENS, interface=dense.interface)
    batched = paged_greedy(_paged(converted), prompts, NEW_TOKENS)
    for p, prompt in enumerate(prompts):
        what = f"prompt {p} ({len(prompt)} tokens)"
        assert_close(batched.logits[p], alone.logits[p], np.float16, what=what)
        assert batched.tokens[p] == alone.tokens[p], what


def _probe(extra, base=LLAMA) -> onnx.ModelProto:
    """``base`` with ``extra(emb, hidden) -> (nodes, initializers, new_emb)`` spliced after the embedding."""
    model = onnx.load(str(base))
    gather = next(n for n in model.graph.node if n.op_type == "Gather" and "embed_tokens" in n.input[0])
    table = next(i for i in model.graph.initializer if i.name == gather.input[0])
    emb = gather.output[0]
    nodes, inits, out = extra(emb, int(table.dims[1]))
    for n in model.graph.node:
        if emb in n.input:
            n.input[:] = [out if x == emb else x for x in n.input]
    model.graph.node.extend(nodes)
    model.graph.initializer.extend(inits)
    return _toposorted(model)


def _ints(name, values):
    return helper.make_tensor(name, onnx.TensorProto.INT64, [len(values)] if isinstance(values, list) else [], values)


def _learned_positions(emb, hidden):
    table = np.random.default_rng(1).standard_normal((64, hidden)).astype(np.float32)
    inits = [
        numpy_helper.from_array(table, "probe/pos_table"),
        _ints("probe/zero", 0),
        _ints("probe/one", 1),
    ]
    nodes = [
        helper.make_node("Shape", ["input_ids"], ["probe/seq1"], start=1, end=2),
        helper.make_node("Squeeze", ["probe/seq1"], ["probe/seq"]),
        helper.make_node("Range", ["probe/zero", "probe/seq", "probe/one"], ["probe/arange"], name="learned_range"),
        helper.make_node("Gather", ["probe/pos_table", "probe/arange"], ["probe/pos_emb"]),
        helper.make_node("Add", [emb, "probe/pos_emb"], ["probe/out"]),
    ]
    return nodes, inits, "probe/out"


def _last_token(emb, hidden):
    inits = [_ints("probe/m1", [-1]), _ints("probe/big", [2**62]), _ints("probe/ax1", [1])]
    inits.append(numpy_helper.from_array(np.array(0.5, np.float32), "probe/half"))
    nodes = [
        helper.make_node("Slice", [emb, "probe/m1", "probe/big", "probe/ax1"], ["probe/last"], name="last_slice"),
        helper.make_node("Mul", ["probe/last", "probe/half"], ["probe/last_half"]),
        helper.make_node("Add", [emb, "probe/last_half"], ["probe/out"]),
    ]
    return nodes, inits, "probe/out"


def _first_token_gathered(emb, hidden):
    inits = [_ints("probe/i0", 0)]
    nodes = [
        helper.make_node("Gather", [emb, "probe/i0"], ["probe/first"], axis=1, name="fixed_token"),
        helper.make_node("Unsqueeze", ["probe/first", "probe/ax1"], ["probe/first1"]),
        helper.make_node("Add", [emb, "probe/first1"], ["probe/out"]),
    ]
    return nodes, [*inits, _ints("probe/ax1", [1])], "probe/out"


def _shifted_tokens(emb, hidden):
    """``x[:, 1:]``-like shift written as a Gather by ``Range(0, count) + 1``: each token reads the next one (a
    packed index that is not the identity; never run: refused before)."""
    inits = [_ints("probe/zero", 0), _ints("probe/one", 1)]
    nodes = [
        helper.make_node("Shape", ["input_ids"], ["probe/seq1"], start=1, end=2),
        helper.make_node("Squeeze", ["probe/seq1"], ["probe/seq"]),
        helper.make_node("Range", ["probe/zero", "probe/seq", "probe/one"], ["probe/arange"]),
        helper.make_node("Add", ["probe/arange", "probe/one"], ["probe/next"]),
        helper.make_node("Gather", [emb, "probe/next"], ["probe/shifted"], axis=1, name="shifted_tokens"),
        helper.make_node("Add", [emb, "probe/shifted"], ["probe/out"]),
    ]
    return nodes, inits, "probe/out"


def _token_gram(emb, hidden):
    """``emb @ (emb^T @ emb)``: every token's row mixed with every other's (linear attention without a mask)."""
    nodes = [
        helper.make_node("Transpose", [emb], ["probe/embT"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["probe/embT", emb], ["probe/gram"], name="token_gram"),
        helper.make_node("MatMul", [emb, "probe/gram"], ["probe/out"]),
    ]
    return nodes, [], "probe/out"


@pytest.mark.parametrize("base", [LLAMA, GENAI_LLAMA], ids=["dynamo_llama", "genai_llama"])
@pytest.mark.parametrize(
    ("extra", "rewrite"),
    [(_learned_positions, "Range(0, tokens, 1) -> each token's index"), (_last_token, "the step's last token")],
)
def test_probe_converts_and_batched_equals_alone(extra, rewrite, base, tmp_path):
    model = _probe(extra, base)
    dense = tmp_path / "probe.onnx"
    onnx.save(model, str(dense))
    seen: list[list[str]] = []
    real = per_sequence_segments.flow_rewrites
    with pytest.MonkeyPatch.context() as mp:
        import ortpa.rewriter.per_sequence.reductions as ps

        mp.setattr(ps, "flow_rewrites", lambda g, io, b, done: real(g, io, b, done) or seen.append(done) or [])
        converted = convert(model)
    assert any(rewrite in line for line in seen[0]), seen
    _assert_batched_equals_alone(converted, dense, prompts=_prompts(LENGTHS))


@pytest.mark.parametrize("extra", [_learned_positions, _last_token])
def test_probe_needs_the_rewrite(extra, tmp_path, monkeypatch):
    """Without the flow's rewrites, the probe converts silently and a batched prompt differs from alone."""
    import ortpa.rewriter.per_sequence.reductions as ps

    model = _probe(extra)
    dense = tmp_path / "probe.onnx"
    onnx.save(model, str(dense))
    monkeypatch.setattr(ps, "flow_rewrites", lambda g, io, b, done: [])
    with pytest.raises(AssertionError, match="prompt"):
        _assert_batched_equals_alone(convert(model), dense, prompts=_prompts(LENGTHS))


@pytest.mark.parametrize(
    ("extra", "node", "reason"),
    [
        (_first_token_gathered, "fixed_token", "picks fixed tokens"),
        (_token_gram, "token_gram", "both of its operands depend on the tokens"),
        (_shifted_tokens, "shifted_tokens", "regrouped across the step's tokens"),
    ],
)
def test_probe_mixing_sequences_is_refused(extra, node, reason):
    with pytest.raises(ConversionError, match="cannot be made per sequence") as info:
        convert(_probe(extra))
    assert any(repr(node) in where and reason in why for where, why in info.value.failures), info.value


def _unknown_op(emb, hidden):
    """A per-token Einsum the flow has no rule for: unknown is step-wide, so it is refused, not assumed."""
    nodes = [
        helper.make_node("Einsum", [emb, emb], ["probe/sq"], equation="bth,bth->bt", name="unknown_einsum"),
        helper.make_node("Unsqueeze", ["probe/sq", "probe/ax2"], ["probe/sq3"]),
        helper.make_node("Add", [emb, "probe/sq3"], ["probe/out"]),
    ]
    return nodes, [_ints("probe/ax2", [2])], "probe/out"


def test_an_op_without_a_rule_is_refused():
    with pytest.raises(ConversionError, match="cannot be made per sequence") as info:
        convert(_probe(_unknown_op))
    assert any("unknown_einsum" in where and "unknown is step-wide" in why for where, why in info.value.failures), (
        info.value
    )


# -- generated chains: per-token op families convert and stay batched = alone; cross-token ones are refused -------

_PER_TOKEN = {  # op -> builder of (nodes, inits) from x [B, T, H] to out [B, T, H]
    "tanh": lambda x, o, h: ([helper.make_node("Tanh", [x], [o])], []),
    "scale": lambda x, o, h: (
        [helper.make_node("Mul", [x, f"{o}/c"], [o])],
        [numpy_helper.from_array(np.full(h, 0.5, np.float32), f"{o}/c")],
    ),
    "softmax_hidden": lambda x, o, h: ([helper.make_node("Softmax", [x], [o], axis=-1)], []),
    "mean_hidden": lambda x, o, h: (
        [
            helper.make_node("ReduceMean", [x, f"{o}/ax"], [f"{o}/m"], keepdims=1),
            helper.make_node("Sub", [x, f"{o}/m"], [o]),
        ],
        [_ints(f"{o}/ax", [2])],
    ),
    "transpose_back": lambda x, o, h: (
        [
            helper.make_node("Transpose", [x], [f"{o}/t"], perm=[1, 0, 2]),
            helper.make_node("Transpose", [f"{o}/t"], [o], perm=[1, 0, 2]),
        ],
        [],
    ),
}
_SEGMENTS = {  # across the tokens, made per sequence by segment ops: must convert with batched = alone
    "cumsum_tokens": lambda x, o, h: (
        [
            helper.make_node("CumSum", [x, f"{o}/ax"], [f"{o}/c"]),
            helper.make_node("Mul", [f"{o}/c", f"{o}/s"], [o]),
        ],
        [_ints(f"{o}/ax", 1), numpy_helper.from_array(np.array(0.25, np.float32), f"{o}/s")],
    ),
    "max_tokens": lambda x, o, h: (  # half the max: x - max alone on one decode token would be all zeros
        [
            helper.make_node("ReduceMax", [x, f"{o}/ax"], [f"{o}/m"], keepdims=1),
            helper.make_node("Mul", [f"{o}/m", f"{o}/s"], [f"{o}/ms"]),
            helper.make_node("Sub", [x, f"{o}/ms"], [o]),
        ],
        [_ints(f"{o}/ax", [1]), numpy_helper.from_array(np.array(0.5, np.float32), f"{o}/s")],
    ),
    "sum_tokens_and_hidden": lambda x, o, h: (
        [
            helper.make_node("ReduceSum", [x, f"{o}/ax"], [f"{o}/m"], keepdims=1),
            helper.make_node("Mul", [f"{o}/m", f"{o}/s"], [f"{o}/ms"]),
            helper.make_node("Add", [x, f"{o}/ms"], [o]),
        ],
        [_ints(f"{o}/ax", [1, 2]), numpy_helper.from_array(np.array(1e-3, np.float32), f"{o}/s")],
    ),
}
_CROSS = {  # each token reads others and no segment op applies: must be refused
    "softmax_tokens": lambda x, o, h: ([helper.make_node("Softmax", [x], [o], axis=1)], []),
    "prod_tokens": lambda x, o, h: (
        [
            helper.make_node("ReduceProd", [x, f"{o}/ax"], [f"{o}/m"], keepdims=1),
            helper.make_node("Add", [x, f"{o}/m"], [o]),
        ],
        [_ints(f"{o}/ax", [1])],
    ),
}


def _chain(ops: list[str]):
    def extra(emb, hidden):
        nodes, inits, x = [], [], emb
        for i, name in enumerate(ops):
            make = {**_PER_TOKEN, **_SEGMENTS, **_CROSS}[name]
            n, init = make(x, f"chain{i}/out", hidden)
            nodes += n
            inits += init
            x = f"chain{i}/out"
        return nodes, inits, x

    return extra


@settings(max_examples=8, deadline=None, derandomize=True)
@given(st.lists(st.sampled_from(sorted(_PER_TOKEN) + sorted(_SEGMENTS) + sorted(_CROSS)), min_size=1, max_size=3))
def test_generated_chains_are_refused_or_batched_equal_alone(ops):
    import tempfile
    from pathlib import Path

    model = _probe(_chain(ops))
    if any(op in _CROSS for op in ops):
        with pytest.raises(ConversionError, match="cannot be made per sequence"):
            convert(model)
        return
    with tempfile.TemporaryDirectory() as tmp:
        dense = Path(tmp) / "chain.onnx"
        onnx.save(model, str(dense))
        _assert_batched_equals_alone(convert(model), dense, prompts=_prompts(LENGTHS))


# -- the flow follows real exports to their ends -----------------------------------------------------------------

FORMATS = FIXTURES / "formats"


@pytest.mark.parametrize(
    "path",
    [
        FORMATS / "genai_qwen3_fp16.onnx",  # q/k norms fold heads into the token axis: blocked axes
        FORMATS / "optimum_llama.onnx",  # RoPE from position_ids through a MatMul with inv_freq
        FORMATS / "genai_gptoss_fp32.onnx",  # com.microsoft::MoE, sinks
        FIXTURES / "dsv3_moe_sdpa_op18.onnx",  # MLA + transformers' sort-based MoE dispatch, shown undone
        FIXTURES / "dsv3_moe3_sdpa_op18.onnx",  # the same in two consecutive layers: routed rows feed attention
        FIXTURES / "dsv3_moe3_batched_op18.onnx",  # transformers' batched_mm: each row times its expert's matrix
    ],
    ids=lambda x: getattr(x, "stem", str(x)),
)
def test_the_flow_reaches_every_sink_per_token(path, monkeypatch):
    """Every PagedAttention input and the logits come out per token or constant: nothing is lost on the way, and
    no regrouped row (MoE dispatch) reaches a sink without the flow showing it put back on its own token."""
    seen = record_sink_kinds(monkeypatch)
    convert(path, providers=())
    assert seen[-1] <= {"token", "const"}, seen
    assert "token" in seen[-1]
