"""The body of the portable PagedAttention: one layer function per configuration, over a step's plan.

:func:`ortpa.ops.portable.plan.build_plan_function` traces the index work of a step, which depends on the index
inputs only (``cumulative_sequence_length``, ``past_seqlens``, ``block_table``, ``slot_mapping``, the token count
and the cache dims), so that a model computes it once per step for all its layers; :func:`build_function` traces
one layer,
whose formal inputs are the node's present inputs (schema order) followed by the plan's outputs
(:data:`PLAN_OUTPUTS`) and whose outputs are the node's present outputs. Both are traced with onnxscript's graph
builder into ``onnx_ir.Function`` s; no loops, no custom ops (``If`` skips an empty prefill group and the zeroing
of padded values when there is none; ``PortableConfig.if_free``: no ``If``, both groups at every step on the plan's
padded groups, standard-op decodes). Together they follow the oracle (``ortpa.ops.oracle``) step by step:

1. (plan) sanitize ``block_table`` / ``cumulative_sequence_length`` / ``past_seqlens`` (reference §3.4(a));
2. (layer) prologue: split packed QKV, QK RMSNorm in float32 rounded to T, RoPE in T arithmetic on Q and K
   together (§3.4(b));
3. cache write: (plan) the write set is compacted with ``NonZero`` + ``Gather`` and de-duplicated (a slot written
   twice keeps its last writer's row, as in the oracle; ``ScatterND`` with repeated indices is unspecified and
   races in ONNX Runtime); (layer) every written token's K/V is encoded to the cache type and stored by one
   ``ScatterND`` whose data input IS the cache graph input, so that ONNX Runtime updates an IO-bound, aliased
   cache in place (§3.4(c), §3.5);
4. attention in two padded groups (§3.4(d)/(e)): decoding sequences over ``[D, 1, kv_d]``, prefilling ones
   over ``[P, max_q, kv_p]`` (each padded to its own group's longest query and KV length; indices and masks from
   the plan), so a step costs about the sum of its parts; only the attended positions are gathered from the
   ScatterND output through the block table, one row per (sequence, kv head, position); scores of padding and
   unmapped pages are masked and their value rows zeroed (when the plan finds any), so another block's NaN/Inf
   cannot leak in through ``0 * NaN``; every token then gathers its row back.

Memory per call (float32 unless said): scores/probabilities ``(D * kv_d + P * max_q * kv_p) * num_heads`` (a
few live copies), gathered K and V ``(D * kv_d + P * kv_p) * kv_heads * head_size`` in the cache type plus a
float32 copy each, padded Q and output ``(D + P * max_q) * num_heads * head_size``. Nothing scales with
``num_blocks``.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxscript

from ortpa.ops.portable.config import INDEX_TYPE, ORT_DOMAIN, PLAN_OUTPUT_TYPES, PLAN_OUTPUTS, PortableConfig
from ortpa.ops.portable.tracer import FUNCTION_DOMAIN, GraphTracer

__all__ = ["build_function"]

_F32 = ir.DataType.FLOAT
_I64 = ir.DataType.INT64


def build_function(cfg: PortableConfig) -> ir.Function:
    """One layer's attention: inputs are the node's present inputs then :data:`PLAN_OUTPUTS` (``plan.``-prefixed)."""
    extra = ("extra.index", "extra.rows") if cfg.extra_write else ()
    # typed inputs: every traced value's type is known, so no CastLike (config.PLAN_OUTPUT_TYPES)
    inputs = [ir.val(name, _input_type(cfg, name)) for name in cfg.present_inputs]
    inputs += [ir.val(f"plan.{n}", PLAN_OUTPUT_TYPES[n]) for n in PLAN_OUTPUTS]
    inputs += [ir.val(name, _input_type(cfg, name)) for name in extra]

    def trace(op, *vals):
        x = dict(zip(cfg.present_inputs, vals, strict=False))
        n = len(cfg.present_inputs)
        plan = dict(zip(PLAN_OUTPUTS, vals[n : n + len(PLAN_OUTPUTS)], strict=True))
        x.update(zip(extra, vals[n + len(PLAN_OUTPUTS) :], strict=True))
        return _Body(op, cfg, x, plan).run()

    return onnxscript.build_function(
        trace, inputs, domain=FUNCTION_DOMAIN, name=cfg.function_name(), opset_imports=cfg.opset_imports
    )


def _input_type(cfg: PortableConfig, name: str) -> ir.DataType:
    """The element type of the layer function's input ``name`` (an op input or a folded write's)."""
    if name in ("key_cache", "value_cache", "extra.rows"):
        return ir.DataType(cfg.cache_dtype)
    if name in ("cumulative_sequence_length", "past_seqlens", "block_table", "slot_mapping"):
        return INDEX_TYPE
    if name in ("k_scale", "v_scale"):
        return _F32
    if name == "extra.index":
        return _I64
    return ir.DataType(cfg.act_dtype)  # the op's T: query, key, value, cos / sin, head_sink, norm weights


class _Body(GraphTracer):
    """One layer's attention over a plan; methods mirror the oracle's steps. Attention in float32."""

    def __init__(self, op, cfg: PortableConfig, x: dict[str, ir.Value], plan: dict[str, ir.Value]) -> None:
        self.op = op
        self.c = cfg
        self.x = x
        self.plan = plan
        self.t_dtype = ir.DataType(cfg.act_dtype)
        self._rope_table: ir.Value | None = None

    def round_t(self, v):
        """Round a float32 tensor to T and back: one T-arithmetic rounding, as the oracle's RoPE does."""
        return self.f32(self.op.Cast(v, to=self.t_dtype))

    # ------------------------------------------------------------------ run
    def run(self) -> list[ir.Value]:
        c, x, op = self.c, self.x, self.op
        n, kvh, h = c.num_heads, c.kv_num_heads, c.head_size
        if c.packed_qkv and c.query_width == (n + 2 * kvh) * h and not c.use_qk_norm:
            # packed Q, K, V as heads of one [T, N + 2 kvh, H] view: Q and K are already one tensor for RoPE
            heads = op.Reshape(x["query"], self.ints([0, n + 2 * kvh, h]))
            if c.rotary_dim > 0:
                qk, v = op.Split(heads, self.ints([n + kvh, kvh]), axis=1, _outputs=2)
                q, k = op.Split(self.rotary(qk), self.ints([n, kvh]), axis=1, _outputs=2)
            else:
                q, k, v = op.Split(heads, self.ints([n, kvh, kvh]), axis=1, _outputs=3)
        else:
            q, k, v = self.split_qkv()
            if c.use_qk_norm:
                q = self.rms_norm(q, x["q_norm_weight"])
                k = self.rms_norm(k, x["k_norm_weight"])
            if c.rotary_dim > 0:
                # Q and K (both [T, heads, head_size]) rotated as one [T, N + kvh, H] tensor: half the kernels
                qk = self.rotary(op.Concat(q, k, axis=1))
                q, k = op.Split(qk, self.ints([n, kvh]), axis=1, _outputs=2)
        extra = (x["extra.index"], x["extra.rows"]) if c.extra_write else None
        if c.split_latent:
            return self.split_latent_tail(q, k, extra)
        k_cache = self.write(x["key_cache"], k, c.k_quant, x.get("k_scale"), extra=extra)
        v_cache = None
        if not c.latent:
            v_cache = self.write(x["value_cache"], v, c.v_quant, x.get("v_scale"))
        out = self.attend(q, k_cache, v_cache)
        outputs = [out]
        if "key_cache_out" in c.present_outputs:
            outputs.append(k_cache)  # straight from ScatterND: aliasing input and output makes it in place
        if "value_cache_out" in c.present_outputs:
            outputs.append(v_cache)
        return outputs

    def split_latent_tail(self, q, k, extra) -> list[ir.Value]:
        """LATENT with the row split over the two caches (``PortableConfig.split_latent``): each half written by
        its own ScatterND on the same slots; attention reads both halves of a gathered row (see :meth:`read`)."""
        c, x = self.c, self.x
        halves = [c.head_size // 2] * 2
        ka, kb = self.op.Split(k, halves, axis=2, _outputs=2)
        ea = eb = None
        if extra is not None:
            ra, rb = self.op.Split(extra[1], halves, axis=2, _outputs=2)
            ea, eb = (extra[0], ra), (extra[0], rb)
        k_cache = self.write(x["key_cache"], ka, c.k_quant, x.get("k_scale"), extra=ea)
        v_cache = self.write(x["value_cache"], kb, c.k_quant, x.get("k_scale"), extra=eb)
        return [self.attend(q, (k_cache, v_cache), None), k_cache, v_cache]

    # ------------------------------------------------------------------ §3.4(b) prologue
    def split_qkv(self):
        op, c, x = self.op, self.c, self.x
        n, kvh, h = c.num_heads, c.kv_num_heads, c.head_size
        query = x["query"]
        if c.packed_qkv and c.query_width == (n + 2 * kvh) * h:
            q, k, v = op.Split(query, [n * h, kvh * h, kvh * h], axis=1, _outputs=3)
        elif c.packed_qkv:  # integer-division quirk (or unknown width): trailing columns are ignored
            bounds = ((0, n), (n, n + kvh), (n + kvh, n + 2 * kvh))
            q, k, v = (op.Slice(query, [a * h], [b * h], [1]) for a, b in bounds)
        else:
            q = query if c.query_width == n * h else op.Slice(query, [0], [n * h], [1])
            k = x["key"]
            v = None if c.latent else x["value"]
        q = op.Reshape(q, self.ints([0, n, h]))
        k = op.Reshape(k, self.ints([0, kvh, h]))
        v = None if v is None else op.Reshape(v, self.ints([0, kvh, h]))
        return q, k, v

    def rms_norm(self, x, weight):
        op = self.op
        xf = self.f32(x)
        ms = op.ReduceMean(op.Mul(xf, xf), [-1], keepdims=1)
        inv = op.Reciprocal(op.Sqrt(op.Add(ms, self.c.qk_norm_epsilon)))
        return op.Cast(op.Mul(op.Mul(xf, inv), self.f32(weight)), to=self.t_dtype)

    def rope_table(self):
        """Each token's cos and sin, float32 ``[T, 1, 2, rd]``, gathered once per layer: row 0 the cosine of every
        rotated channel, row 1 the sine with the sign of the channel's partner term (see :meth:`rotary`).

        (T arithmetic is emulated by explicit roundings, not run in float16: ONNX Runtime's CPU EP has no float16
        Mul/Add/Sub; the casts it inserts around them are then merged, dropping the roundings the oracle does.)"""
        if self._rope_table is None:
            op, c = self.op, self.c
            cos, sin = self.x["cos_cache"], self.x["sin_cache"]
            # a position past the cos/sin rows is an out-of-bounds read on CUDA (the oracle raises); clamp so
            # that Gather stays in bounds; only invalid sequences (zero output, no writes) reach it with sane inputs
            rows = op.Min(self.dim(cos, 0), self.dim(sin, 0))
            p = op.Min(self.plan["pos"], op.Sub(rows, 1))  # pos >= 0: past and the index in a sequence are
            if c.rope_table_folded:  # every row's table from the initializers alone: a constant once folded
                cos, sin = (op.Slice(t, self.ints([0]), rows, self.ints([0])) for t in (cos, sin))
                self._rope_table = op.Gather(self.rope_layout(op.Concat(cos, sin, axis=1)), p)
            else:
                self._rope_table = self.rope_layout(op.Concat(op.Gather(cos, p), op.Gather(sin, p), axis=1))
        return self._rope_table

    def rope_layout(self, cs):
        """``[rows, 2 * half]`` (cos | sin, in T) -> float32 ``[rows, 1, 2, rd]`` as :meth:`rotary` multiplies."""
        op, c = self.op, self.c
        half = c.rotary_dim // 2
        chan = np.arange(c.rotary_dim)
        angle = chan // 2 if c.rotary_interleaved else chan % half  # the angle each channel turns by
        first = chan % 2 == 0 if c.rotary_interleaved else chan < half  # the channel is its pair's first
        cs = op.Gather(self.f32(cs), self.constant(np.concatenate([angle, half + angle])), axis=1)
        sign = np.concatenate([np.ones(c.rotary_dim), np.where(first, -1.0, 1.0)]).astype(np.float32)
        return op.Reshape(op.Mul(cs, self.constant(sign)), self.ints([-1, 1, 2, c.rotary_dim]))

    def rotary(self, x):
        """RoPE on channels [offset, offset + rotary_dim) at position past + i; products and sums rounded to T.

        ``x`` is ``[T, heads, head_size]``; Q and K go through together (one set of kernels per layer). Each
        rotated channel is ``x * cos + partner * (+-sin)`` (``partner``: the other channel of its pair), so one
        Gather lays out ``[x, partner]`` as ``[T, heads, 2, rd]``, one Mul forms both products, and a sum over
        the pair axis adds them: the oracle's ``r(r(a cos) - r(b sin))`` and ``r(r(b cos) + r(a sin))`` (a sign
        flip is exact, and rounding is symmetric), in 7 kernels instead of 20."""
        op, c = self.op, self.c
        off, rd, half = c.rotary_offset, c.rotary_dim, c.rotary_dim // 2
        seg = op.Slice(x, [off], [off + rd], [2]) if (off, rd) != (0, c.head_size) else x
        if c.rotary_interleaved:  # partners are neighbours: an element-wise Gather on the channel axis
            chan = np.arange(rd)
            pairs = op.Gather(seg, self.constant(np.stack([chan, chan ^ 1])), axis=2)  # [T, heads, 2, rd]
        else:  # partners are the other half: Gather whole halves (contiguous copies), [x0 x1] and [x1 x0]
            halves = op.Reshape(seg, self.ints([0, 0, 2, half]))
            pairs = op.Gather(halves, self.constant(np.array([[0, 1], [1, 0]])), axis=2)  # [T, heads, 2, 2, half]
            pairs = op.Reshape(pairs, self.ints([0, 0, 2, rd]))
        pairs = self.f32(pairs)
        terms = self.round_t(op.Mul(pairs, self.rope_table()))
        y = op.Cast(op.ReduceSum(terms, [2], keepdims=0), to=self.t_dtype)
        parts = []
        if off > 0:
            parts.append(op.Slice(x, [0], [off], [2]))
        parts.append(y)
        if off + rd < c.head_size:
            parts.append(op.Slice(x, [off + rd], [c.head_size], [2]))
        return parts[0] if len(parts) == 1 else op.Concat(*parts, axis=2)

    # ------------------------------------------------------------------ §3.4(c) cache write
    def write(self, cache, new, quant: str, scale, *, extra=None):
        """ScatterND(cache input, the plan's write index, encoded rows): the only reader of the cache input.
        ``extra`` (index, rows in the cache type): the graph's own rows (``PortableConfig.extra_write``), stored by
        the same ScatterND after the node's (their slots are other sequences': the two sets do not overlap)."""
        op = self.op
        upd = op.Gather(new, self.plan["write_rows"])  # [n, kvh, H] in T
        upd = self.encode(upd, quant, scale)
        index = self.plan["write_index"]
        if extra is not None:
            index = op.Concat(index, extra[0], axis=0)
            upd = op.Concat(upd, extra[1], axis=0)
        return op.ScatterND(cache, index, upd)

    def encode(self, x, quant: str, scale):
        """T -> cache element type; int8: ``rint(clamp(x / s, -128, 127))``, zero where ``s == 0``."""
        op, c = self.op, self.c
        if quant == "NONE":
            return x if c.cache_dtype == c.act_dtype else op.Cast(x, to=ir.DataType(c.cache_dtype))
        s = self.scale_for(scale, quant, [c.kv_num_heads, c.head_size])
        nz = op.Not(op.Equal(s, 0.0))
        r = op.Where(nz, op.Div(self.f32(x), op.Where(nz, s, 1.0)), 0.0)
        q = op.Round(op.Clip(r, op.Constant(value_float=-128.0), op.Constant(value_float=127.0)))
        return op.Cast(q, to=ir.DataType.INT8)

    def scale_for(self, scale, quant: str, shape: list[int]):
        """The float32 scale broadcastable against ``[..., *shape]`` (PER_CHANNEL read as [kv_heads, H])."""
        op = self.op
        if quant == "PER_TENSOR":
            return op.Reshape(scale, self.ints([1] * len(shape)))
        return op.Reshape(scale, self.ints(shape))

    # ------------------------------------------------------------------ §3.4(d)/(e) attention
    def attend(self, q, k_cache, v_cache):
        """Attention of every token, in two padded groups so that a step costs what its sequences need.

        One grid for the whole batch would pad every sequence to the step's longest query: a 256-token prompt
        chunk next to 15 decodes would make each decode compute 256 query rows. Instead the decoding sequences
        (one query each) share a ``[D, 1, max_kv]`` grid padded over their keys only, and the prefilling ones
        (more than one query) a ``[P, max_q, max_kv]`` grid padded to the longest chunk among them; each token
        then gathers its row from the group its sequence is in. Empty sequences own no token and join neither.
        The groups' indices and masks come from the plan, computed once per step for all layers.
        """
        op, pl = self.op, self.plan
        width = self.c.num_heads * self.c.v_head_size
        zero = self.constant(np.zeros((1, width), np.float32))
        if self.c.if_free:
            # both groups at every step, each with at least one member (a dummy with no token when the group is
            # empty, whose query is the zero row T appended here: nothing is gathered from an empty tensor)
            n, h = self.c.num_heads, self.c.head_size
            q = op.Concat(q, op.Cast(self.constant(np.zeros((1, n, h), np.float32)), to=self.t_dtype), axis=0)
            o_dec = self.attend_group(q, k_cache, v_cache, "d_", one_query=True)
            o_pre = self.attend_group(q, k_cache, v_cache, "p_", one_query=False)
            return op.Cast(op.Gather(op.Concat(o_dec, o_pre, zero, axis=0), pl["out_row"]), to=self.t_dtype)
        # each group runs under an If on one of its members attending a key, so that no kernel is called on an
        # empty batch or key range (older MultiHeadAttention kernels divide by zero there); a skipped decode
        # group is D zero rows (D may be 0), which its tokens never read (the plan's out_row: the zero row)
        (o_dec,) = self.branch(
            pl["any_decode"],
            "decodes",
            lambda: [self.attend_group(q, k_cache, v_cache, "d_", one_query=True)],
            lambda: [
                self.op.Expand(
                    self.constant(np.zeros((1, width), np.float32)),
                    self.op.Concat(self.dim(pl["d_query"], 0), self.ints([width]), axis=0),
                )
            ],
            shapes=[(_F32, [None, width])],
        )  # [D, N * vh]
        # a decode-only step does not dispatch the prefill group
        empty = np.zeros((0, width), np.float32)
        (o_pre,) = self.branch(
            pl["any_prefill"],
            "prefills",
            lambda: [self.attend_group(q, k_cache, v_cache, "p_", one_query=False)],
            lambda: [self.constant(empty)],
        )  # [P * max_q, N * vh]
        return op.Cast(op.Gather(op.Concat(o_dec, o_pre, zero, axis=0), pl["out_row"]), to=self.t_dtype)

    def attend_group(self, q, k_cache, v_cache, g_: str, *, one_query: bool):
        """Attention of one group over the plan's ``{g_}*`` indices (``d_``: decodes, ``p_``: prefills).

        ``one_query``: every member has exactly one query; the grid is then ``[S, 1, max_kv]`` with static
        query shapes. Returns the float32 output ``[S * max_q, N * vh]`` (row ``s * max_q + i``: query ``i`` of
        the group's ``s``-th sequence, in batch order).
        """
        op, c, pl = self.op, self.c, self.plan
        n, kvh, g, h, vh = c.num_heads, c.kv_num_heads, c.group, c.head_size, c.v_head_size
        row = pl[g_ + "row"]
        if one_query and c.fused_decode:
            return self.attend_decodes_fused(q, k_cache, v_cache)

        # dynamic shapes: allowzero because S / max_q / max_kv may be 0, and no -1 next to a possible 0
        kf = self.read(k_cache, row, c.k_quant, self.x.get("k_scale"), h)
        if one_query:
            # decodes: scores [S, kvh, G, max_kv], softmax over the last axis. Q K^T with K as gathered: ONNX
            # Runtime folds the Transpose into its MatMul (no copy of K), and every broadcast below runs along
            # contiguous rows (the [S, kvh, max_kv, G] layout broadcast [.., 1, G] over max_kv: ~10x slower)
            axis = 3
            qp = op.Mul(self.f32(op.Gather(q, pl[g_ + "query"])), c.scale)
            s = op.MatMul(op.Reshape(qp, self.ints([0, kvh, g, h])), op.Transpose(kf, perm=[0, 1, 3, 2]))
            sink_shape = [1, kvh, g, 1]
        else:
            # padded queries [S, max_q] -> Q^T per kv head [S, kvh, H, G*max_q] (column g*max_q + i); scores
            # transposed: [S, kvh, max_kv, G*max_q] viewed as [S, kvh, max_kv, G, max_q]; softmax over axis 2
            axis = 2
            S, maxq, maxkv = pl["p_count"], pl["p_max_q"], pl["p_max_kv"]
            qp = op.Mul(self.f32(op.Gather(q, pl[g_ + "query"])), c.scale)  # [S, max_q, N, H]
            gq = op.Mul(maxq, g)
            qp = op.Reshape(qp, op.Concat(S, maxq, self.ints([kvh, g, h]), axis=0), allowzero=1)
            qt = op.Reshape(
                op.Transpose(qp, perm=[0, 2, 4, 3, 1]), op.Concat(S, self.ints([kvh, h]), gq, axis=0), allowzero=1
            )
            s = op.MatMul(kf, qt)
            sink_shape = [1, kvh, 1, g, 1]

        if c.softcap > 0:
            s = op.Mul(op.Tanh(op.Div(s, c.softcap)), c.softcap)
        if not one_query:
            s = op.Reshape(s, op.Concat(S, self.ints([kvh]), maxkv, self.ints([g]), maxq, axis=0), allowzero=1)
        s = op.Where(pl[g_ + "allowed"], s, float("-inf"))
        m = op.ReduceMax(s, [axis], keepdims=1)
        sink = None
        if "head_sink" in self.x:
            sink = op.Reshape(self.f32(self.x["head_sink"]), self.ints(sink_shape))
            m = op.Max(m, sink)
        if c.if_free:  # OpenVINO has no IsInf: a kernel left to the CPU EP inside its subgraphs makes them cyclic
            m = op.Max(m, float(np.finfo(np.float32).min))  # fully masked row: exp(-inf - min) = 0 all the same
        else:
            m = op.Where(op.IsInf(m), 0.0, m)  # fully masked row without a sink
        e = op.Exp(op.Sub(s, m))
        den = op.ReduceSum(e, [axis], keepdims=1)
        if sink is not None:
            den = op.Add(den, op.Exp(op.Sub(sink, m)))
        p = op.Div(e, op.Where(op.Greater(den, 0.0), den, 1.0))  # empty key range: a zero row, never NaN

        if not one_query:
            p = op.Reshape(p, op.Concat(S, self.ints([kvh]), maxkv, gq, axis=0), allowzero=1)
            p = op.Transpose(p, perm=[0, 1, 3, 2])  # [S, kvh, G*max_q, max_kv]
        if c.latent:  # V is the leading v_head_size channels of K
            o = op.Slice(self.weighted_sum(p, kf, g_), [0], [vh], [3])
        else:
            o = self.weighted_sum(p, self.read(v_cache, row, c.v_quant, self.x.get("v_scale"), h), g_)
        if one_query:
            return op.Reshape(o, self.ints([0, n * vh]))  # [S, kvh, G, vh] -> [S, N*vh]
        o = op.Reshape(o, op.Concat(S, self.ints([kvh, g]), maxq, self.ints([vh]), axis=0), allowzero=1)
        return op.Reshape(op.Transpose(o, perm=[0, 3, 1, 2, 4]), self.ints([-1, n * vh]))  # [S*max_q, N*vh]

    def attend_decodes_fused(self, q, k_cache, v_cache):
        """The decode group through ``com.microsoft::MultiHeadAttention`` over the gathered pages: ~10 kernels
        instead of ~22 (the scores, mask and softmax are one kernel).

        MultiHeadAttention has one head count for Q and K; a decode has one query, so the G query heads that
        share a KV head are laid out as G query *positions* of that head (``[D, G, kvh * H]``), none causal
        among themselves: the same scores as GQA, with K and V read in place as gathered (``[D, kvh, kv, H]``,
        BNSH). Keys are masked by the plan's ``d_bias`` (padding, unmapped pages, the window), given whole
        (``[D, kvh, G, kv]``) as ``attention_bias``: ONNX Runtime 1.19 and 1.20 apply a ``key_padding_mask`` or a
        bias broadcast over heads wrongly to BNSH keys in a batch of more than one; a decode with no
        key left reads the zero row (the plan's ``out_row``) (the op returns NaN there). Float32 throughout, as the
        unfused path. Only where the op has no softcap or sink to express (the lowering decides per node).
        """
        op, c, pl = self.op, self.c, self.plan
        kvh, g, h, vh = c.kv_num_heads, c.group, c.head_size, c.v_head_size
        row = pl["d_row"]
        qd = self.f32(op.Gather(q, pl["d_query"]))  # [D, N, H], head n = k * G + j
        if g > 1:
            qd = op.Transpose(op.Reshape(qd, self.ints([0, kvh, g, h])), perm=[0, 2, 1, 3])  # [D, G, kvh, H]
        qd = op.Reshape(qd, self.ints([0, g, kvh * h]))
        kf = self.read(k_cache, row, c.k_quant, self.x.get("k_scale"), h)
        vf = self.read(v_cache, row, c.v_quant, self.x.get("v_scale"), h)
        # every padding or unmapped key is a copy of an attended row (the plan's d_row): the bias adds -inf to a
        # masked score, and NaN - inf would be NaN, so a masked row must never hold another block's NaN
        o = op.MultiHeadAttention(
            qd,
            kf,
            vf,
            None,  # bias
            None,  # key_padding_mask
            op.Expand(pl["d_bias"], self.ints([1, kvh, g, 1])),  # attention_bias
            _domain=ORT_DOMAIN,
            num_heads=kvh,
            scale=c.scale,
        )  # [D, G, kvh * vh]
        if g > 1:
            o = op.Transpose(op.Reshape(o, self.ints([0, g, kvh, vh])), perm=[0, 2, 1, 3])  # [D, kvh, G, vh]
        return op.Reshape(o, self.ints([0, c.num_heads * vh]))

    def read(self, cache, row, quant: str, scale, width: int):
        """Gather ``row`` ([S, kvh, max_kv]) of the cache viewed as [slots * kvh, width]; dequantize to float32."""
        op = self.op
        if isinstance(cache, tuple):  # split latent: the row's two halves, from the key and the value cache
            return op.Concat(*[self.read(part, row, quant, scale, width // 2) for part in cache], axis=-1)
        flat = op.Reshape(cache, self.ints([-1, width]))  # a view of the written cache, not a copy
        rows = self.f32(op.Gather(flat, row))
        if quant != "NONE":
            s = self.scale_for(scale, quant, [self.c.kv_num_heads, width])
            if quant == "PER_CHANNEL":
                s = op.Unsqueeze(s, [1])  # [kvh, 1, H] against [S, kvh, max_kv, H]
            rows = op.Mul(rows, s)
        return rows

    def weighted_sum(self, p, values, g_: str):
        """``P @ V`` where V's rows outside a sequence's live range (padding, unmapped pages) count as 0.

        Decodes need no care: each of their padding or unmapped rows is a copy of an attended one (the plan's
        ``d_row``). For prompt chunks:

        Those rows read some other block (page 0), which may belong to another sequence or hold garbage: a
        NaN or Inf there would reach this output through ``0 * NaN`` (keys need no such care: their masked
        scores are replaced by -inf with ``Where``). Zeroing them is a full pass over the gathered values
        (the cost of the MatMul itself at long contexts), so it runs only when the plan found such rows; a
        single sequence or equal lengths have none. In float32: ONNX Runtime's CPU Where has no float16 or
        bfloat16 kernel (it would wrap one in casts)."""
        pl = self.plan
        if g_ == "d_":
            return self.op.MatMul(p, values)
        if self.c.if_free:  # no If: the zeroing pass at every step
            return self.op.MatMul(p, self.op.Where(pl[g_ + "row_ok"], values, 0.0))
        return self.branch(
            pl[g_ + "rows_ok"],
            f"{g_}pv",
            lambda: [self.op.MatMul(p, values)],
            lambda: [self.op.MatMul(p, self.op.Where(pl[g_ + "row_ok"], values, 0.0))],
            shapes=[(_F32, [None, self.c.kv_num_heads, None, self.c.head_size])],  # [S, kvh, G * max_q, H]
        )[0]
