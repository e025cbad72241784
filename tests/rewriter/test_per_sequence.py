"""Batched = alone for values the dense graph computes over its whole seq axis (``ortpa.rewriter.per_sequence``).

Fixture ``phi3_longrope_sdpa_op18`` (``scripts/make_fixtures_mha.py``): a Phi-3.5-style LongRoPE model whose
export picks long or short RoPE factors with ``Where(ReduceMax(position_ids) + 1 > 32, long, short)``. Packed,
that max would cover every sequence of the step; converted, each sequence must get its own choice: a 5-token
prompt batched with a 45-token one (past 32 from its prefill) and a 28-token one (crossing 32 while decoding)
generates what each generates alone on the dense model. Positions computed from the cache length
(``Shape(past)[2] + Range(seq)``, transformers' ``cache_position``; the Llama fixture and the OnnxExporter decode
model with their ``position_ids`` input removed) become the packed positions. Near misses (a reduction across
tokens that the pass cannot make per sequence, the step's token count used as a number) are refused with the
node named.
"""

from __future__ import annotations

import hashlib
import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper
from support.parity import FIXTURES, run_parity
from support.tolerances import assert_close

from ortpa.errors import ConversionError
from ortpa.ops.validate import validate_model
from ortpa.parity.greedy import dense_greedy, paged_greedy
from ortpa.rewriter import per_sequence
from ortpa.rewriter.pipeline import convert
from ortpa.runtime.session import PagedSession

LONGROPE = FIXTURES / "phi3_longrope_sdpa_op18.onnx"
ORIGINAL_MAX = 32  # the fixture's original_max_position_embeddings
NEW_TOKENS = 8  # one packed prefill, then 7 continuously batched decode steps
PROMPT_LENGTHS = (5, 45, 28)  # under the threshold throughout / over it from the prefill / crossing it in decode


def _prompts(lengths=PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, 256, n)] for n in lengths]


def _dense(path=LONGROPE) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def _paged(converted: onnx.ModelProto) -> PagedSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    return PagedSession(converted, num_blocks=16, block_size=16, providers=["CPUExecutionProvider"], sess_options=opts)


def _assert_batched_equals_alone(converted: onnx.ModelProto, dense_path=LONGROPE, prompts=None) -> None:
    prompts = prompts or _prompts()
    alone = dense_greedy(_dense(dense_path), prompts, NEW_TOKENS)
    batched = paged_greedy(_paged(converted), prompts, NEW_TOKENS)
    for p, prompt in enumerate(prompts):
        what = f"prompt {p} ({len(prompt)} tokens)"
        assert_close(batched.logits[p], alone.logits[p], np.float16, what=what)
        assert batched.tokens[p] == alone.tokens[p], what


def test_longrope_batched_equals_alone():
    prompts = _prompts()
    # the fixture really has two regimes: the long prompt's total length crosses 32, the short one's never does,
    # and the 28-token one crosses it during decode
    assert [len(p) + NEW_TOKENS > ORIGINAL_MAX for p in prompts] == [False, True, True]
    assert len(prompts[2]) < ORIGINAL_MAX
    converted = convert(str(LONGROPE))
    report = validate_model(converted, backend="cuda")
    assert report.ok, report.format()
    _assert_batched_equals_alone(converted, prompts=prompts)


def test_longrope_needs_the_pass(monkeypatch):
    """Without the pass the short prompt is rotated with the long factors: far outside the fp16 tolerance."""
    monkeypatch.setattr(per_sequence, "per_sequence_reductions", lambda graph, io: [])
    with pytest.raises(AssertionError, match="prompt 0"):
        _assert_batched_equals_alone(convert(str(LONGROPE)))


def test_longrope_rewrite_reports_the_node():
    model = onnx.load(str(LONGROPE))
    (reduce_max,) = [n for n in model.graph.node if n.op_type == "ReduceMax"]
    seen: list[list[str]] = []
    real = per_sequence.per_sequence_reductions

    def spy(graph, io):
        seen.append(real(graph, io))
        return seen[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(per_sequence, "per_sequence_reductions", spy)
        first = convert(model)
    ((line,),) = seen
    assert reduce_max.name in line and "per sequence" in line
    # the rewrite is deterministic: converting again gives the same bytes
    digests = {hashlib.sha256(m.SerializeToString(deterministic=True)).hexdigest() for m in (first, convert(model))}
    assert len(digests) == 1


@pytest.mark.parametrize("fixture", ["llama_sdpa_op18", "qwen2_sliding_sdpa_op18", "dsv3_sdpa_op18"])
def test_graphs_without_step_wide_values_are_untouched(fixture, monkeypatch):
    path = str(FIXTURES / f"{fixture}.onnx")
    seen: list[list[str]] = []
    real = per_sequence.per_sequence_reductions
    monkeypatch.setattr(per_sequence, "per_sequence_reductions", lambda g, io: seen.append(real(g, io)) or seen[-1])
    with_pass = convert(path, providers=())
    monkeypatch.setattr(per_sequence, "per_sequence_reductions", lambda graph, io: [])
    without = convert(path, providers=())
    assert seen == [[]]
    digest = [hashlib.sha256(m.SerializeToString(deterministic=True)).hexdigest() for m in (with_pass, without)]
    assert digest[0] == digest[1]


# -- near misses: reductions across tokens the pass cannot make per sequence ----------------------------------------


def _node(model: onnx.ModelProto, op_type: str) -> onnx.NodeProto:
    return next(n for n in model.graph.node if n.op_type == op_type)


def _refused(model: onnx.ModelProto, node_name: str, reason: str) -> None:
    before = hashlib.sha256(model.SerializeToString()).hexdigest()
    with pytest.raises(ConversionError, match="cannot be made per sequence") as info:
        convert(model)
    assert hashlib.sha256(model.SerializeToString()).hexdigest() == before  # the input is never modified
    ((where, why),) = info.value.failures
    assert repr(node_name) in where and reason in why, info.value


def test_longrope_max_also_used_as_a_number_is_refused():
    """A dynamic-NTK-like scale: the step-wide max feeds arithmetic, not only the long/short condition."""
    model = onnx.load(str(LONGROPE))
    reduce_max, where = _node(model, "ReduceMax"), _node(model, "Where")
    (add,) = [n for n in model.graph.node if n.op_type == "Add" and reduce_max.output[0] in n.input]
    scaled = "near_miss/scaled_inv_freq"
    model.graph.node.extend(
        [
            helper.make_node("Cast", [add.output[0]], ["near_miss/length"], to=onnx.TensorProto.FLOAT),
            helper.make_node("Div", [where.output[0], "near_miss/length"], [scaled]),
        ]
    )
    for n in model.graph.node:
        if n.op_type == "Mul" and where.output[0] in n.input:
            n.input[list(n.input).index(where.output[0])] = scaled
    model = _toposorted(model)
    _refused(model, reduce_max.name, "used as a number")


def test_mean_over_tokens_becomes_per_sequence(tmp_path):
    """Subtracting (half) the mean over the seq axis from the embeddings: packed, that mean would mix every
    sequence's tokens; the flow's segment ops (``ortpa.rewriter.per_sequence.segments``) take each sequence's own
    mean."""
    model = onnx.load(str(FIXTURES / "llama_sdpa_op18.onnx"))
    gather = next(n for n in model.graph.node if n.op_type == "Gather" and "embed_tokens" in n.input[0])
    emb = gather.output[0]
    axes = helper.make_tensor("near_miss/axes", onnx.TensorProto.INT64, [1], [1])
    half = helper.make_tensor("near_miss/half", onnx.TensorProto.FLOAT, [], [0.5])
    model.graph.initializer.extend([axes, half])
    # half the mean: a one-token decode step alone would otherwise feed an all-zero hidden state
    nodes = [
        helper.make_node("ReduceMean", [emb, "near_miss/axes"], ["near_miss/mean"], name="token_mean", keepdims=1),
        helper.make_node("Mul", ["near_miss/mean", "near_miss/half"], ["near_miss/half_mean"]),
        helper.make_node("Sub", [emb, "near_miss/half_mean"], ["near_miss/centred"]),
    ]
    for n in model.graph.node:
        if emb in n.input:
            n.input[list(n.input).index(emb)] = "near_miss/centred"
    model.graph.node.extend(nodes)
    model = _toposorted(model)
    dense = tmp_path / "token_mean.onnx"
    onnx.save(model, str(dense))
    _assert_batched_equals_alone(convert(model), dense, prompts=_prompts((5, 11, 3)))


def test_mean_over_tokens_used_otherwise_is_refused():
    """The same mean fed to a MatMul (not broadcast back over the tokens): refused, naming the node."""
    model = onnx.load(str(FIXTURES / "llama_sdpa_op18.onnx"))
    gather = next(n for n in model.graph.node if n.op_type == "Gather" and "embed_tokens" in n.input[0])
    emb = gather.output[0]
    hidden = next(i for i in model.graph.initializer if i.name == gather.input[0]).dims[1]
    model.graph.initializer.extend(
        [
            helper.make_tensor("near_miss/axes", onnx.TensorProto.INT64, [1], [1]),
            onnx.numpy_helper.from_array(np.eye(hidden, dtype=np.float32), "near_miss/eye"),
        ]
    )
    nodes = [
        helper.make_node("ReduceMean", [emb, "near_miss/axes"], ["near_miss/mean"], name="token_mean", keepdims=1),
        helper.make_node("MatMul", ["near_miss/mean", "near_miss/eye"], ["near_miss/proj"]),
        helper.make_node("Sub", [emb, "near_miss/proj"], ["near_miss/centred"]),
    ]
    for n in model.graph.node:
        if emb in n.input:
            n.input[list(n.input).index(emb)] = "near_miss/centred"
    model.graph.node.extend(nodes)
    _refused(_toposorted(model), "token_mean", "keeps axes other than batch")


def test_token_count_used_as_a_value_is_refused():
    """Scaling the embeddings by the number of new tokens: packed, that is every sequence's tokens together."""
    model = onnx.load(str(FIXTURES / "llama_sdpa_op18.onnx"))
    gather = next(n for n in model.graph.node if n.op_type == "Gather" and "embed_tokens" in n.input[0])
    emb = gather.output[0]
    nodes = [
        helper.make_node("Shape", ["input_ids"], ["near_miss/n"], start=1, end=2),
        helper.make_node("Cast", ["near_miss/n"], ["near_miss/n_float"], name="count_as_float", to=1),
        helper.make_node("Mul", [emb, "near_miss/n_float"], ["near_miss/scaled"]),
    ]
    for n in model.graph.node:
        if emb in n.input:
            n.input[list(n.input).index(emb)] = "near_miss/scaled"
    model.graph.node.extend(nodes)
    _refused(_toposorted(model), "count_as_float", "number of tokens")


def _toposorted(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with its nodes in dependency order again (edits above append nodes at the end)."""
    import onnx_ir as ir

    irm = ir.serde.deserialize_model(model)
    irm.graph.sort()
    return ir.serde.serialize_model(irm)


# -- positions read from the cache length: past_len + Range(seq) -------------------------------------------------


def _positions_from_cache_length(form: str, fixture: str = "llama_sdpa_op18") -> onnx.ModelProto:
    """The fixture without a ``position_ids`` input: positions = Shape(past)[2] + Range(0, seq), as decode models
    that take no positions compute them (transformers' ``cache_position``), in one of the two forms exporters
    write: ``Add(Range(0, seq, 1), past)`` or ``Range(past, past + seq, 1)``."""
    model = onnx.load(str(FIXTURES / f"{fixture}.onnx"))
    g = model.graph
    for name, value in (("pos/zero", 0), ("pos/one", 1)):
        g.initializer.append(helper.make_tensor(name, onnx.TensorProto.INT64, [], [value]))
    g.initializer.append(helper.make_tensor("pos/axis0", onnx.TensorProto.INT64, [1], [0]))
    nodes = [
        helper.make_node("Shape", ["past_key_values.0.key"], ["pos/past1"], start=2, end=3),
        helper.make_node("Squeeze", ["pos/past1"], ["pos/past"]),
        helper.make_node("Shape", ["input_ids"], ["pos/seq1"], start=1, end=2),
        helper.make_node("Squeeze", ["pos/seq1"], ["pos/seq"]),
    ]
    if form == "add":
        nodes += [
            helper.make_node("Range", ["pos/zero", "pos/seq", "pos/one"], ["pos/arange"]),
            helper.make_node("Add", ["pos/arange", "pos/past"], ["pos/cache_position"]),
        ]
    else:
        nodes += [
            helper.make_node("Add", ["pos/past", "pos/seq"], ["pos/total"]),
            helper.make_node("Range", ["pos/past", "pos/total", "pos/one"], ["pos/cache_position"]),
        ]
    nodes.append(helper.make_node("Unsqueeze", ["pos/cache_position", "pos/axis0"], ["pos/position_ids"]))
    for n in g.node:
        n.input[:] = ["pos/position_ids" if x == "position_ids" else x for x in n.input]
    g.node.extend(nodes)
    g.input.remove(next(i for i in g.input if i.name == "position_ids"))
    return _toposorted(model)


@pytest.mark.parametrize(
    ("form", "fixture", "lengths"),
    [
        ("add", "llama_sdpa_op18", (5, 11, 3)),
        ("range", "llama_sdpa_op18", (5, 11, 3)),
        # LongRoPE's max then reads the positions derived from the cache length: both rewrites together
        ("add", "phi3_longrope_sdpa_op18", PROMPT_LENGTHS),
    ],
)
def test_positions_from_the_cache_length_become_packed_positions(form, fixture, lengths):
    model = _positions_from_cache_length(form, fixture)
    onnx.checker.check_model(model)
    converted = convert(model)
    assert "position_ids" not in {i.name for i in converted.graph.input}
    # the dense fixture (same weights, positions as an input) run alone is the reference
    _assert_batched_equals_alone(converted, FIXTURES / f"{fixture}.onnx", prompts=_prompts(lengths))


def test_positions_from_the_cache_length_need_the_pass(monkeypatch):
    """Unrewritten, the positions read the dense cache's length, which the paged graph no longer has."""
    monkeypatch.setattr(per_sequence, "per_sequence_reductions", lambda graph, io: [])
    with pytest.raises(ConversionError, match="dense inputs are still needed"):
        convert(_positions_from_cache_length("add"))


# -- transformers 5.x OnnxExporter decode model, positions from its own cache_position ---------------------------

ONNXEXPORTER = FIXTURES / "formats" / "onnxexporter_llama.onnx"


def _renamed_caches(model: onnx.ModelProto) -> onnx.ModelProto:
    """``input.cache.layers.{i}.keys`` -> ``past_key_values.{i}.key`` (outputs -> ``present.*``): the parity
    driver's names; the converter finds the caches by structure whatever their names."""
    rename = {}
    for v in [*model.graph.input, *model.graph.output]:
        m = re.fullmatch(r"(input|output)\.cache\.layers\.(\d+)\.(key|value)s", v.name)
        if m:
            rename[v.name] = f"{'past_key_values' if m[1] == 'input' else 'present'}.{m[2]}.{m[3]}"
            v.name = rename[v.name]
    for node in model.graph.node:
        node.input[:] = [rename.get(x, x) for x in node.input]
        node.output[:] = [rename.get(x, x) for x in node.output]
    return model


def _onnxexporter_positions_from_cache_position() -> onnx.ModelProto:
    """The OnnxExporter decode model with RoPE reading the exporter's own ``cache_position`` =
    ``Add(Range(0, Shape(input_ids)[1]), Shape(cache)[2])`` (what transformers uses when no ``position_ids`` is
    given) instead of its ``position_ids`` input, which is removed."""
    model = onnx.load(str(ONNXEXPORTER))
    g = model.graph
    consts = {i.name: onnx.numpy_helper.to_array(i) for i in g.initializer}
    ranges = {n.output[0] for n in g.node if n.op_type == "Range" and consts.get(n.input[0], -1) == 0}
    cache_position = next(n.output[0] for n in g.node if n.op_type == "Add" and set(n.input) & ranges)
    g.initializer.append(helper.make_tensor("pos/axis0", onnx.TensorProto.INT64, [1], [0]))
    for n in g.node:
        n.input[:] = ["pos/position_ids" if x == "position_ids" else x for x in n.input]
    g.node.append(helper.make_node("Unsqueeze", [cache_position, "pos/axis0"], ["pos/position_ids"]))
    g.input.remove(next(i for i in g.input if i.name == "position_ids"))
    return _toposorted(model)


def test_onnxexporter_cache_position_becomes_packed_positions(tmp_path):
    converted = convert(_onnxexporter_positions_from_cache_position())
    assert "position_ids" not in {i.name for i in converted.graph.input}
    reference = tmp_path / "onnxexporter_llama.reference.onnx"
    onnx.save(_renamed_caches(onnx.load(str(ONNXEXPORTER))), str(reference))  # takes position_ids: run alone
    result = run_parity(converted, reference, steps=8)
    assert result.tokens_checked == 24 and result.max_context >= 18


def test_onnxexporter_cache_position_needs_the_pass(monkeypatch):
    monkeypatch.setattr(per_sequence, "per_sequence_reductions", lambda graph, io: [])
    with pytest.raises(ConversionError, match="dense inputs are still needed"):
        convert(_onnxexporter_positions_from_cache_position())


def test_rope_in_op_refuses_longrope():
    """A cos/sin table evaluated for positions 0..rows-1 in one run would give every sequence the long
    factors (the short prompt is then off by ~4 in its logits): moving LongRoPE into the op is refused."""
    from ortpa.errors import ConversionError
    from ortpa.rewriter.pipeline import convert

    with pytest.raises(ConversionError) as info:
        convert(FIXTURES / "phi3_longrope_sdpa_op18.onnx", rope_in_op=True)
    assert "reduction over positions (ReduceMax)" in str(info.value)
