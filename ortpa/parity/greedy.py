"""Greedy decoding loops that record every step's logits, for parity between a dense model and its paged form.

* :func:`dense_greedy` runs a dense past/present model one prompt at a time, in the model's own format
  (:mod:`ortpa.formats.detect`: dynamo, onnxruntime-genai, optimum, transformers' OnnxExporter), feeding each step's
  present KV back as the next step's past; :func:`dense_forward` runs a whole sequence in one step.
* :func:`paged_greedy` runs a converted model through a :class:`~ortpa.runtime.session.PagedSession` with a
  :class:`~ortpa.runtime.kv.PagedKVCache`: every prompt's prefill in one packed step, then one packed decode
  step per new token for all prompts together.

Both return the logits that chose each new token, so two runs can be compared step by step. ``follow`` makes
the dense loop read a given token stream (teacher forcing) instead of its own argmax, so its logits stay
comparable to the paged run's even past a point where the two would pick different tokens; its own argmax is
still what it reports as its tokens.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import onnxruntime as ort

from ortpa.errors import InvalidParameter
from ortpa.formats.detect import DenseInterface, dense_interface, length_thresholds, session_interface
from ortpa.model.file import read_model
from ortpa.providers import CPU
from ortpa.runtime.kv import PagedKVCache
from ortpa.runtime.session import PagedSession

__all__ = ["DenseModel", "GreedyRun", "dense_forward", "dense_greedy", "open_dense", "paged_greedy"]


@dataclass
class GreedyRun:
    """``tokens[p]``: prompt ``p``'s new tokens; ``logits[p]``: ``[len(tokens[p]), vocab]`` float32 rows."""

    tokens: list[list[int]]
    logits: list[np.ndarray]
    seconds: float  # wall time of the session runs and the host work between them
    runs: int  # session.run calls
    # ``probes``' values, where asked: ``probed[p][step][name]``, the rows of prompt ``p``'s tokens fed at that step
    # (token-major: packed rows split by the step's cumulative lengths)
    probed: list[list[dict[str, np.ndarray]]] = field(default_factory=list)

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)


def _check_prompts(prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
    if not prompts or any(len(p) == 0 for p in prompts):
        raise InvalidParameter("greedy", "prompts", "at least one prompt, each of length >= 1", list(prompts))
    if max_new_tokens < 1:
        raise InvalidParameter("greedy", "max_new_tokens", ">= 1", max_new_tokens)


@dataclass(frozen=True)
class DenseModel:
    """A dense original opened for reference runs: its onnxruntime CPU session and how to feed it."""

    session: ort.InferenceSession
    interface: DenseInterface
    thresholds: tuple[int, ...]  # ortpa.formats.length_thresholds: a parity prompt should pass each


def open_dense(model: str | os.PathLike, *, threads: int | None = None) -> DenseModel:
    """Open the dense model at ``model`` (a path: the session reads its external data) on ONNX Runtime CPU.

    The graph is read through :func:`ortpa.model.file.read_model` (without weights) to find its format and
    interface. Memory reuse is off: onnxruntime-genai's fp16 builder declares the repeated K/V after the cache
    ``Concat`` with ``sequence_length`` where it holds ``total_sequence_length``, so ONNX Runtime's planner
    reuses a buffer of the wrong size on the first decode step ("Shape mismatch attempting to re-use buffer";
    onnxruntime-genai itself fails the same way on these files); without reuse the file runs as written.
    """
    proto = read_model(model, load_external_data=False).proto
    options = ort.SessionOptions()
    options.enable_mem_reuse = False
    options.log_severity_level = 3
    if threads:
        options.intra_op_num_threads = threads
    session = ort.InferenceSession(os.fspath(model), options, providers=[CPU])
    return DenseModel(session, dense_interface(proto), tuple(length_thresholds(proto)))


def _interface(session: ort.InferenceSession, interface: DenseInterface | None) -> DenseInterface:
    return interface if interface is not None else session_interface(session)


def dense_forward(
    session: ort.InferenceSession, tokens: Sequence[int], *, interface: DenseInterface | None = None
) -> np.ndarray:
    """One run of the whole token sequence on an empty cache: ``[len(tokens), vocab]`` float32 logits."""
    io = _interface(session, interface)
    out = session.run([io.logits], io.feed(list(tokens), 0, io.empty_past()))[0]
    return np.asarray(out[0], np.float32)


def dense_greedy(
    session: ort.InferenceSession,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    follow: Sequence[Sequence[int]] | None = None,
    interface: DenseInterface | None = None,
    probes: Sequence[str] = (),
) -> GreedyRun:
    """Greedy decoding of each prompt alone on a dense past/present model, fed in its own format.

    ``interface`` (from :func:`ortpa.formats.dense_interface` of the model) says which inputs the model takes
    (onnxruntime-genai: ``attention_mask`` only, or with ``position_ids``; optimum and dynamo exports: both;
    transformers' OnnxExporter: ``position_ids`` only) and how its caches are named, shaped and typed. Without
    it, the session's declared I/O is enough for models whose cache dims are all fixed. ``probes``: extra graph
    outputs of the session to record at each step (:attr:`GreedyRun.probed`).
    """
    _check_prompts(prompts, max_new_tokens)
    io = _interface(session, interface)
    outputs = [o.name for o in session.get_outputs()]
    start = time.perf_counter()
    tokens: list[list[int]] = []
    logits: list[np.ndarray] = []
    probed: list[list[dict[str, np.ndarray]]] = []
    runs = 0
    for p, prompt in enumerate(prompts):
        past = io.empty_past()
        feed_ids, length, mine, rows = list(prompt), 0, [], []
        probed.append([])
        for step in range(max_new_tokens):
            out = dict(zip(outputs, session.run(None, io.feed(feed_ids, length, past)), strict=True))
            runs += 1
            if probes:  # one prompt per run: every row of the value is this prompt's
                split = {name: _rows(out[name], len(feed_ids)) for name in probes}
                probed[p].append({n: v for n, v in split.items() if v is not None})
            row = np.asarray(out[io.logits][0, -1], np.float32)
            rows.append(row)
            mine.append(int(row.argmax()))
            past = io.next_past(out)
            length += len(feed_ids)
            if step + 1 < max_new_tokens:  # ``follow`` needs no token past the last step
                feed_ids = [int(follow[p][step]) if follow is not None else mine[-1]]
        tokens.append(mine)
        logits.append(np.stack(rows))
    return GreedyRun(tokens, logits, time.perf_counter() - start, runs, probed if probes else [])


def paged_greedy(
    session: PagedSession,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    block_size: int | None = None,
    follow: Sequence[Sequence[int]] | None = None,
    probes: Sequence[str] = (),
) -> GreedyRun:
    """Greedy decoding of all prompts together on a converted model: one packed prefill, then packed decodes.

    ``follow`` (teacher forcing, as in :func:`dense_greedy`): feed ``follow[p][step]`` as prompt ``p``'s next
    token instead of its own argmax, which it still reports as its token. ``probes``: extra graph outputs to record
    (:attr:`GreedyRun.probed`), token-major values whose packed rows are split per prompt."""
    _check_prompts(prompts, max_new_tokens)
    declared = {i.name for i in session.session.get_inputs()}
    kv = PagedKVCache(session.num_blocks, block_size or session.block_size)
    seqs = list(range(len(prompts)))
    for s in seqs:
        kv.add_sequence(s)
    pending = [list(p) for p in prompts]
    tokens: list[list[int]] = [[] for _ in prompts]
    rows: list[list[np.ndarray]] = [[] for _ in prompts]
    probed: list[list[dict[str, np.ndarray]]] = [[] for _ in prompts]
    start = time.perf_counter()
    for n in range(max_new_tokens):
        step = kv.plan_step([(s, len(pending[s])) for s in seqs])
        session.copy_blocks(kv.take_pending_copies())
        feed = step.model_feeds(
            np.array([t for s in seqs for t in pending[s]], np.int64),
            attention_metadata="attention_metadata" in declared,
            position_ids="position_ids" in declared,
        )
        outs = session.run(feed)
        out = outs["logits"]
        bounds = step.cumulative_sequence_length
        split = {name: _rows(outs[name], int(bounds[-1])) for name in probes}
        for j, s in enumerate(seqs) if probes else ():
            probed[s].append({n: v[bounds[j] : bounds[j + 1]] for n, v in split.items() if v is not None})
        # logits="last" gives one row per sequence; logits="all" one per packed token
        last = out if out.shape[0] == len(seqs) else out[step.last_token_indices]
        for j, s in enumerate(seqs):
            row = np.asarray(last[j], np.float32)
            rows[s].append(row)
            tokens[s].append(int(row.argmax()))
            pending[s] = [int(follow[s][n]) if follow is not None and n < len(follow[s]) else tokens[s][-1]]
    seconds = time.perf_counter() - start
    for s in seqs:
        kv.free(s)
    return GreedyRun(tokens, [np.stack(r) for r in rows], seconds, max_new_tokens, probed if probes else [])


def _rows(value: np.ndarray, tokens: int) -> np.ndarray | None:
    """``value`` with its leading dims that span the ``tokens`` packed rows merged into one (token-major); None
    where no leading dims do (left out of :attr:`GreedyRun.probed`)."""
    value = np.asarray(value)
    for i in range(1, value.ndim + 1):
        if int(np.prod(value.shape[:i])) == tokens:
            return value.reshape(tokens, *value.shape[i:])
    return None
