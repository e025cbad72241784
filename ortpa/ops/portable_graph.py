"""The body of the portable PagedAttention: one ONNX function per static configuration.

:func:`build_function` traces the op with onnxscript's graph builder into an ``onnx_ir.Function`` whose formal
inputs are the node's present inputs (schema order) and whose outputs are the node's present outputs. The
graph has no loops and no custom ops (one ``If`` skips an empty group); it follows the oracle
(``ortpa.ops.oracle``) step by step:

1. sanitize ``block_table`` / ``cumulative_sequence_length`` / ``past_seqlens`` (reference §3.4(a));
2. prologue: split packed QKV, QK RMSNorm in float32 rounded to T, RoPE in T arithmetic (§3.4(b));
3. cache write: every written token's K/V is encoded to the cache type, the write set is compacted with
   ``NonZero`` + ``Gather``, de-duplicated (a slot written twice keeps its last writer's row, as in the
   oracle; ``ScatterND`` with repeated indices is unspecified and races in ONNX Runtime) and stored by one
   ``ScatterND`` whose data input IS the cache graph input, so that ONNX Runtime updates an IO-bound,
   aliased cache in place (§3.4(c), §3.5);
4. attention in two padded groups (§3.4(d)/(e)): decoding sequences over ``[D, 1, kv_d]``, prefilling ones
   over ``[P, max_q, kv_p]`` (each padded to its own group's longest query and KV length), so a step costs
   about the sum of its parts; only the attended positions are gathered from the ScatterND output through the
   block table, one row per (sequence, kv head, position); rows of padding and unmapped pages are zeroed, so
   another block's NaN/Inf cannot leak in through ``0 * NaN``; every token then gathers its row back.

Memory per call (float32 unless said): scores/probabilities ``(D * kv_d + P * max_q * kv_p) * num_heads`` (a
few live copies), gathered K and V ``(D * kv_d + P * kv_p) * kv_heads * head_size`` in the cache type plus a
float32 copy each, padded Q and output ``(D + P * max_q) * num_heads * head_size``. Nothing scales with
``num_blocks``.

Over ~400 lines on purpose: one traced dataflow (sanitize, prologue, cache write, grouped attention, write-back)
whose steps share a dozen intermediate values; the pieces that stand alone (RoPE, quantized caches) live in
:mod:`ortpa.ops.rope` and :mod:`ortpa.ops.quant`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
import onnxscript

__all__ = ["FUNCTION_DOMAIN", "PLAN_OUTPUTS", "PlanConfig", "PortableConfig", "build_function", "build_plan_function"]

FUNCTION_DOMAIN = "ortpa.portable"

_F32 = ir.DataType.FLOAT
_I64 = ir.DataType.INT64
_INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class PortableConfig:
    """Everything the graph is specialised on; equal configs share one function."""

    present_inputs: tuple[str, ...]  # schema names of the inputs the node passes, in schema order
    present_outputs: tuple[str, ...]  # "output" plus the cache outputs the node produces
    act_dtype: int  # ir.DataType of T (FLOAT16 / BFLOAT16)
    cache_dtype: int  # ir.DataType of the caches (T, or INT8)
    num_heads: int
    kv_num_heads: int
    head_size: int
    v_head_size: int
    query_width: int | None  # query dim 1 when declared; used to cut the SEPARATE "hidden % num_heads" quirk
    latent: bool
    packed_qkv: bool
    scale: float
    softcap: float
    local_window_size: int
    is_causal: bool
    rotary_dim: int  # 0: no RoPE
    rotary_interleaved: bool
    rotary_offset: int
    use_qk_norm: bool
    qk_norm_epsilon: float
    k_quant: str  # NONE / PER_TENSOR / PER_CHANNEL
    v_quant: str
    opset: int

    @property
    def group(self) -> int:
        return self.num_heads // self.kv_num_heads

    def function_name(self) -> str:
        """A name that differs for different configs and is the same in every process (not ``hash``)."""
        return f"PagedAttention_{hashlib.sha1(repr(self).encode()).hexdigest()[:10]}"


# What the plan function computes once per step for every layer that shares its index inputs; the layer
# function takes them as its trailing inputs. ``p_*``: the prefilling group, ``d_*``: the decoding group.
PLAN_OUTPUTS = (
    "pos",  # [T] position of every token (RoPE)
    "write_rows",  # [n] tokens whose K/V are written (compacted, de-duplicated)
    "write_index",  # [n, 2] (block, offset) of each written row
    "any_prefill",  # bool scalar: the prefill group is not empty
    "out_row",  # [T] each token's row in Concat(decode output, prefill output)
    "has_keys",  # [T, 1] bool: the token's sequence attends to at least one key
    "d_query",  # [D] the decoding sequences' tokens
    "d_row",  # [D, kvh, kv_d] cache rows (of the cache viewed as [slots * kvh, H])
    "d_row_ok",  # [D, 1, kv_d, 1] rows that hold live keys of the sequence
    "d_allowed",  # [D, 1, 1, kv_d] keys the query attends (live, inside the local window)
    "d_rows_ok",  # bool scalar: every d_row holds a live key (no padding, no unmapped page)
    "p_query",  # [P, max_q] the prefilling sequences' tokens (padding rows clamped onto real tokens)
    "p_row",  # [P, kvh, kv_p]
    "p_row_ok",  # [P, 1, kv_p, 1]
    "p_allowed",  # [P, 1, kv_p, 1, max_q] causal / window / live mask
    "p_rows_ok",  # bool scalar
    "p_count",  # [1] P
    "p_max_q",  # [1] max_q
    "p_max_kv",  # [1] kv_p
)
# inputs of the plan function, in this order; slot_mapping only when the node passes it
PLAN_INPUTS = ("query", "key_cache", "cumulative_sequence_length", "past_seqlens", "block_table", "slot_mapping")


@dataclass(frozen=True)
class PlanConfig:
    """What the per-step index work depends on besides its inputs; layers with equal plans and the same index
    inputs (and token / cache dimensions) share one plan call."""

    kv_num_heads: int
    local_window_size: int
    is_causal: bool
    slot_mapping: bool
    opset: int

    @classmethod
    def of(cls, cfg: PortableConfig) -> PlanConfig:
        return cls(
            kv_num_heads=cfg.kv_num_heads,
            local_window_size=cfg.local_window_size,
            is_causal=cfg.is_causal,
            slot_mapping="slot_mapping" in cfg.present_inputs,
            opset=cfg.opset,
        )

    @property
    def inputs(self) -> tuple[str, ...]:
        return PLAN_INPUTS if self.slot_mapping else PLAN_INPUTS[:-1]

    def function_name(self) -> str:
        return f"PagedAttentionPlan_{hashlib.sha1(repr(self).encode()).hexdigest()[:10]}"


def build_plan_function(plan: PlanConfig) -> ir.Function:
    """The index work of one step (sanitization, write set, groups, masks, output rows): :data:`PLAN_OUTPUTS`."""
    inputs = [ir.val(name) for name in plan.inputs]

    def trace(op, *vals):
        x = dict(zip(plan.inputs, vals, strict=True))
        return _Plan(op, plan, x).run()

    return onnxscript.build_function(
        trace, inputs, domain=FUNCTION_DOMAIN, name=plan.function_name(), opset_imports={"": plan.opset}
    )


def build_function(cfg: PortableConfig) -> ir.Function:
    """One layer's attention: inputs are the node's present inputs then :data:`PLAN_OUTPUTS` (``plan.``-prefixed)."""
    inputs = [ir.val(name) for name in cfg.present_inputs] + [ir.val(f"plan.{n}") for n in PLAN_OUTPUTS]

    def trace(op, *vals):
        x = dict(zip(cfg.present_inputs, vals, strict=False))
        plan = dict(zip(PLAN_OUTPUTS, vals[len(cfg.present_inputs) :], strict=True))
        return _Body(op, cfg, x, plan).run()

    return onnxscript.build_function(
        trace, inputs, domain=FUNCTION_DOMAIN, name=cfg.function_name(), opset_imports={"": cfg.opset}
    )


class _Tracer:
    """Helpers shared by the plan and the layer tracers."""

    op: object

    def i64(self, v):
        return self.op.Cast(v, to=_I64)

    def f32(self, v):
        return self.op.Cast(v, to=_F32)

    def dim(self, v, axis: int):
        return self.op.Shape(v, start=axis, end=axis + 1)  # 1-D [1] int64

    def ints(self, values: list[int]):
        return self.op.Constant(value_ints=values)


class _Plan(_Tracer):
    """The index work of a step, traced once for all the layers that share it (int64 throughout)."""

    def __init__(self, op, plan: PlanConfig, x: dict[str, ir.Value]) -> None:
        self.op = op
        self.p = plan
        self.x = x

    def run(self) -> list[ir.Value]:
        op = self.op
        self.sizes_and_sanitize()
        rows, index = self.write_set()
        is_dec = op.Equal(self.q_len, 1)
        is_pre = op.Greater(self.q_len, 1)
        dec = self.group(is_dec, one_query=True)
        pre = self.group(is_pre, one_query=False)
        any_pre = op.Greater(op.ReduceSum(op.Cast(is_pre, to=_I64), keepdims=0), 0)

        # each sequence's first row in Concat(o_dec, o_pre): its rank within its group, times the group's max_q
        rank_dec = op.CumSum(op.Cast(is_dec, to=_I64), op.Constant(value_int=0))  # rank + 1 where is_dec
        rank_pre = op.CumSum(op.Cast(is_pre, to=_I64), op.Constant(value_int=0))
        first_pre = op.Add(op.Mul(op.Sub(rank_pre, 1), pre["max_q"]), dec["count"])
        first = op.Where(is_dec, op.Sub(rank_dec, 1), first_pre)
        out_row = op.Add(op.Gather(first, self.seq), self.s_in)  # every token's own row, back in token order
        # nothing to attend (invalid or empty sequence) is a zero row; when no sequence of a group has a key,
        # its max_kv == 0 and ONNX Runtime's CPU MatMul with an empty inner dimension returns uninitialised memory
        has_keys = op.Unsqueeze(op.Greater(op.Gather(self.kvlen, self.seq), 0), [1])
        return [
            self.pos,
            rows,
            index,
            any_pre,
            out_row,
            has_keys,
            dec["query"],
            dec["row"],
            dec["row_ok"],
            dec["allowed"],
            dec["rows_ok"],
            pre["query"],
            pre["row"],
            pre["row_ok"],
            pre["allowed"],
            pre["rows_ok"],
            pre["count"],
            pre["max_q"],
            pre["max_kv"],
        ]

    # ------------------------------------------------------------------ §3.4(a) sanitization
    def sizes_and_sanitize(self) -> None:
        op, x = self.op, self.x
        cu = self.i64(x["cumulative_sequence_length"])
        past = self.i64(x["past_seqlens"])
        bt = self.i64(x["block_table"])
        self.T = self.dim(x["query"], 0)
        self.NB = self.dim(x["key_cache"], 0)
        self.BS = self.dim(x["key_cache"], 1)
        self.MB = self.dim(bt, 1)
        cap = op.Mul(self.MB, self.BS)

        # entries outside [-1, num_blocks) become the unmapped sentinel -1
        self.bt = op.Where(op.And(op.GreaterOrEqual(bt, -1), op.Less(bt, self.NB)), bt, -1)

        # clamp into [0, T] with fixed ends, then an inclusive running max (B is small: a [B+1, B+1] table)
        n1 = self.dim(cu, 0)
        idx = op.Range(0, op.Squeeze(n1), 1)
        cl = op.Min(op.Max(cu, 0), self.T)
        cl = op.Where(op.Equal(idx, 0), 0, cl)
        cl = op.Where(op.Equal(idx, op.Sub(n1, 1)), self.T, cl)
        upto = op.LessOrEqual(op.Unsqueeze(idx, [0]), op.Unsqueeze(idx, [1]))  # [i, j]: j <= i
        c = op.ReduceMax(op.Where(upto, op.Unsqueeze(cl, [0]), 0), [1], keepdims=0)
        self.c_lo = op.Slice(c, [0], [-1])
        c_hi = op.Slice(c, [1], [_INT64_MAX])
        self.q_len = op.Sub(c_hi, self.c_lo)

        max_past = op.Max(op.Sub(cap, self.q_len), 0)
        valid = op.And(op.GreaterOrEqual(past, 0), op.LessOrEqual(past, max_past))
        self.past = op.Where(valid, past, 0)
        self.kvlen = op.Where(valid, op.Min(op.Add(self.past, self.q_len), cap), 0)

        # token -> owning sequence: how many sequence ends c[1..B] are <= t (empty sequences are skipped)
        t = op.Range(0, op.Squeeze(self.T), 1)
        owns = op.Cast(op.LessOrEqual(op.Unsqueeze(c_hi, [0]), op.Unsqueeze(t, [1])), to=_I64)
        self.seq = op.ReduceSum(owns, [1], keepdims=0)
        self.s_in = op.Sub(t, op.Gather(self.c_lo, self.seq))
        self.pos = op.Add(op.Gather(self.past, self.seq), self.s_in)
        self.live = op.Gather(valid, self.seq)

    # ------------------------------------------------------------------ §3.4(c) the write set
    def slots(self):
        op = self.op
        if "slot_mapping" in self.x:
            return self.i64(self.x["slot_mapping"])
        blk = op.Div(self.pos, self.BS)
        inside = op.Less(blk, self.MB)
        flat = op.Add(op.Mul(self.seq, self.MB), op.Min(blk, op.Sub(self.MB, 1)))
        page = op.Where(inside, op.Gather(op.Reshape(self.bt, self.ints([-1])), flat), -1)
        return op.Where(op.GreaterOrEqual(page, 0), op.Add(op.Mul(page, self.BS), op.Mod(self.pos, self.BS)), -1)

    def write_set(self):
        """(rows, index): the tokens whose K/V rows are stored, and their ``[block, offset]`` ScatterND index."""
        op = self.op
        slot = self.slots()
        ok = op.And(self.live, op.And(op.GreaterOrEqual(slot, 0), op.Less(slot, op.Mul(self.NB, self.BS))))
        rows = op.Reshape(op.NonZero(ok), self.ints([-1]))  # skipped tokens are dropped, not redirected
        rows = self.last_writers(op.Gather(slot, rows), rows)
        wslot = op.Gather(slot, rows)
        index = op.Concat(op.Unsqueeze(op.Div(wslot, self.BS), [1]), op.Unsqueeze(op.Mod(wslot, self.BS), [1]), axis=1)
        return rows, index

    def last_writers(self, wslot, rows):
        """The subset of ``rows`` that are the last (highest) token writing their slot.

        Duplicate slots (a repeated slot_mapping entry, a block table repeating a block) would otherwise reach
        ScatterND, whose result is then unspecified (ONNX) and racy (ONNX Runtime copies in parallel). Sorting
        the unique keys ``slot * T + row`` groups each slot's writers with the last one at the end of its group.
        """
        op = self.op
        t = op.Max(self.T, 1)  # ONNX Runtime's integer Div rejects a zero divisor even on empty tensors
        key = op.Add(op.Mul(wslot, t), rows)  # slot < 2**31 * block_size and row < T: no int64 overflow
        srt, _ = op.TopK(key, self.dim(key, 0), largest=0, sorted=1, _outputs=2)
        sslot, srow = op.Div(srt, t), op.Mod(srt, t)
        nxt = op.Concat(op.Slice(sslot, [1], [_INT64_MAX]), self.ints([-1]), axis=0)
        keep = op.Reshape(op.NonZero(op.Not(op.Equal(sslot, nxt))), self.ints([-1]))
        return op.Gather(srow, keep)

    # ------------------------------------------------------------------ §3.4(d)/(e) the two groups
    def group(self, member, *, one_query: bool) -> dict:
        """Indices and masks of the sequences where ``member`` holds, padded to their longest query and KV length.

        ``one_query`` (decodes): every member has one query at position ``past`` and ``kvlen == past + 1`` (an
        invalid one has ``kvlen == 0``), so the causal mask is implied by the KV length.
        """
        op, p = self.op, self.p
        kvh = p.kv_num_heads
        sel = op.Reshape(op.NonZero(member), self.ints([-1]))
        count = self.dim(sel, 0)
        kvlen, past, c_lo = op.Gather(self.kvlen, sel), op.Gather(self.past, sel), op.Gather(self.c_lo, sel)
        bt = op.Gather(self.bt, sel, axis=0)
        zero = self.ints([0])  # ReduceMax of an empty group: 0, never the reduction's identity
        maxkv = op.ReduceMax(op.Concat(kvlen, zero, axis=0), [0], keepdims=1)
        j = op.Range(0, op.Squeeze(maxkv), 1)  # kv position

        # kv rows through the sanitized block table; one gathered row per (s, kv head, j): no transposes of KV
        blk_j = op.Div(j, self.BS)
        pages = op.Gather(bt, blk_j, axis=1)  # [S, max_kv]; max_kv <= capacity keeps blk_j in range
        mapped = op.GreaterOrEqual(pages, 0)
        slot = op.Add(op.Mul(op.Max(pages, 0), self.BS), op.Mod(j, self.BS))
        row = op.Add(op.Mul(op.Unsqueeze(slot, [1]), kvh), op.Unsqueeze(op.Range(0, kvh, 1), [0, 2]))  # [S,kvh,kv]
        # rows past a sequence's live length or on an unmapped page read some other block (page 0), which may
        # belong to another sequence or hold garbage: masked out (scores) and zeroed in P @ V (weighted_sum)
        live = op.And(mapped, op.Less(op.Unsqueeze(j, [0]), op.Unsqueeze(kvlen, [1])))  # [S, max_kv]
        row_ok = op.Unsqueeze(live, [1, 3])  # [S, 1, max_kv, 1] against the gathered [S, kvh, max_kv, H]
        # no padding and no unmapped page (one sequence, or equal lengths): the layers then skip zeroing V
        rows_ok = op.Not(op.Greater(op.ReduceSum(op.Cast(op.Not(live), to=_I64), keepdims=0), 0))
        if one_query:
            # [S, 1, 1, max_kv] against the decode scores [S, kvh, G, max_kv]; the query sits at past, so
            # j < kvlen is the causal mask too
            allowed = live
            if p.local_window_size > 0:
                near = op.Greater(op.Unsqueeze(j, [0]), op.Unsqueeze(op.Sub(past, p.local_window_size), [1]))
                allowed = op.And(live, near)
            allowed = op.Unsqueeze(allowed, [1, 2])
            return {"query": c_lo, "row": row, "row_ok": row_ok, "allowed": allowed, "rows_ok": rows_ok, "count": count}
        maxq = op.ReduceMax(op.Concat(op.Gather(self.q_len, sel), zero, axis=0), [0], keepdims=1)
        i = op.Range(0, op.Squeeze(maxq), 1)  # query index within a sequence
        tok = op.Add(op.Unsqueeze(c_lo, [1]), op.Unsqueeze(i, [0]))
        tok = op.Max(op.Min(tok, op.Sub(self.T, 1)), 0)  # padding rows read a real token, never gathered back
        allowed = op.Unsqueeze(self.mask(i, j, mapped, past, kvlen), [1, 3])  # [S, 1, max_kv, 1, max_q]
        return {
            "query": tok,
            "row": row,
            "row_ok": row_ok,
            "allowed": allowed,
            "rows_ok": rows_ok,
            "count": count,
            "max_q": maxq,
            "max_kv": maxkv,
        }

    def mask(self, i, j, mapped, past, kvlen):
        """[S, max_kv, max_q]: key j is attended by query i of the group's sequence s (oracle `_attend`)."""
        op, p = self.op, self.p
        jj = op.Reshape(j, self.ints([1, -1, 1]))
        qpos = op.Unsqueeze(op.Add(op.Unsqueeze(past, [1]), op.Unsqueeze(i, [0])), [1])  # [S, 1, max_q]
        # padding query rows (i >= q_len) are not masked: they are computed, never gathered into the output
        ok = op.And(op.Less(jj, op.Reshape(kvlen, self.ints([-1, 1, 1]))), op.Unsqueeze(mapped, [2]))
        if p.is_causal:
            ok = op.And(ok, op.LessOrEqual(jj, qpos))
        if p.local_window_size > 0:
            ok = op.And(ok, op.Greater(jj, op.Sub(qpos, p.local_window_size)))
        return ok


class _Body(_Tracer):
    """One layer's attention over a plan; methods mirror the oracle's steps. Attention in float32."""

    def __init__(self, op, cfg: PortableConfig, x: dict[str, ir.Value], plan: dict[str, ir.Value]) -> None:
        self.op = op
        self.c = cfg
        self.x = x
        self.plan = plan
        self.t_dtype = ir.DataType(cfg.act_dtype)
        self._rope_rows: tuple | None = None

    def round_t(self, v):
        """Round a float32 tensor to T and back: one T-arithmetic rounding, as the oracle's RoPE does."""
        return self.f32(self.op.Cast(v, to=self.t_dtype))

    # ------------------------------------------------------------------ run
    def run(self) -> list[ir.Value]:
        c, x = self.c, self.x
        q, k, v = self.split_qkv()
        if c.use_qk_norm:
            q = self.rms_norm(q, x["q_norm_weight"])
            k = self.rms_norm(k, x["k_norm_weight"])
        if c.rotary_dim > 0:
            # Q and K (both [T, heads, head_size]) rotated as one [T, N + kvh, H] tensor: half the kernels
            qk = self.rotary(self.op.Concat(q, k, axis=1))
            q, k = self.op.Split(qk, self.ints([c.num_heads, c.kv_num_heads]), axis=1, _outputs=2)
        k_cache = self.write(x["key_cache"], k, c.k_quant, x.get("k_scale"))
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

    def rope_rows(self):
        """cos and sin at every token's position, float32 ``[T, 1, half]``: gathered once per layer.

        (T arithmetic is emulated by explicit roundings, not run in float16: ONNX Runtime's CPU EP has no float16
        Mul/Add/Sub; the casts it inserts around them are then merged, dropping the roundings the oracle does.)"""
        if self._rope_rows is None:
            op = self.op
            cos, sin = self.x["cos_cache"], self.x["sin_cache"]
            # a position past the cos/sin rows is an out-of-bounds read on CUDA (the oracle raises); clamp so
            # that Gather stays in bounds; only invalid sequences (zero output, no writes) reach it with sane inputs
            rows = op.Min(self.dim(cos, 0), self.dim(sin, 0))
            p = op.Min(op.Max(self.plan["pos"], 0), op.Sub(rows, 1))
            self._rope_rows = (
                op.Unsqueeze(self.f32(op.Gather(cos, p)), [1]),
                op.Unsqueeze(self.f32(op.Gather(sin, p)), [1]),
            )
        return self._rope_rows

    def rotary(self, x):
        """RoPE on channels [offset, offset + rotary_dim) at position past + i; products and sums rounded to T.

        ``x`` is ``[T, heads, head_size]``; Q and K go through together (one set of kernels per layer)."""
        op, c = self.op, self.c
        off, rd, half = c.rotary_offset, c.rotary_dim, c.rotary_dim // 2
        cs, sn = self.rope_rows()
        seg = self.f32(op.Slice(x, [off], [off + rd], [2]) if (off, rd) != (0, c.head_size) else x)
        if c.rotary_interleaved:
            pairs = op.Reshape(seg, self.ints([0, 0, half, 2]))
            a, b = op.Split(pairs, axis=3, num_outputs=2, _outputs=2)
            a = op.Squeeze(a, [3])
            b = op.Squeeze(b, [3])
        else:
            a, b = op.Split(seg, axis=2, num_outputs=2, _outputs=2)
        r = self.round_t
        ya = r(op.Sub(r(op.Mul(a, cs)), r(op.Mul(b, sn))))
        yb = r(op.Add(r(op.Mul(b, cs)), r(op.Mul(a, sn))))
        if c.rotary_interleaved:
            y = op.Reshape(op.Concat(op.Unsqueeze(ya, [3]), op.Unsqueeze(yb, [3]), axis=3), self.ints([0, 0, rd]))
        else:
            y = op.Concat(ya, yb, axis=2)
        parts = []
        if off > 0:
            parts.append(op.Slice(x, [0], [off], [2]))
        parts.append(op.Cast(y, to=self.t_dtype))
        if off + rd < c.head_size:
            parts.append(op.Slice(x, [off + rd], [c.head_size], [2]))
        return parts[0] if len(parts) == 1 else op.Concat(*parts, axis=2)

    # ------------------------------------------------------------------ §3.4(c) cache write
    def write(self, cache, new, quant: str, scale):
        """ScatterND(cache input, the plan's write index, encoded rows): the only reader of the cache input."""
        op = self.op
        upd = op.Gather(new, self.plan["write_rows"])  # [n, kvh, H] in T
        upd = self.encode(upd, quant, scale)
        return op.ScatterND(cache, self.plan["write_index"], upd)

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
        o_dec = self.attend_group(q, k_cache, v_cache, "d_", one_query=True)  # [D, N * vh]
        # the prefill group runs under an If on its being non-empty: a decode-only step does not dispatch it
        empty = np.zeros((0, self.c.num_heads * self.c.v_head_size), np.float32)
        (o_pre,) = self.branch(
            pl["any_prefill"],
            "prefills",
            lambda: [self.attend_group(q, k_cache, v_cache, "p_", one_query=False)],
            lambda: [self.op.Constant(value=ir.tensor(empty))],
        )  # [P * max_q, N * vh]
        out = op.Gather(op.Concat(o_dec, o_pre, axis=0), pl["out_row"])
        return op.Cast(op.Where(pl["has_keys"], out, 0.0), to=self.t_dtype)

    def branch(self, condition, name: str, then_trace, else_trace) -> list:
        """``If(condition)`` over two traced branches (each returns a list of one value); the branches read
        the body's values from the enclosing scope."""
        outer = self.op

        def traced(trace):
            def fn(sub):
                self.op = sub
                try:
                    return trace()
                finally:
                    self.op = outer

            return fn

        branches = {
            key: outer.builder.subgraph(traced(fn), [], [ir.Value(name=f"{name}_{key}_0")], name=f"{name}_{key}")
            for key, fn in (("then", then_trace), ("else", else_trace))
        }
        for key, graph in branches.items():
            # the sub-builders number their values from 0 again: rename, or they would shadow the body's names
            declared = {id(v) for v in graph.outputs}
            for node in graph:
                node.name = f"{name}_{key}/{node.name}"
                for v in node.outputs:
                    if id(v) not in declared:
                        v.name = f"{name}_{key}/{v.name}"
        return [outer.If(condition, then_branch=branches["then"], else_branch=branches["else"], _outputs=1)]

    def attend_group(self, q, k_cache, v_cache, g_: str, *, one_query: bool):
        """Attention of one group over the plan's ``{g_}*`` indices (``d_``: decodes, ``p_``: prefills).

        ``one_query``: every member has exactly one query; the grid is then ``[S, 1, max_kv]`` with static
        query shapes. Returns the float32 output ``[S * max_q, N * vh]`` (row ``s * max_q + i``: query ``i`` of
        the group's ``s``-th sequence, in batch order).
        """
        op, c, pl = self.op, self.c, self.plan
        n, kvh, g, h, vh = c.num_heads, c.kv_num_heads, c.group, c.head_size, c.v_head_size
        row = pl[g_ + "row"]

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

    def read(self, cache, row, quant: str, scale, width: int):
        """Gather ``row`` ([S, kvh, max_kv]) of the cache viewed as [slots * kvh, width]; dequantize to float32."""
        op = self.op
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

        Those rows read some other block (page 0), which may belong to another sequence or hold garbage: a
        NaN or Inf there would reach this output through ``0 * NaN`` (keys need no such care: their masked
        scores are replaced by -inf with ``Where``). Zeroing them is a full pass over the gathered values
        (the cost of the MatMul itself at long contexts), so it runs only when the plan found such rows; a
        single sequence or equal lengths have none. In float32: ONNX Runtime's CPU Where has no float16 or
        bfloat16 kernel (it would wrap one in casts)."""
        pl = self.plan
        return self.branch(
            pl[g_ + "rows_ok"],
            f"{g_}pv",
            lambda: [self.op.MatMul(p, values)],
            lambda: [self.op.MatMul(p, self.op.Where(pl[g_ + "row_ok"], values, 0.0))],
        )[0]
