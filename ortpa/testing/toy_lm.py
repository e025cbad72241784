"""A tiny paged language model with the converted-model interface, for tests, demos and benchmarks.

The graph is what :func:`ortpa.convert` produces for a small MHA/GQA decoder, built directly with
``onnx.helper`` so no download or export is needed (names as in docs/converted_model.md)::

    input_ids [T] ──Gather(embedding)──► x [T, D]            (+ Gather(pos_embedding, position_ids) if asked)
    per layer i:  q, k, v = x @ Wq, x @ Wk, x @ Wv ──Cast fp16──► com.microsoft::PagedAttention (SEPARATE,
                  RoPE in-op) with past_key_values.{i}.key/.value ──► present.{i}.key/.value (aliased)
                  x = x + Cast_fp32(attn) @ Wo
    logits = x[last token of each sequence] @ W_lm  [B, vocab]        (or every token, [T, vocab]; or the rows
                                                                      an optional `logits_indices` input names)

Weights are float32 and seeded; activations are cast to float16 at the attention boundary because the op's
``T`` is float16/bfloat16 only. :func:`toy_lm_reference` recomputes the same model densely in NumPy (no
paging, no cache) so the paged run can be checked against it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = ["ToyLMConfig", "ToyLMWeights", "build_toy_lm", "toy_lm_reference", "toy_lm_weights"]


@dataclass(frozen=True)
class ToyLMConfig:
    """Shape and options of the toy model. ``hidden`` must be ``num_heads * head_size``."""

    vocab: int = 64
    hidden: int = 64
    num_heads: int = 4
    kv_heads: int = 2  # GQA: 2 query heads per KV head
    num_layers: int = 2
    max_positions: int = 1024  # rows of the RoPE cos/sin tables: the longest sequence the model can run
    # one row per sequence, one per packed token, or "indices": the rows `logits_indices` names (default: "last")
    logits: Literal["last", "all", "indices"] = "last"
    position_ids: bool = False  # add a learned position embedding fed by an optional `position_ids` input
    attention_metadata: bool = True  # declare the optional `attention_metadata` input
    seed: int = 0

    @property
    def head_size(self) -> int:
        return self.hidden // self.num_heads


@dataclass(frozen=True)
class ToyLMWeights:
    """float32 weights; per-layer lists are indexed by layer."""

    embedding: np.ndarray  # [vocab, D]
    pos_embedding: np.ndarray | None  # [max_positions, D]
    wq: list[np.ndarray] = field(default_factory=list)  # [D, N*H]
    wk: list[np.ndarray] = field(default_factory=list)  # [D, KVH*H]
    wv: list[np.ndarray] = field(default_factory=list)  # [D, KVH*H]
    wo: list[np.ndarray] = field(default_factory=list)  # [N*H, D]
    lm_head: np.ndarray | None = None  # [D, vocab]
    cos: np.ndarray | None = None  # [max_positions, H/2] float16
    sin: np.ndarray | None = None


def toy_lm_weights(config: ToyLMConfig) -> ToyLMWeights:
    """Seeded random weights scaled so activations and logits stay O(1) through the layers."""
    if config.hidden % config.num_heads or config.num_heads % config.kv_heads:
        raise ValueError(
            f"ToyLMConfig: expected hidden % num_heads == 0 and num_heads % kv_heads == 0, found hidden "
            f"{config.hidden}, num_heads {config.num_heads}, kv_heads {config.kv_heads}"
        )
    rng = np.random.default_rng(config.seed)
    d, h = config.hidden, config.head_size
    scale = 1.0 / np.sqrt(d)

    def mat(rows: int, cols: int, s: float = scale) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * s).astype(np.float32)

    layers = range(config.num_layers)
    half = h // 2
    inv_freq = 1.0 / (10000.0 ** (np.arange(half) / half))
    angles = np.arange(config.max_positions)[:, None] * inv_freq[None, :]
    return ToyLMWeights(
        embedding=mat(config.vocab, d, 1.0),
        pos_embedding=mat(config.max_positions, d, 0.5) if config.position_ids else None,
        wq=[mat(d, config.num_heads * h) for _ in layers],
        wk=[mat(d, config.kv_heads * h) for _ in layers],
        wv=[mat(d, config.kv_heads * h) for _ in layers],
        wo=[mat(config.num_heads * h, d) for _ in layers],
        lm_head=mat(d, config.vocab, 2.0 * scale),  # a little spread, so greedy picks are rarely near ties
        cos=np.cos(angles).astype(np.float16),
        sin=np.sin(angles).astype(np.float16),
    )


def build_toy_lm(config: ToyLMConfig | None = None, weights: ToyLMWeights | None = None) -> onnx.ModelProto:
    """The paged toy model as an ``onnx.ModelProto`` (opset 21 + com.microsoft 1), cache dims symbolic."""
    config = config or ToyLMConfig()
    w = weights or toy_lm_weights(config)
    h, kvh = config.head_size, config.kv_heads
    f32, f16, i32, i64 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.INT32, TensorProto.INT64
    inits = [
        numpy_helper.from_array(w.embedding, "embedding"),
        numpy_helper.from_array(w.lm_head, "lm_head"),
        numpy_helper.from_array(w.cos, "cos_cache"),
        numpy_helper.from_array(w.sin, "sin_cache"),
    ]
    inputs = [
        helper.make_tensor_value_info("input_ids", i64, ["num_tokens"]),
        helper.make_tensor_value_info("cumulative_sequence_lengths", i32, ["batch_size_plus_1"]),
        helper.make_tensor_value_info("past_sequence_lengths", i32, ["batch_size"]),
        helper.make_tensor_value_info("block_table", i32, ["batch_size", "max_blocks_per_sequence"]),
    ]
    if config.attention_metadata:
        inputs.append(helper.make_tensor_value_info("attention_metadata", i32, [3]))
    nodes = [helper.make_node("Gather", ["embedding", "input_ids"], ["x0"], name="embed")]
    x = "x0"
    if config.position_ids:
        inputs.append(helper.make_tensor_value_info("position_ids", i64, ["num_tokens"]))
        inits.append(numpy_helper.from_array(w.pos_embedding, "pos_embedding"))
        nodes += [
            helper.make_node("Gather", ["pos_embedding", "position_ids"], ["pos"], name="embed_pos"),
            helper.make_node("Add", ["x0", "pos"], ["x0p"], name="add_pos"),
        ]
        x = "x0p"
    outputs = []
    cache_shape = ["num_blocks", "block_size", kvh, h]
    for i in range(config.num_layers):
        for name, arr in (("wq", w.wq[i]), ("wk", w.wk[i]), ("wv", w.wv[i]), ("wo", w.wo[i])):
            inits.append(numpy_helper.from_array(arr, f"layers.{i}.{name}"))
        for proj in ("q", "k", "v"):
            nodes += [
                helper.make_node("MatMul", [x, f"layers.{i}.w{proj}"], [f"{proj}{i}"], name=f"layers.{i}.{proj}_proj"),
                helper.make_node("Cast", [f"{proj}{i}"], [f"{proj}{i}_h"], to=f16, name=f"layers.{i}.{proj}_cast"),
            ]
        op_inputs = [
            f"q{i}_h",
            f"k{i}_h",
            f"v{i}_h",
            f"past_key_values.{i}.key",
            f"past_key_values.{i}.value",
            "cumulative_sequence_lengths",
            "past_sequence_lengths",
            "block_table",
            "cos_cache",
            "sin_cache",
        ]
        if config.attention_metadata:
            op_inputs += [""] * 6 + ["attention_metadata"]  # slot_mapping .. v_scale omitted
        nodes.append(
            helper.make_node(
                "PagedAttention",
                op_inputs,
                [f"attn{i}_h", f"present.{i}.key", f"present.{i}.value"],
                name=f"layers.{i}.attn",
                domain="com.microsoft",
                num_heads=config.num_heads,
                kv_num_heads=kvh,
                do_rotary=1,
            )
        )
        nodes += [
            helper.make_node("Cast", [f"attn{i}_h"], [f"attn{i}"], to=f32, name=f"layers.{i}.attn_cast"),
            helper.make_node("MatMul", [f"attn{i}", f"layers.{i}.wo"], [f"o{i}"], name=f"layers.{i}.o_proj"),
            helper.make_node("Add", [x, f"o{i}"], [f"x{i + 1}"], name=f"layers.{i}.residual"),
        ]
        x = f"x{i + 1}"
        for kind in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past_key_values.{i}.{kind}", f16, cache_shape))
            outputs.append(helper.make_tensor_value_info(f"present.{i}.{kind}", f16, cache_shape))
    if config.logits == "last":
        # row of each sequence's last new token: cumulative_sequence_lengths[1:] - 1
        nodes += [
            helper.make_node("Slice", ["cumulative_sequence_lengths", "one_i64", "big_i64"], ["ends"], name="ends"),
            helper.make_node("Sub", ["ends", "one_i32"], ["last_idx"], name="last_idx"),
            helper.make_node("Gather", [x, "last_idx"], ["hidden_last"], name="gather_last"),
            helper.make_node("MatMul", ["hidden_last", "lm_head"], ["logits"], name="lm_head"),
        ]
        inits += [
            numpy_helper.from_array(np.array(1, np.int32), "one_i32"),
            numpy_helper.from_array(np.array([1], np.int64), "one_i64"),
            numpy_helper.from_array(np.array([np.iinfo(np.int64).max], np.int64), "big_i64"),
        ]
        logits_dims = ["batch_size", config.vocab]
    elif config.logits == "indices":
        # the converter's form (ortpa.rewriter.paged_io): logits_indices when fed, else each sequence's last token
        inputs.append(helper.make_tensor_value_info("logits_indices", i64, ["num_logits"]))
        nodes += [
            helper.make_node("Slice", ["cumulative_sequence_lengths", "one_i64", "big_i64"], ["ends"], name="ends"),
            helper.make_node("Cast", ["ends"], ["ends_i64"], to=i64, name="ends_i64"),
            helper.make_node("Sub", ["ends_i64", "one_i64"], ["last_idx"], name="last_idx"),
            helper.make_node("Size", ["logits_indices"], ["n_asked"], name="n_asked"),
            helper.make_node("Equal", ["n_asked", "zero_i64"], ["none_asked"], name="none_asked"),
            helper.make_node("Cast", ["none_asked"], ["none_i64"], to=i64, name="none_i64"),
            helper.make_node("Size", ["last_idx"], ["n_last"], name="n_last"),
            helper.make_node("Mul", ["none_i64", "n_last"], ["n_default"], name="n_default"),
            helper.make_node("Add", ["n_asked", "n_default"], ["n_rows"], name="n_rows"),
            helper.make_node("Reshape", ["n_rows", "one_i64"], ["end_rows"], name="end_rows"),
            helper.make_node("Concat", ["logits_indices", "last_idx"], ["both_rows"], axis=0, name="both_rows"),
            helper.make_node("Slice", ["both_rows", "zero_1d", "end_rows", "zero_1d"], ["rows"], name="rows"),
            helper.make_node("Gather", [x, "rows"], ["hidden_rows"], name="gather_rows"),
            helper.make_node("MatMul", ["hidden_rows", "lm_head"], ["logits"], name="lm_head"),
        ]
        inits += [
            numpy_helper.from_array(np.zeros(0, np.int64), "logits_indices"),  # the default: nothing asked
            numpy_helper.from_array(np.array([1], np.int64), "one_i64"),
            numpy_helper.from_array(np.array([np.iinfo(np.int64).max], np.int64), "big_i64"),
            numpy_helper.from_array(np.array(0, np.int64), "zero_i64"),
            numpy_helper.from_array(np.array([0], np.int64), "zero_1d"),
        ]
        logits_dims = ["num_logits", config.vocab]
    elif config.logits == "all":
        nodes.append(helper.make_node("MatMul", [x, "lm_head"], ["logits"], name="lm_head"))
        logits_dims = ["num_tokens", config.vocab]
    else:
        raise ValueError(f"ToyLMConfig.logits: expected 'last' or 'all', found {config.logits!r}")
    outputs.insert(0, helper.make_tensor_value_info("logits", f32, logits_dims))
    graph = helper.make_graph(nodes, "ortpa_toy_lm", inputs, outputs, initializer=inits)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)], ir_version=10
    )
    onnx.checker.check_model(model)
    return model


def toy_lm_reference(config: ToyLMConfig, weights: ToyLMWeights, tokens: list[int] | np.ndarray) -> np.ndarray:
    """Dense NumPy logits ``[len(tokens), vocab]`` of one sequence: causal attention, no cache, no paging.

    Rounds to float16 where the graph does (the attention's inputs and output), computes everything else in
    float32, so it matches a paged run within float16 tolerance.
    """
    tok = np.asarray(tokens, dtype=np.int64)
    n, h, nh, kvh = len(tok), config.head_size, config.num_heads, config.kv_heads
    pos = np.arange(n)
    x = weights.embedding[tok]
    if config.position_ids:
        x = x + weights.pos_embedding[pos]
    cos = weights.cos[pos].astype(np.float32)[:, None, :]
    sin = weights.sin[pos].astype(np.float32)[:, None, :]

    def rope(t: np.ndarray) -> np.ndarray:  # half-split (NeoX) rotation over the whole head
        a, b = t[..., : h // 2], t[..., h // 2 :]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1).astype(np.float16).astype(np.float32)

    def f16(t: np.ndarray) -> np.ndarray:
        return t.astype(np.float16).astype(np.float32)

    causal = np.tril(np.ones((n, n), dtype=bool))
    for i in range(config.num_layers):
        q = rope(f16(x @ weights.wq[i]).reshape(n, nh, h))
        k = rope(f16(x @ weights.wk[i]).reshape(n, kvh, h))
        v = f16(x @ weights.wv[i]).reshape(n, kvh, h)
        k = np.repeat(k, nh // kvh, axis=1)  # query head j reads kv head j // (nh / kvh)
        v = np.repeat(v, nh // kvh, axis=1)
        scores = np.einsum("qnh,knh->nqk", q, k) / np.sqrt(h)
        scores = np.where(causal[None], scores, -np.inf)
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        attn = f16(np.einsum("nqk,knh->qnh", probs, v).reshape(n, nh * h))
        x = x + attn @ weights.wo[i]
    return (x @ weights.lm_head).astype(np.float32)
