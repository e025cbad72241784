"""The portable lowering's fused decode path (``com.microsoft::MultiHeadAttention``) against the NumPy oracle.

The lowering decides per node whether decodes attend through ONNX Runtime's fused kernel; each branch is
checked against the oracle over seeded draws of shapes (heads ratio 1-8, head sizes 32-128, ragged batches with
a sequence past the local window, prompt chunks in the same step), and a batch against each of its sequences
run alone.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from support.tolerances import assert_close
from test_portable import BF16, check, make_case, run, session

from ortpa.ops.oracle import paged_attention
from ortpa.ops.portable import lower_to_portable, paged_attention_model
from ortpa.ops.spec import PAGED_ATTENTION


def _fused_ops(model: onnx.ModelProto) -> int:
    """MultiHeadAttention nodes in the lowered model's functions (inside If branches included)."""

    def count(nodes) -> int:
        n = 0
        for node in nodes:
            n += node.op_type == "MultiHeadAttention" and node.domain == "com.microsoft"
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    n += count(attr.g.node)
        return n

    return sum(count(f.node) for f in model.functions)


def _draw(seed: int) -> dict:
    """One seeded configuration: heads ratio 1-8, head size 32-128, a ragged step of decodes (one of them past
    the window when there is one) and sometimes a prompt chunk, RoPE, packed QKV, int8 caches, bfloat16."""
    rng = np.random.default_rng(seed)
    kvh = int(rng.choice([1, 2, 4]))
    group = int(rng.choice([1, 2, 3, 4, 8]))
    head_size = int(rng.choice([32, 64, 96, 128]))
    decodes = int(rng.integers(1, 6))
    pasts = [int(p) for p in rng.integers(0, 90, decodes)]
    q_lens = [1] * decodes
    kw: dict = {}
    if rng.random() < 0.5:
        kw["local_window_size"] = int(rng.integers(2, 24))
        pasts[0] = kw["local_window_size"] + 30  # a sequence whose window leaves out most of its keys
    if rng.random() < 0.4:  # a prompt chunk in the same step: the prefill group keeps the standard ops
        q_lens.append(int(rng.integers(2, 9)))
        pasts.append(int(rng.integers(0, 40)))
    if rng.random() < 0.5:
        kw["rotary"] = (head_size, bool(rng.random() < 0.5), 0)
    if rng.random() < 0.3:
        kw["packed"] = True
    if rng.random() < 0.2:
        kw["quant"] = ("int8", "PER_CHANNEL", "PER_TENSOR")
    dtype = BF16 if rng.random() < 0.3 else np.dtype(np.float16)
    return dict(
        dtype=dtype,
        num_heads=kvh * group,
        kv_num_heads=kvh,
        head_size=head_size,
        q_lens=tuple(q_lens),
        pasts=tuple(pasts),
        **kw,
    )


@pytest.mark.parametrize("seed", range(10))
def test_fused_decodes_match_the_oracle(seed: int) -> None:
    draw = _draw(seed)
    dtype = draw.pop("dtype")
    case = make_case(np.random.default_rng(seed), dtype, **draw)
    model = lower_to_portable(paged_attention_model(case.inputs, case.attrs))
    assert _fused_ops(model) == 1, "expected the fused decode path (one MultiHeadAttention)"
    check(case, model=model)


@pytest.mark.parametrize(
    "mode",
    [
        dict(softcap=2.5),
        dict(head_sink=True),
        dict(latent=True, num_heads=4, kv_num_heads=1, head_size=64, v_head_size=48),
    ],
    ids=["softcap", "head_sink", "latent"],
)
def test_modes_the_fused_kernel_cannot_express_keep_the_standard_ops(mode: dict) -> None:
    case = make_case(np.random.default_rng(5), np.float16, q_lens=(1, 1, 4), pasts=(20, 3, 9), **mode)
    model = lower_to_portable(paged_attention_model(case.inputs, case.attrs))
    assert _fused_ops(model) == 0
    check(case, model=model)


def test_unfused_lowering_is_standard_onnx_only() -> None:
    case = make_case(np.random.default_rng(6), np.float16, q_lens=(1, 1), pasts=(20, 3))
    model = lower_to_portable(paged_attention_model(case.inputs, case.attrs), fused=False)
    assert _fused_ops(model) == 0
    assert "com.microsoft" not in {n.domain for f in model.functions for n in f.node}
    check(case, model=model)


def test_a_decode_whose_keys_are_all_unmapped_is_a_zero_row() -> None:
    """The fused kernel returns NaN for a row with every key masked; the plan zeroes it, as the oracle does."""
    case = make_case(np.random.default_rng(7), np.float16, q_lens=(1, 1, 1), pasts=(10, 40, 5))
    case.inputs["block_table"][0, :] = -1  # sequence 0: every page unmapped, nothing written or attended
    got = check(case, model=lower_to_portable(paged_attention_model(case.inputs, case.attrs)))
    assert not got["output"][0].any()
    assert got["output"][1:].astype(np.float32).any(axis=1).all()


@pytest.mark.parametrize("window", [0, 6], ids=["no_window", "window"])
def test_fused_batched_equals_alone(window: int) -> None:
    """Each decode of a ragged batch (padded to the longest context, one past the window) gets bit for bit the
    output and cache rows it gets alone."""
    rng = np.random.default_rng(8)
    q_lens, pasts = (1, 1, 1, 1), (70, 2, 33, 15)
    case = make_case(rng, np.float16, num_heads=8, kv_num_heads=2, head_size=64, q_lens=q_lens, pasts=pasts,
                     rotary=(64, False, 0), local_window_size=window)  # fmt: skip
    x = case.inputs
    model = lower_to_portable(paged_attention_model(x, case.attrs))
    assert _fused_ops(model) == 1
    width = case.attrs["num_heads"] * 64
    batched = run(session(model), {**x, "_width": width})
    for i in range(len(q_lens)):
        alone = dict(x)
        for name in ("query", "key", "value"):
            alone[name] = x[name][i : i + 1]
        alone["cumulative_sequence_length"] = np.array([0, 1], np.int32)
        alone["past_seqlens"] = x["past_seqlens"][i : i + 1]
        alone["block_table"] = x["block_table"][i : i + 1]
        got = run(session(model), {**alone, "_width": width})
        np.testing.assert_array_equal(got["output"][0].view(np.uint16), batched["output"][i].view(np.uint16))
        exp = paged_attention(**{n: alone.get(n) for n in PAGED_ATTENTION.input_names}, **case.attrs)[0]
        assert_close(got["output"], exp, np.float16, what=f"sequence {i} alone")


def _with_constant_rope(model: onnx.ModelProto, x: dict, *, cast: bool = False) -> onnx.ModelProto:
    """``model`` with its cos/sin caches as initializers (as a converted model has them), not graph inputs.
    ``cast``: float32 initializers cast to T in the graph, the form ``ortpa convert`` writes for a float32 model."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for name in ("cos_cache", "sin_cache"):
        keep = [vi for vi in out.graph.input if vi.name != name]
        del out.graph.input[:]
        out.graph.input.extend(keep)
        if cast:  # float16 -> float32 is exact, so the cast back gives the same T table
            out.graph.initializer.append(onnx.numpy_helper.from_array(x[name].astype(np.float32), name + "_f32"))
            node = onnx.helper.make_node("Cast", [name + "_f32"], [name], to=onnx.TensorProto.FLOAT16)
            out.graph.node.insert(0, node)
            continue
        out.graph.initializer.append(onnx.numpy_helper.from_array(x[name].view(np.uint16), name))
        out.graph.initializer[-1].data_type = onnx.TensorProto.FLOAT16
    return out


@pytest.mark.parametrize(
    ("rotary", "cast"),
    [((64, False, 0), False), ((64, True, 0), False), ((32, False, 16), False), ((64, False, 0), True)],
    ids=["half", "interleaved", "partial", "half-cast"],
)
def test_rope_table_folded_from_initializers(rotary, cast) -> None:
    """Constant cos/sin caches: the layer's float32 table of every row is folded by ONNX Runtime into a constant,
    and the caches it writes are still bit for bit the oracle's (T arithmetic). ``cast``: the tables reach the op
    through a ``Cast`` of float32 initializers (a converted float32 model), which is as constant."""
    case = make_case(np.random.default_rng(9), np.float16, num_heads=4, kv_num_heads=2, head_size=64,
                     q_lens=(1, 5, 1), pasts=(30, 0, 7), rotary=rotary)  # fmt: skip
    x = case.inputs
    model = lower_to_portable(_with_constant_rope(paged_attention_model(x, case.attrs), x, cast=cast))
    layer = next(f for f in model.functions if not f.name.startswith("PagedAttentionPlan"))
    gathered = {n.input[0] for n in layer.node if n.op_type == "Gather"}
    assert not gathered & {"cos_cache", "sin_cache"}, "expected the folded table, not rows gathered per step"
    exp_out, exp_k, exp_v = paged_attention(**{n: x.get(n) for n in PAGED_ATTENTION.input_names}, **case.attrs)
    feeds = {k: v for k, v in x.items() if k not in ("cos_cache", "sin_cache")}
    got = run(session(model), {**feeds, "_width": exp_out.shape[1]})
    assert_close(got["output"], exp_out, np.float16, what="output")
    np.testing.assert_array_equal(got["key_cache_out"].view(np.uint16), exp_k.view(np.uint16))
    np.testing.assert_array_equal(got["value_cache_out"].view(np.uint16), exp_v.view(np.uint16))


def test_large_rope_tables_are_gathered_per_step() -> None:
    """A table past the fold limit (long-context models) is not folded: its rows are gathered each step."""
    case = make_case(np.random.default_rng(10), np.float16, q_lens=(1,), pasts=(3,), head_size=128,
                     rotary=(128, False, 0))  # fmt: skip
    x = dict(case.inputs)
    rows = (32 << 20) // (2 * 128 * 4) + 1
    x["cos_cache"] = np.ones((rows, 64), np.float16)
    x["sin_cache"] = np.zeros((rows, 64), np.float16)
    model = lower_to_portable(_with_constant_rope(paged_attention_model(x, case.attrs), x))
    layer = next(f for f in model.functions if not f.name.startswith("PagedAttentionPlan"))
    assert {"cos_cache", "sin_cache"} <= {n.input[0] for n in layer.node if n.op_type == "Gather"}


def _kernel_inputs(model: onnx.ModelProto, inputs: dict, op_type: str, tmp_path) -> list[list[list[int]]]:
    """The input shapes of every ``op_type`` kernel ONNX Runtime ran for ``inputs`` (its profiler's records,
    nodes inside If branches included)."""
    import json

    import onnxruntime as ort

    so = ort.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "profile")
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    width = sess.get_outputs()[0].shape[1]
    run(sess, {**inputs, "_width": width})
    events = json.loads(open(sess.end_profiling()).read())
    return [
        [list(next(iter(s.values()))) for s in e["args"]["input_type_shape"]]
        for e in events
        if e.get("cat") == "Node" and e["args"].get("op_name") == op_type and "input_type_shape" in e["args"]
    ]


@pytest.mark.parametrize(
    ("q_lens", "pasts", "decode_kernels"),
    [((4, 6), (0, 3), 0), ((1, 1), (9, 20), 1), ((5, 1), (0, 12), 1), ((0,), (5,), 0)],
    ids=["prefills_only", "decodes_only", "mixed", "zero_tokens"],
)
def test_multi_head_attention_never_runs_on_an_empty_batch(q_lens, pasts, decode_kernels, tmp_path) -> None:
    """ONNX Runtime 1.20-1.28's MultiHeadAttention divides by zero on an empty batch (SIGFPE, issue 40): the
    decode group runs only when one of its decodes attends a key, and its kernel never sees an empty input."""
    case = make_case(np.random.default_rng(11), np.float16, q_lens=q_lens, pasts=pasts, rotary=(32, False, 0))
    model = lower_to_portable(paged_attention_model(case.inputs, case.attrs))
    assert _fused_ops(model) == 1
    shapes = _kernel_inputs(model, case.inputs, "MultiHeadAttention", tmp_path)
    assert len(shapes) == decode_kernels, shapes  # one layer, one step: the kernel runs iff there are decodes
    assert all(all(d > 0 for d in shape) for call in shapes for shape in call), shapes
    check(case, model=model)
