"""Where a refused conversion first differs from its original: :func:`first_diverging_layer`.

Both graphs get, for each layer, the first value after its attention that keeps its name through the rewrite
(the output projection's output; the residual sum where MLA absorption folded the projection) as an extra graph
output (temporary header copies; the weights stay in their files); one prompt's prefill runs on each, and the first
layer past the structure bound is the cause reported. Comparing there rather than only the logits points at the
layer, not at the end of the model. A layer's output is compared row by row along its token axis, found from its
shape against the number of tokens fed (exports differ: token-major ``[T, H*d]``, or heads first), and not compared
where that axis cannot be told.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Sequence

import numpy as np
import onnx

from ortpa.model.file import LoadedModel
from ortpa.parity.routing import probe_graph as _probe
from ortpa.parity.upcast import twin_session_options
from ortpa.providers import CPU
from ortpa.tolerances import structure_tolerance

__all__ = ["first_diverging_layer", "lean_options", "twin_options"]

_BLOCK_SIZE = 16


def lean_options():
    """Session options for a few verification steps: no weight prepacking, so ONNX Runtime's CPU kernels read
    the memory-mapped weights in place instead of copying each MatMul's weight into private memory (measured on a
    0.85 GB model's original: 561 MB of private memory with prepacking, 2 MB without)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.add_session_config_entry("session.disable_prepacking", "1")
    # no memory pattern: ONNX Runtime plans the initializers with it too, one anonymous block of every weight's
    # bytes, reserved and never touched (the weights are memory-mapped), which a model larger than memory cannot
    # get (std::bad_alloc opening the float32 twin of a 25.75 GB float16 model on 25 GB; docs/large_models.md)
    options.enable_mem_pattern = False
    return options


def twin_options():
    """:func:`lean_options` for a float32 twin: its casts of half weights run per use (:mod:`ortpa.parity.upcast`)."""
    return twin_session_options(lean_options())


def _layer_outputs(proto: onnx.ModelProto, known: set[str]) -> list[tuple[int, str]]:
    """(layer, name) for each PagedAttention node: the first value after it, along its single-consumer chain,
    that also exists in the original (``known``): its output projection's output, or where the rewrite folded
    that projection (MLA absorption), the residual sum after it."""
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in proto.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    found = []
    for index, node in enumerate(n for n in proto.graph.node if _is_attention(n)):
        value = node.output[0]
        for _ in range(64):  # Reshape / Cast / the projection(s) / the merge of the expanded prefill / the residual Add
            nexts = consumers.get(value, [])
            if len(nexts) != 1 or not nexts[0].output:
                break
            value = nexts[0].output[0]
            if value in known:
                found.append((index, value))
                break
    return found


def _is_attention(node: onnx.NodeProto) -> bool:
    """A PagedAttention node, or its portable function call (the float32 twin's), not the step's plan call."""
    from ortpa.ops.portable import FUNCTION_DOMAIN

    if node.op_type == "PagedAttention":
        return True
    return node.domain == FUNCTION_DOMAIN and node.op_type.startswith("PagedAttention_")


def first_diverging_layer(
    original: str | os.PathLike | LoadedModel,
    converted: str | os.PathLike | LoadedModel,
    prompt: Sequence[int],
    tolerance: float | None = None,
) -> str:
    """``"layer i (value): max |d| x"`` for the first layer whose attention block output (its o_proj) differs
    past ``tolerance`` (default: :func:`ortpa.tolerances.structure_tolerance` of float32) of each token row's
    scale on ``prompt`` (its first token prefilled, the rest a chunk over it, so both of MLA's attention forms
    run); a sentence saying why when none is found. ``converted``: a converted model's
    path, or a model already read (the float32 twin)."""
    from ortpa.formats.detect import dense_interface
    from ortpa.model.file import read_model
    from ortpa.runtime.kv import PagedKVCache
    from ortpa.runtime.session import InferenceSession, PagedSession

    tol = structure_tolerance("float32") if tolerance is None else tolerance  # an error when no sizes are known
    paged_file = converted if isinstance(converted, LoadedModel) else read_model(converted, load_external_data=False)
    dense_file = original if isinstance(original, LoadedModel) else read_model(original, load_external_data=False)
    dense_names = {v for n in dense_file.proto.graph.node for v in n.output}
    layers = _layer_outputs(paged_file.proto, dense_names)
    if not layers:
        return "not located: no value after any layer's attention has the same name in both graphs"
    names = [name for _, name in layers]
    # a label that is not the file's path: the session then opens this graph, not the file (weights still from
    # the model's own data files)
    probe = LoadedModel(
        _probe(paged_file.proto, names), f"{paged_file.label} (probe)", paged_file.base_dir, paged_file.external
    )
    blocks = -(-len(prompt) // _BLOCK_SIZE) + 1
    # a float32 twin's casts of half weights run per use, not folded into float32 copies (ortpa.parity.upcast)
    paged = PagedSession(probe, num_blocks=blocks, block_size=_BLOCK_SIZE, providers=[CPU], sess_options=twin_options())
    kv = PagedKVCache(paged.num_blocks, paged.block_size)
    kv.add_sequence(0)
    declared = {i.name for i in paged.session.get_inputs()}
    # the first token as a fresh prefill, the rest as a chunk over it: a model with two attention forms (MLA's
    # expanded prefill, the absorbed node for rows with a cached prefix) is located in both
    parts: list[list[np.ndarray]] = [[] for _ in names]
    chunks = [prompt[:1], prompt[1:]] if len(prompt) > 1 else [prompt]
    for chunk in chunks:
        step = kv.plan_step([(0, len(chunk))])
        feed = step.model_feeds(
            np.array(list(chunk), np.int64),
            attention_metadata="attention_metadata" in declared,
            position_ids="position_ids" in declared,
        )
        out = paged.run(feed, names)
        for k, name in enumerate(names):
            parts[k].append(np.asarray(out[name], np.float32))
    lengths = [len(c) for c in chunks]
    del paged
    gc.collect()
    dense_probe = LoadedModel(
        _probe(dense_file.proto, names), f"{dense_file.label} (probe)", dense_file.base_dir, dense_file.external
    )
    options = twin_options()
    options.enable_mem_reuse = False
    session = InferenceSession(dense_probe, options, providers=[CPU])
    io = dense_interface(dense_file.proto)
    want = dict(zip(names, session.run(names, io.feed(list(prompt), 0, io.empty_past())), strict=True))
    del session
    unknown = []
    for k, (layer, name) in enumerate(layers):
        rows = _token_rows(np.asarray(want[name], np.float32), parts[k], len(prompt), lengths)
        if rows is None:  # no token axis to join or compare rows by: this layer is skipped
            unknown.append(f"layer {layer} ({name})")
            continue
        b, a = rows
        if a.shape != b.shape:
            return f"not located: layer {layer}'s {name} is {a.shape} converted, {b.shape} original"
        err = float(np.abs(a - b).max())
        scale = np.maximum(1.0, np.abs(b).max(axis=-1, keepdims=True))
        if not bool((np.abs(a - b) <= tol * scale).all()):
            return f"layer {layer} ({name}): max |d| {err:.3e} after its attention (bound {tol:.1e} of its scale)"
    skipped = f" ({', '.join(unknown)}: no token axis known, not compared)" if unknown else ""
    return (
        f"none of {len(layers) - len(unknown)} layers' attention outputs differs past the bound on a prefill of "
        f"these tokens{skipped}"
    )


def _token_axis(shapes: Sequence[Sequence[int]], tokens: Sequence[int]) -> int | None:
    """The one axis along which ``shapes`` (one value's, from runs of ``tokens`` tokens each) hold their runs'
    tokens while agreeing on every other axis; None where none or several could. Exports differ: token-major
    ``[T, H*d]``, or heads first, ``[1, H, T, d]`` (the dynamo export's view before its transpose)."""
    if len({len(s) for s in shapes}) != 1:
        return None
    rank = len(shapes[0])
    axes = [
        i
        for i in range(rank)
        if all(s[i] == n for s, n in zip(shapes, tokens, strict=True))
        and all(len({s[j] for s in shapes}) == 1 for j in range(rank) if j != i)
    ]
    return axes[0] if len(axes) == 1 else None


def _token_rows(
    whole: np.ndarray, parts: Sequence[np.ndarray], tokens: int, lengths: Sequence[int]
) -> tuple[np.ndarray, np.ndarray] | None:
    """``(whole's rows, the parts' rows joined)``, each ``[tokens, rest]``: one value of the original's run of
    ``tokens`` tokens and of the converted model's consecutive chunks (``lengths`` tokens each), along the token
    axis the shapes of all runs tell together (one run's axes of its token count may be several: a one-token
    chunk's size-1 axes, heads as many as tokens); each side's own where their ranks differ. None where it cannot
    be told."""
    shapes = [p.shape for p in parts]
    if len({whole.ndim, *(p.ndim for p in parts)}) == 1:
        mine = theirs = _token_axis([whole.shape, *shapes], [tokens, *lengths])
    else:
        mine, theirs = _token_axis([whole.shape], [tokens]), _token_axis(shapes, lengths)
    if mine is None or theirs is None:
        return None
    joined = np.concatenate([np.moveaxis(p, theirs, 0).reshape(n, -1) for p, n in zip(parts, lengths, strict=True)])
    return np.moveaxis(whole, mine, 0).reshape(tokens, -1), joined
