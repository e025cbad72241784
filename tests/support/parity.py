"""Dense-vs-paged parity driver shared by the rewriter tests (any family: MLA LATENT, MHA/GQA SEPARATE).

The reference is the dense export run by ONNX Runtime on CPU, one sequence at a time with its own past/present
KV. The converted model runs through :class:`ortpa.runtime.session.PagedSession` (PagedAttention lowered to
``ortpa.ops.portable`` on CPU, caches owned as OrtValues and updated in place) with block tables and index
tensors from :class:`ortpa.runtime.kv.PagedKVCache`. Three prompts of different lengths are prefilled in one
packed step, then decoded with continuous batching: at step 4 one sequence leaves and a new prompt's prefill
joins the running decodes in the same step, so sequences sit at different positions throughout.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from ortpa.dtypes import dtype_name
from ortpa.errors import ConversionError
from ortpa.parity.greedy import open_dense
from ortpa.parity.rule import kl_divergence
from ortpa.rewriter.pipeline import convert
from ortpa.runtime.kv import PagedKVCache
from ortpa.runtime.session import PagedSession
from support.tolerances import max_tie_flips, precision_kl_bound, precision_ties

__all__ = ["DenseModel", "ParityResult", "attrs", "check_near_miss", "near_miss", "paged_nodes", "run_parity"]

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
BLOCK_SIZE, NUM_BLOCKS = 16, 24
PROMPTS = (("A", 5), ("B", 11), ("C", 3))
LATE_PROMPT, LEAVER, JOIN_STEP = ("D", 6), "C", 4


def _options() -> ort.SessionOptions:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    opts.log_severity_level = 3
    # genai fp16 builds declare total-length tensors as sequence_length: with memory reuse on, the first decode
    # after a prefill can fail with "Shape mismatch attempting to re-use buffer" (ortpa.parity.greedy.open_dense)
    opts.enable_mem_reuse = False
    return opts


class DenseModel:
    """The dense original, one sequence at a time in its own format, feeding present KV back as past KV."""

    def __init__(self, path: Path | str) -> None:
        dense = open_dense(path, threads=2)
        self.sess, self.io = dense.session, dense.interface
        self.thresholds = dense.thresholds

    def new(self) -> dict:
        return {"len": 0, "kv": self.io.empty_past()}

    def step(self, state: dict, ids: list[int]) -> np.ndarray:
        """Run ``ids`` after the sequence's past; return the last token's logits."""
        feed = self.io.feed(list(ids), state["len"], state["kv"])
        names = [o.name for o in self.sess.get_outputs()]
        out = dict(zip(names, self.sess.run(None, feed), strict=True))
        state["kv"] = self.io.next_past(out)
        state["len"] += len(ids)
        return np.asarray(out[self.io.logits][0, -1], np.float32)


@dataclass
class ParityResult:
    max_abs_error: float = 0.0
    steps: int = 0
    tokens_checked: int = 0
    max_context: int = 0
    errors: list[float] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)  # per step, per sequence: the checked rows (float32)
    tie_flips: int = 0  # greedy steps whose token differs from the reference's at a tie (ortpa.tolerances)
    near_ties: int = 0  # steps whose reference top-2 gap is within twice that row's error (its token says little)


def run_parity(
    converted: onnx.ModelProto,
    dense_path: Path | str,
    *,
    dtype=np.float16,
    steps: int = 8,
    seed: int = 0,
    vocab: int = 256,
    allow_ties: bool = True,
    scatter_blocks: bool = False,
    logits: str = "auto",
    providers: list[str] | None = None,
    follow_reference: bool = False,
    reference=None,
    paged_attention: str | None = None,
) -> ParityResult:
    """Continuous batching on ``converted`` vs the dense model, judged by the precision rule of the one
    verification rule (:mod:`ortpa.parity.rule`): each row's next-token KL divergence within
    :func:`ortpa.tolerances.precision_kl_bound` of ``dtype`` (the deployed precision: ``np.float16``, ``"int8"``
    for int8 caches or int8-quantizing originals), and greedy tokens identical except at a tie flip
    (:func:`ortpa.tolerances.precision_ties`: the reference's gap between the two tokens within the tie
    margin), at most :func:`ortpa.tolerances.max_tie_flips` of the
    checked tokens; both models then continue with the paged model's token, so their histories stay
    identical. Flips are counted in ``ParityResult.tie_flips``. ``allow_ties=False`` demands identical greedy
    tokens at every step. ``follow_reference`` continues with the
    dense model's token instead, so two runs of this driver (say CUDA and CPU) see identical histories whatever
    their tie-breaks, and their ``ParityResult.logits`` compare row by row. ``reference``: another model with
    :class:`DenseModel`'s ``new()`` / ``step(state, ids)`` (say the PyTorch model itself) instead of ``dense_path``.

    ``scatter_blocks`` hands out blocks in a random order (drawn from ``seed`` before the prompts), so the block
    table really is a page table. ``logits``: ``"last"`` requires one logits row per sequence, ``"all"`` one per
    packed token (the last of each sequence is checked), ``"auto"`` accepts either. ``paged_attention`` forces a
    PagedAttention path (:class:`ortpa.InferenceSession`; on CPU the native kernel by default).
    """
    precision = "int8" if dtype == "int8" else dtype_name(dtype)
    ties, kl_bound = precision_ties(precision), precision_kl_bound(precision)
    sess = PagedSession(
        converted,
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        providers=providers or ["CPUExecutionProvider"],
        sess_options=_options(),
        paged_attention=paged_attention,
    )
    wanted = {i.name for i in sess.session.get_inputs()}
    dense = reference if reference is not None else DenseModel(dense_path)
    kv = PagedKVCache(NUM_BLOCKS, BLOCK_SIZE)
    rng = np.random.default_rng(seed)
    if scatter_blocks:
        order = [int(b) for b in rng.permutation(NUM_BLOCKS)]
        kv.pool.allocate(NUM_BLOCKS)  # take every block, then free them back in a random queue order
        kv.pool.free(reversed(order))
    seqs: dict[str, dict] = {}

    def add(name: str, length: int) -> None:
        kv.add_sequence(name)
        seqs[name] = {"pending": [int(t) for t in rng.integers(0, vocab, length)], "dense": dense.new()}

    for name, length in PROMPTS:
        add(name, length)
    result = ParityResult()
    for step in range(steps):
        if step == JOIN_STEP:
            kv.free(LEAVER)
            del seqs[LEAVER]
            add(*LATE_PROMPT)
        names = list(seqs)
        plan = kv.plan_step([(n, len(seqs[n]["pending"])) for n in names])
        feed = {
            "input_ids": np.array([t for n in names for t in seqs[n]["pending"]], np.int64),
            "cumulative_sequence_lengths": plan.cumulative_sequence_length,
            "past_sequence_lengths": plan.past_seqlens,
            "block_table": plan.block_table,
            "attention_metadata": plan.attention_metadata,
            "position_ids": plan.positions,
        }
        out = sess.run({k: v for k, v in feed.items() if k in wanted})
        all_rows = out["logits"]
        if logits == "last":
            assert all_rows.shape[0] == len(names), f"step {step}: {all_rows.shape[0]} rows for {len(names)} sequences"
        one_per_sequence = logits == "last" or (logits == "auto" and all_rows.shape[0] == len(names))
        rows = all_rows if one_per_sequence else all_rows[plan.last_token_indices]
        assert rows.shape[0] == len(names), f"step {step}: {rows.shape[0]} logits rows for {len(names)} sequences"
        for j, name in enumerate(names):
            seq = seqs[name]
            ref = dense.step(seq["dense"], seq["pending"])
            got = np.asarray(rows[j], np.float32)
            kl = kl_divergence(ref, got)
            assert kl <= kl_bound, f"step {step}, sequence {name}: next-token KL {kl:.3e} above {kl_bound:.3e}"
            err = float(np.abs(got - ref).max())
            result.errors.append(err)
            result.logits.append(got)
            result.max_abs_error = max(result.max_abs_error, err)
            token = int(got.argmax())
            verdict = ties.classify(ref, token)
            where = f"step {step}, sequence {name}: greedy token {token}, reference {int(ref.argmax())}"
            assert verdict != "mismatch", f"{where} (gap {float(ref.max() - ref[token]):.2e} is no tie)"
            assert verdict == "exact" or allow_ties, f"{where} (a tie, but ties are not allowed here)"
            result.tie_flips += verdict == "tie"
            top2 = np.sort(ref)[-2:]
            result.near_ties += float(top2[1] - top2[0]) <= 2 * err  # this row's own error could swap them
            result.tokens_checked += 1
            result.max_context = max(result.max_context, seq["dense"]["len"])
            seq["pending"] = [int(ref.argmax()) if follow_reference else token]
        result.steps += 1
    bound = max_tie_flips(result.tokens_checked)
    flips = f"{result.tie_flips} tie flips in {result.tokens_checked} tokens"
    assert result.tie_flips <= bound, f"{flips} (at most {bound})"
    return result


def attrs(node: onnx.NodeProto) -> dict:
    """A node's attributes as a ``{name: value}`` dict."""
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def paged_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == "PagedAttention"]


def near_miss(fixture: str) -> onnx.ModelProto:
    """The fixture with layer 1's Softmax turned into a Sigmoid: attention-shaped, but not softmax attention."""
    model = onnx.load(str(FIXTURES / f"{fixture}.onnx"))
    softmaxes = [n for n in model.graph.node if n.op_type == "Softmax"]
    assert len(softmaxes) == 2
    softmaxes[1].op_type = "Sigmoid"
    del softmaxes[1].attribute[:]
    return model


def check_near_miss(model: onnx.ModelProto, match: str, match_layers, layer_type: type, failure_type: type) -> None:
    """``convert`` reports layer 1 (not a Softmax) and leaves the input alone; the matcher finds layer 0 only."""
    before = hashlib.sha256(model.SerializeToString()).hexdigest()
    with pytest.raises(ConversionError, match=match) as info:
        convert(model)
    assert hashlib.sha256(model.SerializeToString()).hexdigest() == before  # the input is never modified
    (where, why), *rest = info.value.failures
    assert not rest and where.startswith("layer 1") and "not a Softmax" in why
    results = match_layers(ir.serde.deserialize_model(model).graph)
    assert isinstance(results[0], layer_type) and isinstance(results[1], failure_type)
