"""A small DeepSeek-style dense MLA causal LM, built as ONNX without torch, with random seeded weights.

The graph mirrors, op for op, what ``torch.onnx.export(dynamo=True)`` makes of transformers 5.x
``DeepseekV3ForCausalLM`` with ``attn_implementation="sdpa"`` at opset 18 (``tests/fixtures/dsv3_sdpa_op18.onnx``),
so :func:`ortpa.rewriter.recognisers.mla.match_mla_layers` and :func:`ortpa.convert` see the same structure as on a real
export. Per layer ``i``::

    h = RMSNorm(x)
    q      = [RMSNorm(h @ Wq_a)] @ Wq_b -> Reshape[B,S,-1,P+R] -> Transpose(0,2,1,3) -> Split([P,R]) -> q_nope, q_pe
    ckv    = h @ Wkv_a -> Split([L,R], axis 2) -> latent = Reshape(RMSNorm(.))[B,1,S,L], k_pe = Reshape(.)[B,1,S,R]
    RoPE   : interleaved (Slice step 2, Sub/Add, Concat: HF's de-interleaving output) or rotate_half
    cache  : present.i.key = Concat(past.i.key, latent, -2), present.i.value = Concat(past.i.value, k_pe, -2)
    expand : present.i.key @ Wkv_b -> Reshape[B,T,-1,P+V] -> Transpose -> Split([P,V]) -> k_nope, v
    key    : ConstantOfShape + 2x ScatterND (torch's new_empty + slice copies; "scatter") or Concat ("concat")
    attn   : Softmax(q*sqrt(s) @ Reshape/Transpose/Reshape(key)*sqrt(s) + Where(mask, 0, -max)) -> Where(IsNaN) @ v
    out    : Reshape[B,-1,S,V] -> Transpose -> Reshape[B,S,-1] @ Wo;  x += out;  x += SwiGLU(RMSNorm(x))
    logits = RMSNorm(x) @ W_lm

The mask is built once from ``attention_mask`` (padding) and the cache positions (causal), as the export does.
Weights are in ONNX orientation (``[in, out]``, i.e. ``Linear.weight`` transposed).
:func:`ortpa.testing.dense_mla_reference.dense_mla_reference` computes the same model in float64 NumPy from the
formulas (not from the graph), so the builder is checked independently of ONNX Runtime and of the converter.

Over ~400 lines on purpose: one builder that mirrors one exported graph op for op; the file writer and the
NumPy reference forward live in ``dense_mla_file`` and ``dense_mla_reference``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ortpa.errors import OrtpaError

__all__ = [
    "DenseMlaConfig",
    "DenseMlaConfigError",
    "DenseMlaLayerWeights",
    "DenseMlaWeights",
    "build_dense_mla",
    "dense_mla_weights",
    "inv_freq",
]

KeyAssembly = Literal["scatter", "concat"]
_INT64_MAX = np.iinfo(np.int64).max
_INT64_MIN = np.iinfo(np.int64).min
_FLT_MIN = float(np.finfo(np.float32).min)  # torch's SDPA lowering masks with -FLT_MAX, not -inf


class DenseMlaConfigError(OrtpaError, ValueError):
    """A :class:`DenseMlaConfig` field is out of range."""


@dataclass(frozen=True)
class DenseMlaConfig:
    """Shape of the model. Names follow transformers' ``DeepseekV3Config`` where one exists."""

    hidden: int = 64
    layers: int = 2
    heads: int = 4
    q_lora_rank: int | None = 48  # None: one q_proj, no q LoRA / q_a_layernorm (DeepSeek-V2-Lite style)
    kv_lora_rank: int = 64  # L
    qk_nope: int = 32  # P
    qk_rope: int = 16  # R
    v_head: int = 32  # V
    vocab: int = 256
    intermediate: int = 128
    rope_theta: float = 10000.0
    rope_interleave: bool = True  # DeepSeek-V3's default; False = NeoX rotate_half (MiniCPM3)
    mscale: float = 1.0  # YaRN attention mscale: the softmax scale is mscale**2 / sqrt(P + R)
    rms_eps: float = 1e-6
    key_assembly: KeyAssembly = "scatter"
    max_position_embeddings: int = 256
    seed: int = 0
    logit_gain: float = 2.0  # lm_head std * sqrt(hidden): logits ~ N(0, gain), so greedy argmax is not a tie

    def __post_init__(self) -> None:
        positive = ("hidden", "layers", "heads", "kv_lora_rank", "qk_nope", "qk_rope", "v_head", "vocab")
        for name in (*positive, "intermediate", "max_position_embeddings"):
            if int(getattr(self, name)) < 1:
                raise DenseMlaConfigError(f"DenseMlaConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise DenseMlaConfigError(f"DenseMlaConfig.q_lora_rank must be None or >= 1, got {self.q_lora_rank}")
        if self.qk_rope % 2:
            raise DenseMlaConfigError(f"DenseMlaConfig.qk_rope must be even (RoPE rotates pairs), got {self.qk_rope}")
        if self.key_assembly not in ("scatter", "concat"):
            raise DenseMlaConfigError(
                f"DenseMlaConfig.key_assembly must be 'scatter' or 'concat', got {self.key_assembly!r}"
            )

    @property
    def scale(self) -> float:
        """The softmax scale of the dense attention (and of the absorbed one)."""
        return self.mscale**2 / math.sqrt(self.qk_nope + self.qk_rope)

    @property
    def q_width(self) -> int:
        return self.heads * (self.qk_nope + self.qk_rope)


@dataclass
class DenseMlaLayerWeights:
    input_norm: np.ndarray  # [D]
    q_a: np.ndarray | None  # [D, Q]
    q_a_norm: np.ndarray | None  # [Q]
    q_b: np.ndarray  # [Q or D, H*(P+R)]
    kv_a: np.ndarray  # [D, L+R]  (kv_a_proj_with_mqa)
    kv_a_norm: np.ndarray  # [L]
    kv_b: np.ndarray  # [L, H*(P+V)]
    o: np.ndarray  # [H*V, D]
    post_norm: np.ndarray  # [D]
    gate: np.ndarray  # [D, I]
    up: np.ndarray  # [D, I]
    down: np.ndarray  # [I, D]


@dataclass
class DenseMlaWeights:
    embed: np.ndarray  # [vocab, D]
    layers: list[DenseMlaLayerWeights]
    norm: np.ndarray  # [D]
    lm_head: np.ndarray  # [D, vocab]


def dense_mla_weights(config: DenseMlaConfig) -> DenseMlaWeights:
    """Random float32 weights from ``config.seed``: unit-variance activations, logits of std ~``logit_gain``."""
    c = config
    rng = np.random.default_rng(c.seed)
    H, P, R, V, L, D = c.heads, c.qk_nope, c.qk_rope, c.v_head, c.kv_lora_rank, c.hidden

    def lin(d_in: int, d_out: int, gain: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((d_in, d_out)) * gain / math.sqrt(d_in)).astype(np.float32)

    def norm(d: int) -> np.ndarray:  # not all ones, so a dropped or misplaced norm weight changes the output
        return (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32)

    layers = []
    for _ in range(c.layers):
        q_in = c.q_lora_rank or D
        layers.append(
            DenseMlaLayerWeights(
                input_norm=norm(D),
                q_a=lin(D, c.q_lora_rank) if c.q_lora_rank else None,
                q_a_norm=norm(c.q_lora_rank) if c.q_lora_rank else None,
                q_b=lin(q_in, H * (P + R)),
                kv_a=lin(D, L + R),
                kv_a_norm=norm(L),
                kv_b=lin(L, H * (P + V)),
                o=lin(H * V, D, 0.5),  # residual branches at half gain keep the stream's scale steady
                post_norm=norm(D),
                gate=lin(D, c.intermediate),
                up=lin(D, c.intermediate),
                down=lin(c.intermediate, D, 0.5),
            )
        )
    return DenseMlaWeights(
        embed=rng.standard_normal((c.vocab, D)).astype(np.float32),
        layers=layers,
        norm=norm(D),
        lm_head=lin(D, c.vocab, c.logit_gain),
    )


def inv_freq(c: DenseMlaConfig) -> np.ndarray:
    return (1.0 / c.rope_theta ** (np.arange(0, c.qk_rope, 2, dtype=np.float64) / c.qk_rope)).astype(np.float32)


# ------------------------------------------------------------------------------------------------ ONNX graph
class _Graph:
    """Collects nodes and initializers; every output name is unique and every node is named after its scope."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._count = 0
        self._consts: dict[tuple, str] = {}
        self.scope = "/model"

    def init(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def ints(self, *values: int) -> str:
        return self.const(np.asarray(values, dtype=np.int64))

    def scalar(self, value: float) -> str:
        return self.const(np.asarray(value, dtype=np.float32))

    def const(self, array: np.ndarray) -> str:
        """A shared constant initializer (the exporter dedups them the same way)."""
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._consts:
            self._consts[key] = self.init(f"const_{len(self._consts)}", array)
        return self._consts[key]

    def op(self, op_type: str, inputs: list[str], *, outputs: int | list[str] = 1, **attrs) -> str | list[str]:
        self._count += 1
        name = f"{self.scope}/{op_type}_{self._count}"
        names = [f"{name}_out{k}" for k in range(outputs)] if isinstance(outputs, int) else list(outputs)
        self.nodes.append(helper.make_node(op_type, inputs, names, name=name, **attrs))
        return names[0] if len(names) == 1 else names


def _rms_norm(g: _Graph, x: str, weight: str, eps: float) -> str:
    """Pow -> ReduceMean -> Add(eps) -> Sqrt -> Reciprocal -> Mul(x) -> Mul(weight), as HF's RMSNorm exports."""
    var = g.op("ReduceMean", [g.op("Pow", [x, g.scalar(2.0)]), g.ints(-1)], keepdims=1)
    inv = g.op("Reciprocal", [g.op("Sqrt", [g.op("Add", [var, g.scalar(eps)])])])
    return g.op("Mul", [weight, g.op("Mul", [x, inv])])


def _rope(g: _Graph, x: str, cos: str, sin: str, half: int, interleave: bool) -> str:
    """HF's RoPE on the last axis of a 4-D ``x``; ``cos``/``sin`` are ``[B,1,S,R/2]`` (interleave) or ``[B,1,S,R]``."""
    if interleave:  # apply_rotary_pos_emb_interleave: even/odd channels in, de-interleaved halves out
        even = g.op("Slice", [x, g.ints(0), g.ints(_INT64_MAX), g.ints(3), g.ints(2)])
        odd = g.op("Slice", [x, g.ints(1), g.ints(_INT64_MAX), g.ints(3), g.ints(2)])
        first = g.op("Sub", [g.op("Mul", [even, cos]), g.op("Mul", [odd, sin])])
        second = g.op("Add", [g.op("Mul", [odd, cos]), g.op("Mul", [even, sin])])
        return g.op("Concat", [first, second], axis=-1)
    lo = g.op("Slice", [x, g.ints(0), g.ints(half), g.ints(3), g.ints(1)])
    hi = g.op("Slice", [x, g.ints(half), g.ints(_INT64_MAX), g.ints(3), g.ints(1)])
    rotated = g.op("Concat", [g.op("Neg", [hi]), lo], axis=-1)
    return g.op("Add", [g.op("Mul", [x, cos]), g.op("Mul", [rotated, sin])])


def _channels(g: _Graph, like: str, start: int, end: int) -> str:
    """ScatterND indices ``[[start], ..., [end-1]]`` computed from ``like``'s shape, as torch's slice_scatter does."""
    width = g.op("Gather", [g.op("Shape", [like]), g.const(np.array(3, np.int64))], axis=0)
    channels = g.op("Range", [g.const(np.array(0, np.int64)), width, g.const(np.array(1, np.int64))])
    channels = g.op("Slice", [channels, g.ints(start), g.ints(end), g.ints(0), g.ints(1)])
    return g.op("Unsqueeze", [channels, g.ints(-1)])


def _assemble_key(g: _Graph, c: DenseMlaConfig, k_nope: str, k_pe: str, dims: dict[str, str]) -> str:
    """``[k_nope | k_pe expanded to every head]`` as ``[B,H,T,P+R]``."""
    H, P, R = c.heads, c.qk_nope, c.qk_rope
    k_pe_heads = g.op("Expand", [k_pe, g.ints(1, H, 1, 1)])
    if c.key_assembly == "concat":
        return g.op("Concat", [k_nope, k_pe_heads], axis=-1)
    # torch: key = k_pe.new_empty(B, H, T, P+R); key[..., :P] = k_nope; key[..., P:] = k_pe. slice_scatter
    # lowers to ScatterND with the sliced axis moved to the front (Transpose perm 3,1,2,0 and back).
    perm = [3, 1, 2, 0]
    if "empty_key" not in dims:  # the exporter's CSE shares the empty key and the first indices across layers
        shape = g.op("Concat", [dims["batch"], g.ints(H), dims["total"], g.ints(P + R)], axis=0)
        empty = g.op("ConstantOfShape", [shape], value=numpy_helper.from_array(np.zeros(1, np.float32)))
        dims["nope_channels"] = _channels(g, empty, 0, P)
        dims["empty_key"] = g.op("Transpose", [empty], perm=perm)
    key = g.op("ScatterND", [dims["empty_key"], dims["nope_channels"], g.op("Transpose", [k_nope], perm=perm)])
    key = g.op("Transpose", [key], perm=perm)
    pe_channels = _channels(g, key, P, _INT64_MAX)
    updates = g.op("Transpose", [k_pe_heads], perm=perm)
    key = g.op("ScatterND", [g.op("Transpose", [key], perm=perm), pe_channels, updates])
    return g.op("Transpose", [key], perm=perm)


def _transpose_last_two(g: _Graph, key: str) -> str:
    """Kᵀ as torchlib's SDPA lowering writes it: Reshape [-1,T,D] -> Transpose(0,2,1) -> Reshape [...,D,T]."""
    shape = g.op("Shape", [key])
    last = g.op("Slice", [shape, g.ints(-1), g.ints(_INT64_MAX)])
    second = g.op("Slice", [shape, g.ints(-2), g.ints(-1)])
    lead = g.op("Slice", [shape, g.ints(_INT64_MIN), g.ints(-2)])
    flat = g.op("Reshape", [key, g.op("Concat", [g.ints(-1), second, last], axis=0)])
    flipped = g.op("Transpose", [flat], perm=[0, 2, 1])
    return g.op("Reshape", [flipped, g.op("Concat", [lead, last, second], axis=0)])


def _attention(
    g: _Graph, c: DenseMlaConfig, i: int, w: DenseMlaLayerWeights, h: str, rope: tuple[str, str], dims: dict[str, str]
) -> str:
    P, R, V, L = c.qk_nope, c.qk_rope, c.v_head, c.kv_lora_rank
    prefix = f"model.layers.{i}.self_attn"
    batch, seq, total = dims["batch"], dims["seq"], dims["total"]
    if w.q_a is not None:
        q = g.op("MatMul", [h, g.init(f"{prefix}.q_a_proj.weight_t", w.q_a)])
        q = _rms_norm(g, q, g.init(f"{prefix}.q_a_layernorm.weight", w.q_a_norm), c.rms_eps)
        q = g.op("MatMul", [q, g.init(f"{prefix}.q_b_proj.weight_t", w.q_b)])
    else:
        q = g.op("MatMul", [h, g.init(f"{prefix}.q_proj.weight_t", w.q_b)])
    q = g.op("Reshape", [q, g.op("Concat", [batch, seq, g.ints(-1), g.ints(P + R)], axis=0)], allowzero=1)
    q = g.op("Transpose", [q], perm=[0, 2, 1, 3])
    q_nope, q_pe = g.op("Split", [q, g.ints(P, R)], outputs=2, axis=3)

    ckv = g.op("MatMul", [h, g.init(f"{prefix}.kv_a_proj_with_mqa.weight_t", w.kv_a)])
    ckv, k_pe = g.op("Split", [ckv, g.ints(L, R)], outputs=2, axis=2)
    ckv = _rms_norm(g, ckv, g.init(f"{prefix}.kv_a_layernorm.weight", w.kv_a_norm), c.rms_eps)
    latent = g.op("Reshape", [ckv, g.op("Concat", [batch, g.ints(1), seq, g.ints(L)], axis=0)], allowzero=1)
    k_pe = g.op("Reshape", [k_pe, g.op("Concat", [batch, g.ints(1), seq, g.ints(R)], axis=0)], allowzero=1)
    q_pe = _rope(g, q_pe, *rope, R // 2, c.rope_interleave)
    k_pe = _rope(g, k_pe, *rope, R // 2, c.rope_interleave)

    present_k = g.op("Concat", [f"past_key_values.{i}.key", latent], outputs=[f"present.{i}.key"], axis=-2)
    present_v = g.op("Concat", [f"past_key_values.{i}.value", k_pe], outputs=[f"present.{i}.value"], axis=-2)
    query = g.op("Concat", [q_nope, q_pe], axis=-1)
    kv = g.op("MatMul", [present_k, g.init(f"{prefix}.kv_b_proj.weight_t", w.kv_b)])
    kv = g.op("Reshape", [kv, g.op("Concat", [batch, total, g.ints(-1), g.ints(P + V)], axis=0)], allowzero=1)
    kv = g.op("Transpose", [kv], perm=[0, 2, 1, 3])
    k_nope, v = g.op("Split", [kv, g.ints(P, V)], outputs=2, axis=3)
    key = _assemble_key(g, c, k_nope, present_v, dims)

    root = g.scalar(math.sqrt(c.scale))  # torchlib splits the scale as sqrt(s) on q and on Kᵀ
    scores = g.op("MatMul", [g.op("Mul", [query, root]), g.op("Mul", [_transpose_last_two(g, key), root])])
    probs = g.op("Softmax", [g.op("Add", [scores, dims["mask"]])], axis=-1)
    probs = g.op("Where", [g.op("IsNaN", [probs]), g.scalar(0.0), probs])
    attn = g.op("MatMul", [probs, v])
    attn = g.op("Reshape", [attn, g.op("Concat", [batch, g.ints(-1), seq, g.ints(V)], axis=0)], allowzero=1)
    attn = g.op("Transpose", [attn], perm=[0, 2, 1, 3])
    attn = g.op("Reshape", [attn, g.op("Concat", [batch, seq, g.ints(-1)], axis=0)], allowzero=1)
    return g.op("MatMul", [attn, g.init(f"{prefix}.o_proj.weight_t", w.o)])


def _mask_and_rope(g: _Graph, c: DenseMlaConfig) -> tuple[dict[str, str], tuple[str, str]]:
    """Model-level values: dims (as 1-D int64), the additive mask [B,1,S,T], and RoPE's cos/sin."""
    last = c.layers - 1  # the export reads batch and past length off the last layer's cache
    dims = {
        "batch": g.op("Shape", [f"past_key_values.{last}.value"], start=0, end=1),
        "seq": g.op("Shape", ["input_ids"], start=1, end=2),
        "past": g.op("Shape", [f"past_key_values.{last}.key"], start=2, end=3),
    }
    dims["total"] = g.op("Add", [dims["past"], dims["seq"]])
    zero, one = g.const(np.array(0, np.int64)), g.const(np.array(1, np.int64))
    batch_idx = g.op("Range", [zero, g.op("Squeeze", [dims["batch"]]), one])
    q_pos = g.op("Add", [g.op("Range", [zero, g.op("Squeeze", [dims["seq"]]), one]), g.op("Squeeze", [dims["past"]])])
    kv_pos = g.op("Range", [zero, g.op("Squeeze", [dims["total"]]), one])
    batch_idx = g.op("Unsqueeze", [batch_idx, g.ints(1, 2, 3)])  # [B,1,1,1]
    q_pos = g.op("Unsqueeze", [q_pos, g.ints(0, 1, 3)])  # [1,1,S,1]
    kv_pos = g.op("Unsqueeze", [kv_pos, g.ints(0, 1, 2)])  # [1,1,1,T]
    causal = g.op("And", [g.const(np.array(True)), g.op("LessOrEqual", [kv_pos, q_pos])])
    # padding: attention_mask[batch_idx, kv_pos] through GatherND on broadcast index pairs (torch advanced indexing)
    pair_shape = g.op("Shape", [g.op("Max", [batch_idx, kv_pos])])
    pairs = [g.op("Unsqueeze", [g.op("Expand", [v, pair_shape]), g.ints(-1)]) for v in (batch_idx, kv_pos)]
    mask_bool = g.op("Cast", ["attention_mask"], to=TensorProto.BOOL)
    padding = g.op("GatherND", [mask_bool, g.op("Concat", pairs, axis=-1)], batch_dims=0)  # [B,1,1,T]
    allowed = g.op("And", [causal, padding])
    full = g.op("Concat", [dims["batch"], g.ints(1), dims["seq"], dims["total"]], axis=0)
    allowed = g.op("Expand", [allowed, full])  # [B,1,S,T]
    dims["mask"] = g.op("Where", [allowed, g.scalar(0.0), g.scalar(_FLT_MIN)])

    g.scope = "/model/rotary_emb"
    pos = g.op("Cast", [g.op("Unsqueeze", ["position_ids", g.ints(2)])], to=TensorProto.FLOAT)
    freqs = g.op("Mul", [pos, g.init("model.rotary_emb.inv_freq", inv_freq(c))])  # HF 5.x: Mul, not MatMul
    emb = g.op("Concat", [freqs, freqs], axis=-1)
    cos, sin = g.op("Cos", [emb]), g.op("Sin", [emb])
    if c.rope_interleave:
        half = c.qk_rope // 2
        cos = g.op("Slice", [cos, g.ints(0), g.ints(half), g.ints(2), g.ints(1)])
        sin = g.op("Slice", [sin, g.ints(0), g.ints(half), g.ints(2), g.ints(1)])
    return dims, (g.op("Unsqueeze", [cos, g.ints(1)]), g.op("Unsqueeze", [sin, g.ints(1)]))


def build_dense_mla(config: DenseMlaConfig | None = None, weights: DenseMlaWeights | None = None) -> onnx.ModelProto:
    """The dense model as an opset-18 ``onnx.ModelProto`` with inferred intermediate shapes (as exports carry)."""
    c = config or DenseMlaConfig()
    w = weights or dense_mla_weights(c)
    model = _graph_model(c, w, _Graph())
    # Exports carry value_info for every intermediate; the matcher reads static widths from it.
    model = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)
    onnx.checker.check_model(model)
    return model


def _graph_model(c: DenseMlaConfig, w: DenseMlaWeights, g: _Graph) -> onnx.ModelProto:
    """The model before shape inference; ``g.init`` decides where the weights go (see dense_mla_file)."""
    dims, rope = _mask_and_rope(g, c)
    g.scope = "/model/embed_tokens"
    x = g.op("Gather", [g.init("model.embed_tokens.weight", w.embed), "input_ids"], axis=0)
    for i, lw in enumerate(w.layers):
        g.scope = f"/model/layers.{i}"
        h = _rms_norm(g, x, g.init(f"model.layers.{i}.input_layernorm.weight", lw.input_norm), c.rms_eps)
        x = g.op("Add", [x, _attention(g, c, i, lw, h, rope, dims)])
        h = _rms_norm(g, x, g.init(f"model.layers.{i}.post_attention_layernorm.weight", lw.post_norm), c.rms_eps)
        mlp = f"model.layers.{i}.mlp"
        gate = g.op("MatMul", [h, g.init(f"{mlp}.gate_proj.weight_t", lw.gate)])
        up = g.op("MatMul", [h, g.init(f"{mlp}.up_proj.weight_t", lw.up)])
        act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), up])
        x = g.op("Add", [x, g.op("MatMul", [act, g.init(f"{mlp}.down_proj.weight_t", lw.down)])])
    g.scope = "/model"
    x = _rms_norm(g, x, g.init("model.norm.weight", w.norm), c.rms_eps)
    g.op("MatMul", [x, g.init("lm_head.weight_t", w.lm_head)], outputs=["logits"])

    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    L, R = c.kv_lora_rank, c.qk_rope
    inputs = [
        helper.make_tensor_value_info("input_ids", i64, ["batch", "seq"]),
        helper.make_tensor_value_info("attention_mask", i64, ["batch", "total"]),
        helper.make_tensor_value_info("position_ids", i64, ["batch", "seq"]),
    ]
    outputs = [helper.make_tensor_value_info("logits", f32, ["batch", "seq", c.vocab])]
    for i in range(c.layers):
        inputs += [
            helper.make_tensor_value_info(f"past_key_values.{i}.key", f32, ["batch", 1, "past", L]),
            helper.make_tensor_value_info(f"past_key_values.{i}.value", f32, ["batch", 1, "past", R]),
        ]
        outputs += [
            helper.make_tensor_value_info(f"present.{i}.key", f32, ["batch", 1, "total", L]),
            helper.make_tensor_value_info(f"present.{i}.value", f32, ["batch", 1, "total", R]),
        ]
    graph = helper.make_graph(g.nodes, "dense_mla", inputs, outputs, g.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], producer_name="ortpa.testing")
    model.ir_version = 10
    helper.set_model_props(
        model,
        {
            "ortpa.testing.dense_mla.config": json.dumps(asdict(c), sort_keys=True),
            "max_position_embeddings": str(c.max_position_embeddings),
        },
    )
    return model
