"""The plan of a portable PagedAttention step: the index work every layer shares, traced once per step.

:func:`build_plan_function` traces, as one ONNX function, everything a step's attention needs that depends only
on the index inputs (``cumulative_sequence_length``, ``past_seqlens``, ``block_table``, ``slot_mapping``), the
token count and the cache dims: sanitization (reference §3.4(a)), the de-duplicated write set (§3.4(c)), the
decode and prefill groups' gather rows and masks, and each token's output row (§3.4(d)/(e)). The lowering
(:mod:`ortpa.ops.portable`) calls it once before the first layer; the layer functions
(:mod:`ortpa.ops.portable.layer`) take its :data:`~ortpa.ops.portable.config.PLAN_OUTPUTS` as extra inputs.
With ``PlanConfig.if_free`` the prefill group's index work runs at every step (no ``If``), each group padded to at
least one member (a dummy sequence, :meth:`_Plan.dummy_sequence`) and one key, and the flags are constants.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxscript

from ortpa.ops.portable.config import INDEX_TYPE, PlanConfig
from ortpa.ops.portable.tracer import FUNCTION_DOMAIN, GraphTracer

__all__ = ["build_plan_function"]

_F32 = ir.DataType.FLOAT
_I64 = ir.DataType.INT64
_INT64_MAX = 2**63 - 1


def build_plan_function(plan: PlanConfig) -> ir.Function:
    """The index work of one step (sanitization, write set, groups, masks, output rows): :data:`PLAN_OUTPUTS`."""
    # typed index inputs (the op's S): every traced value's type is known, no CastLike (config.PLAN_OUTPUT_TYPES)
    inputs = [ir.val(name, INDEX_TYPE if name not in ("query", "key_cache") else None) for name in plan.inputs]

    def trace(op, *vals):
        x = dict(zip(plan.inputs, vals, strict=True))
        return _Plan(op, plan, x).run()

    return onnxscript.build_function(
        trace, inputs, domain=FUNCTION_DOMAIN, name=plan.function_name(), opset_imports={"": plan.opset}
    )


_PREFILL_KEYS = ("query", "row", "row_ok", "allowed", "rows_ok", "count", "max_q", "max_kv")


class _Plan(GraphTracer):
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
        if self.p.if_free:
            self.dummy_sequence()
        dec = self.group(is_dec, one_query=True)
        # A group runs only when one of its members attends a key: no kernel is ever called on an empty batch or
        # an empty key range (com.microsoft::MultiHeadAttention before ONNX Runtime 1.29 divides by zero on an
        # empty batch: SIGFPE). A member without a key reads the zero row (out_row) anyway. (If-free: both groups
        # always run, each with at least one member and one key, the flags unread.)
        if self.p.if_free:
            # no If reads the flags: constants, not three kernels each that OpenVINO leaves to the CPU EP
            any_pre, any_dec = (op.Constant(value=ir.tensor(True)) for _ in range(2))  # two outputs, two values
            pre = dict(zip(_PREFILL_KEYS, self.prefill_group(is_pre), strict=True))
        else:
            has_kv = op.Greater(self.kvlen, 0)
            any_pre = op.Greater(op.ReduceSum(op.Cast(op.And(is_pre, has_kv), to=_I64), keepdims=0), 0)
            any_dec = op.Greater(op.ReduceSum(dec["mask"], keepdims=0), 0)
            # a decode-only step skips the prefill group's ~40 index kernels; the layers then never read them
            kvh = self.p.kv_num_heads
            empty = [
                np.zeros((0, 0), np.int64),  # query
                np.zeros((0, kvh, 0), np.int64),  # row
                np.zeros((0, 1, 0, 1), np.bool_),  # row_ok
                np.zeros((0, 1, 0, 1, 0), np.bool_),  # allowed
                np.array(True),  # rows_ok
                *(np.zeros(1, np.int64) for _ in range(3)),  # count, max_q, max_kv
            ]
            pre = dict(
                zip(
                    _PREFILL_KEYS,
                    self.branch(
                        any_pre,
                        "prefill_plan",
                        lambda: self.prefill_group(is_pre),
                        lambda: [self.constant(a) for a in empty],
                        count=len(_PREFILL_KEYS),
                    ),
                    strict=True,
                )
            )

        # each sequence's first row in Concat(o_dec, o_pre): its rank within its group, times the group's max_q
        rank_dec = op.CumSum(op.Cast(is_dec, to=_I64), op.Constant(value_int=0))  # rank + 1 where is_dec
        rank_pre = op.CumSum(op.Cast(is_pre, to=_I64), op.Constant(value_int=0))
        first_pre = op.Add(op.Mul(op.Sub(rank_pre, 1), pre["max_q"]), dec["count"])
        first = op.Where(is_dec, op.Sub(rank_dec, 1), first_pre)
        out_row = op.Add(op.Gather(first, self.seq), self.s_in)  # every token's own row, back in token order
        # nothing to attend (invalid or empty sequence) is a zero row; when no sequence of a group has a key,
        # its max_kv == 0 and ONNX Runtime's CPU MatMul with an empty inner dimension returns uninitialised memory.
        # A decode whose every key is masked (its own page unmapped) is a zero row too: the fused decode path
        # (MultiHeadAttention, whose fully masked rows are NaN) relies on it; the other paths give 0 there anyway.
        # Such tokens read the zero row the layers append after both groups (a Gather, no Where per layer).
        d_any = op.ReduceSum(dec["mask"], [1], keepdims=0)  # [D] attended keys (0 when max_kv == 0)
        seq_ok = op.Cast(op.Not(is_dec), to=_I64)
        if self.p.if_free:  # the group's members may include the dummy sequence B: scatter into B + 1 entries
            seq_ok = op.Pad(seq_ok, self.pads([0, 1]))
        seq_ok = op.ScatterElements(seq_ok, dec["sel"], d_any)
        has_keys = op.And(op.Greater(op.Gather(self.kvlen, self.seq), 0), op.Greater(op.Gather(seq_ok, self.seq), 0))
        zero_row = op.Add(op.Mul(pre["count"], pre["max_q"]), dec["count"])  # [1]
        out_row = op.Where(has_keys, out_row, zero_row)
        return [
            self.pos,
            rows,
            index,
            any_pre,
            any_dec,
            out_row,
            dec["query"],
            dec["row"],
            dec["allowed"],
            op.Where(dec["allowed"], op.Constant(value_float=0.0), op.Constant(value_float=float("-inf"))),
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
        idx = op.Range(0, self.scalar(n1), 1)
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
        t = op.Range(0, self.scalar(self.T), 1)
        owns = op.Cast(op.LessOrEqual(op.Unsqueeze(c_hi, [0]), op.Unsqueeze(t, [1])), to=_I64)
        self.seq = op.ReduceSum(owns, [1], keepdims=0)
        self.s_in = op.Sub(t, op.Gather(self.c_lo, self.seq))
        self.pos = op.Add(op.Gather(self.past, self.seq), self.s_in)
        self.live = op.Gather(valid, self.seq)

    def dummy_sequence(self) -> None:
        """(If-free) the per-sequence values with one more sequence, ``B``, that a group takes as its only member
        when it has none: no token, no key, an unmapped block table row, its query the zero row ``T`` the layers
        append to the queries. The block table also gets an unmapped column, so that a group's first key (a group
        attends at least one) has a page even when the table has no column."""
        op = self.op
        pad = self.pads([0, 1])
        self.g_kvlen, self.g_past, self.g_q_len = (op.Pad(v, pad) for v in (self.kvlen, self.past, self.q_len))
        self.g_c_lo = op.Concat(self.c_lo, self.T, axis=0)  # not a Pad by a computed value: OpenVINO leaves it
        self.g_bt = op.Pad(self.bt, self.pads([0, 0, 1, 1]), op.Constant(value_int=-1))

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
    def prefill_group(self, member) -> list[ir.Value]:
        group = self.group(member, one_query=False)  # traced once, then read key by key
        return [group[k] for k in _PREFILL_KEYS]

    def group(self, member, *, one_query: bool) -> dict:
        """Indices and masks of the sequences where ``member`` holds, padded to their longest query and KV length.

        ``one_query`` (decodes): every member has one query at position ``past`` and ``kvlen == past + 1`` (an
        invalid one has ``kvlen == 0``), so the causal mask is implied by the KV length (:meth:`decode_group`).
        """
        op = self.op
        sel = op.Reshape(op.NonZero(member), self.ints([-1]))
        if self.p.if_free:  # at least one member: the dummy sequence B when there is none (dummy_sequence)
            sel = op.Slice(op.Concat(sel, self.dim(self.kvlen, 0), axis=0), [0], op.Max(self.dim(sel, 0), 1))
            seqs = (self.g_kvlen, self.g_past, self.g_c_lo, self.g_bt, self.g_q_len)
        else:
            seqs = (self.kvlen, self.past, self.c_lo, self.bt, self.q_len)
        count = self.dim(sel, 0)
        kvlen, past, c_lo = (op.Gather(v, sel) for v in seqs[:3])
        bt = op.Gather(seqs[3], sel, axis=0)
        # ReduceMax of an empty group: 0, never the reduction's identity. A padded 0, not a Concat with one:
        # OpenVINO's CPU plug-in gives ReduceMax(Concat(x, [0])) the Concat's shape, not [1]
        maxkv = op.ReduceMax(op.Pad(kvlen, self.pads([0, 1])), [0], keepdims=1)
        if self.p.if_free:  # at least one key: no kernel sees an empty key range
            maxkv = op.Max(maxkv, 1)
        j = op.Range(0, self.scalar(maxkv), 1)  # kv position

        # kv rows through the sanitized block table; one gathered row per (s, kv head, j): no transposes of KV
        blk_j = op.Div(j, self.BS)
        pages = op.Gather(bt, blk_j, axis=1)  # [S, max_kv]; max_kv <= capacity keeps blk_j in range
        mapped = op.GreaterOrEqual(pages, 0)
        inside = op.Less(op.Unsqueeze(j, [0]), op.Unsqueeze(kvlen, [1]))  # [S, max_kv]: j < the sequence's length
        live = op.And(mapped, inside)
        slot_j = op.Add(op.Mul(op.Max(pages, 0), self.BS), op.Mod(j, self.BS))  # the true slot where mapped
        if one_query:
            return self.decode_group(sel, count, c_lo, past, j, live, slot_j)
        # Prompt chunks. Padding rows (j >= kvlen) would read some other block (page 0), which may belong to
        # another sequence or hold garbage, and a NaN there would reach the output through 0 * NaN in P @ V. They
        # read the sequence's own last row instead (position kvlen - 1, attended anyway: whatever it holds
        # reaches the output already) when that page is mapped. Only unmapped pages inside the range, or a
        # sequence without such a last row, are left, and the layers zero those values (an If on rows_ok): a full
        # pass over the gathered values.
        last = op.Unsqueeze(op.Max(op.Sub(kvlen, 1), 0), [1])  # [S, 1]
        last_page = op.GatherElements(bt, op.Div(last, self.BS), axis=1)  # last < kvlen <= capacity: in range
        last_slot = op.Add(op.Mul(op.Max(last_page, 0), self.BS), op.Mod(last, self.BS))
        last_ok = op.And(op.Greater(op.Unsqueeze(kvlen, [1]), 0), op.GreaterOrEqual(last_page, 0))  # [S, 1]
        slot = op.Where(inside, slot_j, last_slot)
        row = self.kv_rows(slot)
        row_ok = op.Unsqueeze(live, [1, 3])  # [S, 1, max_kv, 1] against the gathered [S, kvh, max_kv, H]
        if self.p.if_free:  # the layers zero them at every step (no If reads rows_ok)
            rows_ok = op.Constant(value=ir.tensor(True))
        else:
            unsafe = op.Or(op.And(inside, op.Not(mapped)), op.And(op.Not(inside), op.Not(last_ok)))
            rows_ok = op.Not(op.Greater(op.ReduceSum(op.Cast(unsafe, to=_I64), keepdims=0), 0))
        maxq = op.ReduceMax(op.Pad(op.Gather(seqs[4], sel), self.pads([0, 1])), [0], keepdims=1)
        # padding rows read a real token, never gathered back (if-free: the layers' zero row T is one too)
        last_tok = self.T if self.p.if_free else op.Sub(self.T, 1)
        if self.p.if_free:  # at least one query row
            maxq = op.Max(maxq, 1)
        i = op.Range(0, self.scalar(maxq), 1)  # query index within a sequence
        tok = op.Add(op.Unsqueeze(c_lo, [1]), op.Unsqueeze(i, [0]))
        tok = op.Max(op.Min(tok, last_tok), 0)
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

    def kv_rows(self, slot):
        """[S, kvh, max_kv]: the row of each (sequence, kv head, position) in the cache viewed as [slots * kvh, H]."""
        op, kvh = self.op, self.p.kv_num_heads
        return op.Add(op.Mul(op.Unsqueeze(slot, [1]), kvh), op.Unsqueeze(op.Range(0, kvh, 1), [0, 2]))

    def decode_group(self, sel, count, c_lo, past, j, live, slot_j) -> dict:
        """The decodes' rows and masks: one query each, at position ``past``, so ``j < kvlen`` is the causal mask.

        Every position of a decode that is not live (padding, an unmapped page) reads a row it attends (any one:
        the largest such slot), so the gathered K and V hold only the sequence's own rows: NaN or Inf in another
        sequence's blocks or in never-written memory cannot leak in, and no zeroing pass (nor an ``If`` choosing
        one) is needed. Live rows outside the window keep their own slot: the oracle multiplies them by a zero
        probability, so what they hold reaches its output as it does here. A decode that attends nothing reads
        slot 0 and takes the zero row (the plan's ``out_row``).
        """
        op, p = self.op, self.p
        allowed = live
        if p.local_window_size > 0:
            near = op.Greater(op.Unsqueeze(j, [0]), op.Unsqueeze(op.Sub(past, p.local_window_size), [1]))
            allowed = op.And(live, near)
        # a -1 column keeps the key axis non-empty when no decode has a key (ONNX Runtime before 1.21 fails a
        # ReduceMax over an empty axis; later ones give INT64_MIN); -1 is clamped to slot 0
        none = op.Constant(value_int=-1)
        some = op.Max(
            op.ReduceMax(op.Pad(op.Where(allowed, slot_j, -1), self.pads([0, 0, 0, 1]), none), [1], keepdims=1), 0
        )
        row = self.kv_rows(op.Where(live, slot_j, some))
        return {
            "query": c_lo,
            "row": row,
            "allowed": op.Unsqueeze(allowed, [1, 2]),  # [S, 1, 1, max_kv] against the scores [S, kvh, G, max_kv]
            "count": count,
            "mask": op.Cast(allowed, to=_I64),
            "sel": sel,
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
