"""Routing ties: steps where a mixture-of-experts router picks other experts in the deployed model than in the
original because two experts' scores are closer than the deployed precision can tell apart.

A router is found structurally: a ``TopK`` over a data-dependent tensor (one that depends on a graph input)
whose chosen indices feed a selection (``Gather*``, ``Scatter*``, ``OneHot``, comparisons, directly or through
shape-only ops). DeepSeek-V3's group-limited routing has two: the groups, then the experts. genai's ``MoE`` /
``QMoE`` ops route inside the op and expose no chosen indices: they are not probed, so a step that differs there
is judged as any other (no excuse; a near-tie there can still refuse a correct model).

:func:`routing_ties` re-runs the original and the deployed model teacher-forced on the original's tokens, with
each router's scores and chosen indices as extra graph outputs (a header copy; the weights stay in their files).
A step (prompt ``p``, step ``s``) is a routing tie when, at the first router (in graph order) where some row of
``p`` at that step is routed differently, in every such row the experts the deployed model dropped and those it
took instead scored, in the original, within :func:`ortpa.tolerances.routing_tie_width` of the deployed precision
of each other (for one swapped pair: the margin between the k-th and (k+1)-th score). Later routers are not
looked at: once one layer mixed other experts, the next layers' hidden states differ by an expert's output, not
by rounding, and their routing follows. A first difference at a wide margin is no tie: the step is judged.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx

from ortpa.model.file import LoadedModel
from ortpa.parity.greedy import GreedyRun, dense_greedy, paged_greedy
from ortpa.tolerances import routing_tie_width

__all__ = ["Router", "find_routers", "probe_graph", "routing_tie_steps", "routing_ties"]

# what a router's chosen indices select with
_SELECTS = frozenset(
    {"Gather", "GatherElements", "GatherND", "ScatterElements", "ScatterND", "OneHot", "Equal", "Scatter"}
)
# ops between the indices and the selection that only move or retype them
# (a TopK over the chosen indices is the dispatch's sort of them by expert, as DeepSeek-V2's export has)
_PASS = frozenset({"Cast", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Transpose", "Identity", "Expand", "TopK"})
_FLOATS = frozenset(
    {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}
)


@dataclass(frozen=True)
class Router:
    """A routing ``TopK``: ``scores`` its input, ``indices`` its chosen indices, along ``axis`` (largest first
    unless ``largest`` is False)."""

    node: str
    scores: str
    indices: str
    axis: int
    largest: bool


def _attr(node: onnx.NodeProto, name: str, default: int) -> int:
    return next((int(onnx.helper.get_attribute_value(a)) for a in node.attribute if a.name == name), default)


def find_routers(proto: onnx.ModelProto) -> list[Router]:
    """The graph's routing TopKs, in graph (topological) order: over floating-point scores (a TopK over integer
    values sorts chosen indices for the dispatch; it chooses nothing)."""
    graph = proto.graph
    try:
        typed = onnx.shape_inference.infer_shapes(proto).graph
        types = {v.name: v.type.tensor_type.elem_type for v in [*typed.value_info, *typed.input, *typed.output]}
    except Exception:  # contrib ops onnx cannot type: such a TopK's input is taken as scores
        types = {}
    dynamic = {i.name for i in graph.input} - {t.name for t in graph.initializer}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        if any(i in dynamic for i in n.input if i):
            dynamic.update(o for o in n.output if o)
        for i in n.input:
            consumers.setdefault(i, []).append(n)

    def selects(value: str, depth: int = 0) -> bool:
        for user in consumers.get(value, []):
            if user.op_type in _SELECTS:
                return True
            if user.op_type in _PASS and depth < 4 and any(selects(o, depth + 1) for o in user.output):
                return True
        return False

    found = []
    for i, n in enumerate(graph.node):
        if n.op_type != "TopK" or len(n.output) < 2 or n.input[0] not in dynamic or not selects(n.output[1]):
            continue
        if types.get(n.input[0], onnx.TensorProto.FLOAT) not in _FLOATS:
            continue
        found.append(
            Router(n.name or f"TopK#{i}", n.input[0], n.output[1], _attr(n, "axis", -1), bool(_attr(n, "largest", 1)))
        )
    return found


def probe_graph(proto: onnx.ModelProto, names: Sequence[str]) -> onnx.ModelProto:
    """A copy of the graph header (weights not read) with ``names`` as extra outputs, typed as inference finds
    them."""
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    try:
        inferred = onnx.shape_inference.infer_shapes(out).graph.value_info
    except Exception:  # contrib ops onnx cannot type: ORT still finds the types, float is the fallback
        inferred = []
    types = {vi.name: vi for vi in inferred}
    have = {o.name for o in out.graph.output}
    for name in names:
        if name in have:
            continue
        vi = onnx.ValueInfoProto()
        if name in types:
            vi.CopyFrom(types[name])
            vi.type.tensor_type.ClearField("shape")
        else:
            vi.name = name
            vi.type.tensor_type.elem_type = onnx.TensorProto.FLOAT
        out.graph.output.append(vi)
    return out


def _probe_names(routers: Sequence[Router]) -> list[str]:
    return [name for r in routers for name in (r.scores, r.indices)]


def _rows(value: np.ndarray, axis: int) -> np.ndarray:
    """``value`` (token-major, ``[tokens, ...]``) as ``[tokens, rows, E]`` with the TopK's axis last."""
    moved = np.moveaxis(value, axis if axis < 0 else axis - value.ndim, -1)
    return moved.reshape(moved.shape[0], -1, moved.shape[-1])


def _step_verdict(routers: Sequence[Router], want: dict, got: dict, dtype: str) -> bool | None:
    """True: the first router where a row differs differs only within the tie width; False: it differs wider
    somewhere, or a router before it cannot be compared; None: routed the same everywhere."""
    for r in routers:
        # a router the probe could not split per token (not token-major) may hide the first difference: no excuse
        if not all(n in want and n in got for n in (r.scores, r.indices)):
            return False
        scores = _rows(np.asarray(want[r.scores], np.float32), r.axis)
        ours, theirs = _rows(want[r.indices], r.axis), _rows(got[r.indices], r.axis)
        if ours.shape != theirs.shape or scores.shape[:2] != ours.shape[:2]:
            return False
        k = ours.shape[-1]
        if k >= scores.shape[-1]:
            continue  # every score kept: a sort, not a choice
        differs = [
            (t, j)
            for t in range(ours.shape[0])
            for j in range(ours.shape[1])
            if set(ours[t, j].tolist()) != set(theirs[t, j].tolist())
        ]
        if not differs:
            continue
        for t, j in differs:
            row = scores[t, j] if r.largest else -scores[t, j]
            # every expert dropped and every expert taken instead within the width of each other, in the original
            mine, other = set(ours[t, j].tolist()), set(theirs[t, j].tolist())
            dropped, taken = sorted(mine - other), sorted(other - mine)
            if not all(0 <= e < row.size for e in taken):
                return False
            gap = float(max(row[e] for e in dropped) - min(row[e] for e in taken))
            if not gap <= routing_tie_width(dtype, row):
                return False
        return True
    return None


def routing_tie_steps(original: GreedyRun, deployed: GreedyRun, routers: Sequence[Router], dtype: str) -> set:
    """The (prompt, step) pairs of two probed runs (:attr:`GreedyRun.probed`) that are routing ties."""
    ties = set()
    for p, (mine, theirs) in enumerate(zip(original.probed, deployed.probed, strict=True)):
        for step, (want, got) in enumerate(zip(mine, theirs, strict=True)):
            if _step_verdict(routers, want, got, dtype):
                ties.add((p, step))
    return ties


def routing_ties(
    original: str | os.PathLike,
    converted: str | os.PathLike,
    prompts: Sequence[Sequence[int]],
    follow: Sequence[Sequence[int]],
    steps: int,
    dtype: str,
    *,
    original_options,
    paged_options,
    blocks: int,
    block_size: int,
    providers: Sequence | None = None,
) -> tuple[set, int]:
    """The routing-tie steps of ``converted`` against ``original`` (paths) over ``prompts``, both teacher-forced
    on ``follow`` (the original's tokens), and the number of routers probed (0: none found in both graphs, no
    run made). ``*_options``: the session options the rule's own runs used, so that the probed runs compute
    the same values."""
    from ortpa.formats.detect import dense_interface
    from ortpa.model.file import read_model
    from ortpa.runtime.session import InferenceSession, PagedSession

    dense_file = read_model(original, load_external_data=False)
    paged_file = read_model(converted, load_external_data=False)
    in_paged = {o for n in paged_file.proto.graph.node for o in n.output}
    routers = [r for r in find_routers(dense_file.proto) if r.scores in in_paged and r.indices in in_paged]
    if not routers:
        return set(), 0
    names = _probe_names(routers)
    dense_probe = LoadedModel(
        probe_graph(dense_file.proto, names), f"{dense_file.label} (routing)", dense_file.base_dir, dense_file.external
    )
    del dense_file
    session = InferenceSession(dense_probe, original_options, providers=["CPUExecutionProvider"])
    want = dense_greedy(
        session, prompts, steps, follow=follow, interface=dense_interface(dense_probe.proto), probes=names
    )
    del session, dense_probe
    gc.collect()
    paged_probe = LoadedModel(
        probe_graph(paged_file.proto, names), f"{paged_file.label} (routing)", paged_file.base_dir, paged_file.external
    )
    del paged_file
    paged = PagedSession(
        paged_probe, num_blocks=blocks, block_size=block_size, providers=providers, sess_options=paged_options
    )
    got = paged_greedy(paged, prompts, steps, follow=follow, probes=names)
    del paged, paged_probe
    gc.collect()
    return routing_tie_steps(want, got, routers, dtype), len(routers)
