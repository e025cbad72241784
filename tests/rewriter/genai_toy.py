"""Hand-built models in the onnxruntime-genai builder's form, for the recogniser tests of its attention ops.

The builder's real files live in ``tests/fixtures/formats/``; these toys vary one feature at a time (packed or
separate QKV, RoPE interleaving, a local window, softcap) that the fixtures' configs do not reach. Layout as the
builder writes it: ``input_ids [batch, seq]``, ``attention_mask [batch, total]``, ``past_key_values.{i}.key /
.value [batch, kv_heads, past, "kv_cache_dim"]``; ``seqlens_k = ReduceSum(mask) - 1`` and
``total_sequence_length = Shape(mask)[1]`` as int32; per layer SimplifiedLayerNormalization -> projections ->
``GroupQueryAttention`` -> o_proj + residual; logits from a final norm and lm_head.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = ["GqaToy", "gqa_toy_model"]


@dataclass(frozen=True)
class GqaToy:
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head: int = 16
    vocab: int = 256
    packed: bool = True
    do_rotary: int = 1
    interleaved: int = 0
    window: int = -1
    softcap: float = 0.0
    scale: float = 0.0
    qk_norm: bool = False
    seed: int = 0

    @property
    def hidden(self) -> int:
        return 64


def _rope_tables(rows: int, head: int) -> tuple[np.ndarray, np.ndarray]:
    inv = 1.0 / (10000.0 ** (np.arange(0, head, 2, dtype=np.float64) / head))
    ang = np.arange(rows, dtype=np.float64)[:, None] * inv[None]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def gqa_toy_model(cfg: GqaToy = GqaToy()) -> onnx.ModelProto:
    rng = np.random.default_rng(cfg.seed)
    hid, h, kvh, d = cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head
    inits: list[onnx.TensorProto] = []
    nodes: list[onnx.NodeProto] = []

    def w(name: str, shape: tuple[int, ...], scale: float | None = None) -> str:
        s = (1.0 / np.sqrt(shape[0])) if scale is None else scale
        inits.append(numpy_helper.from_array((rng.standard_normal(shape) * s).astype(np.float32), name))
        return name

    def ones(name: str, n: int) -> str:
        inits.append(numpy_helper.from_array((1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32), name))
        return name

    def const(name: str, array: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(array, name))
        return name

    nodes.append(helper.make_node("Gather", [w("embed", (cfg.vocab, hid), 1.0), "input_ids"], ["h0"]))
    nodes.append(helper.make_node("ReduceSum", ["attention_mask", const("axes1", np.array([1], np.int64))], ["msum"]))
    nodes.append(helper.make_node("Sub", ["msum", const("one64", np.array(1, np.int64))], ["seqlens64"]))
    nodes.append(helper.make_node("Cast", ["seqlens64"], ["seqlens_k"], to=TensorProto.INT32))
    nodes.append(helper.make_node("Shape", ["attention_mask"], ["mshape"]))
    nodes.append(helper.make_node("Gather", ["mshape", const("idx1", np.array(1, np.int64))], ["total64"], axis=0))
    nodes.append(helper.make_node("Cast", ["total64"], ["total_len"], to=TensorProto.INT32))
    cos, sin = _rope_tables(256, d)
    const("cos_cache", cos)
    const("sin_cache", sin)
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
        helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch_size", "total_sequence_length"]),
    ]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch_size", "sequence_length", cfg.vocab])]
    present = []
    x = "h0"
    for i in range(cfg.layers):
        past = [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
        for name in past:
            inputs.append(
                helper.make_tensor_value_info(
                    name, TensorProto.FLOAT, ["batch_size", kvh, "past_sequence_length", "kv_cache_dim"]
                )
            )
        nodes.append(
            helper.make_node("SimplifiedLayerNormalization", [x, ones(f"ln{i}", hid)], [f"n{i}"], axis=-1, epsilon=1e-5)
        )
        if cfg.packed:
            nodes.append(helper.make_node("MatMul", [f"n{i}", w(f"qkv{i}", (hid, (h + 2 * kvh) * d))], [f"qkv_{i}"]))
            qkv = [f"qkv_{i}", "", ""]
        else:
            qkv = []
            for kind, heads in (("q", h), ("k", kvh), ("v", kvh)):
                nodes.append(helper.make_node("MatMul", [f"n{i}", w(f"{kind}{i}", (hid, heads * d))], [f"{kind}_{i}"]))
                qkv.append(f"{kind}_{i}")
            if cfg.qk_norm:  # Qwen3: a per-head RMSNorm on q and k, in [B,S,H,D], back to [B,S,H*D]
                for j, (kind, heads) in enumerate((("q", h), ("k", kvh))):
                    shape4 = const(f"{kind}shape{i}", np.array([0, 0, heads, d], np.int64))
                    shape3 = const(f"{kind}shape3{i}", np.array([0, 0, heads * d], np.int64))
                    nodes.append(helper.make_node("Reshape", [qkv[j], shape4], [f"{kind}4_{i}"]))
                    nodes.append(
                        helper.make_node(
                            "SimplifiedLayerNormalization",
                            [f"{kind}4_{i}", ones(f"{kind}norm{i}", d)],
                            [f"{kind}n4_{i}"],
                            axis=-1,
                            epsilon=1e-6,
                        )
                    )
                    nodes.append(helper.make_node("Reshape", [f"{kind}n4_{i}", shape3], [f"{kind}n_{i}"]))
                    qkv[j] = f"{kind}n_{i}"
        attrs = dict(num_heads=h, kv_num_heads=kvh, do_rotary=cfg.do_rotary, rotary_interleaved=cfg.interleaved)
        if cfg.window > 0:
            attrs["local_window_size"] = cfg.window
        if cfg.softcap:
            attrs["softcap"] = cfg.softcap
        if cfg.scale:
            attrs["scale"] = cfg.scale
        rope = ["cos_cache", "sin_cache"] if cfg.do_rotary else ["", ""]
        nodes.append(
            helper.make_node(
                "GroupQueryAttention",
                [*qkv, *past, "seqlens_k", "total_len", *rope],
                [f"attn{i}", f"present.{i}.key", f"present.{i}.value"],
                domain="com.microsoft",
                name=f"/model/layers.{i}/attn/GroupQueryAttention",
                **attrs,
            )
        )
        nodes.append(helper.make_node("MatMul", [f"attn{i}", w(f"o{i}", (h * d, hid))], [f"o_{i}"]))
        nodes.append(helper.make_node("Add", [x, f"o_{i}"], [f"h{i + 1}"]))
        x = f"h{i + 1}"
        for name in (f"present.{i}.key", f"present.{i}.value"):
            present.append(
                helper.make_tensor_value_info(
                    name, TensorProto.FLOAT, ["batch_size", kvh, "total_sequence_length", "kv_cache_dim"]
                )
            )
    nodes.append(helper.make_node("SimplifiedLayerNormalization", [x, ones("lnf", hid)], ["nf"], axis=-1, epsilon=1e-5))
    nodes.append(helper.make_node("MatMul", ["nf", w("lm_head", (hid, cfg.vocab))], ["logits"]))
    graph = helper.make_graph(nodes, "gqa_toy", inputs, outputs + present, initializer=inits)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 10
    return model
