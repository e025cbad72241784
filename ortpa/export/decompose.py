"""``torch.onnx.export``'s decomposition step, without its retrace when the traced graph needs (almost) none.

Before translating, ``torch.onnx.export`` runs ``ExportedProgram.run_decompositions`` with a table of every ATen
decomposition whose op torchlib does not translate itself. That call traces the whole graph again, twice, in fake
tensors with symbolic shapes: about 5 s on this machine whatever the depth (a 1-layer and a 2-layer Llama cost the
same), the largest single cost of exporting a checkpoint once :mod:`ortpa.export.repeat` traces two layers only.

For the decoder models ortpa exports, the traced graph already holds ops torchlib translates, but for a handful whose
decomposition is a one-for-one rename: ``aten.__and__`` / ``__or__`` (``bitwise_and`` / ``bitwise_or``), ``aten.to``
(``_to_copy`` to the result's dtype, or nothing when the dtype does not change) and ``aten.detach_`` / ``detach`` /
``alias`` (nothing: values are values in ONNX), and the in-place forms the retrace would functionalise into
known ones: slices of a fresh tensor filled by ``copy_`` (MLA's keys in transformers' DeepSeek-V2/V3 and MiniCPM3),
written as the ``slice_scatter`` chain functionalisation writes, and an in-place op (``scatter_``, ``div_``,
``index_put_``: DeepSeek's MoE router and expert dispatch) that writes a fresh tensor nothing reads afterwards but
through the op's result, written as its functional form. :func:`lean_decomposition` swaps those nodes in place and
skips the retrace; a graph with any other op torchlib lacks, or any other op that writes one of its inputs, goes
through ``run_decompositions`` as before (``ORTPA_EXPORT_DECOMPOSITION=retrace`` forces that).
Likewise the type promotion pass that follows (an interpreter re-running every node in fake tensors to insert the
casts mixed-dtype ops need, ~1 s) runs only when :func:`promotion_needed`, its rules previewed on the values the
trace recorded, finds a node it would change. And the registry of torchlib's translations is built without inferring
every function's ONNX signature (parsing the source of ~500 functions, ~1 s): torch.onnx's dispatcher never reads
it, and its graph builder infers the signature of a function it calls that has none (``_building.eval_function``),
so only the translations the graph uses are inferred (the same ONNX graph byte for byte, tested).

The two graphs compute the same values by the same arithmetic; they may differ in how sizes are read (the retrace
re-derives them, e.g. ``past + seq`` where the traced graph reads the attention mask's length, equal by the export's
dynamic shapes) and in ``Identity`` nodes. ``tests/test_export_decompose.py`` checks, family by family, that the
lean path was taken and that ONNX Runtime's outputs of the two are equal element for element.
"""

from __future__ import annotations

import contextlib
import operator
import os
from collections.abc import Iterator
from typing import Any

__all__ = ["ENV", "lean_decomposition", "lean_rewrite", "promotion_needed"]

# removed by torch.onnx's own remove_assertion_nodes after the decomposition step, whichever path ran
_ASSERTS = (
    "aten._assert_scalar.default",
    "aten._assert_tensor_metadata.default",
    "aten._assert_async.default",
    "aten._assert_async.msg",
    "aten.sym_constrain_range_for_size.default",
)
_ALIASES = ("aten.detach_.default", "aten.detach.default", "aten.alias.default")
_RENAMES = {"aten.__and__.Tensor": "bitwise_and.Tensor", "aten.__or__.Tensor": "bitwise_or.Tensor"}
_CASTS = ("aten.to.dtype", "aten.to.dtype_layout", "aten.to.device")


def _plan(graph_module: Any, translated: set[Any]) -> list[tuple[Any, str]] | str:
    """What to do with each node that torchlib does not translate, or why one of them needs the retrace."""
    import torch

    todo: list[tuple[Any, str]] = []
    order = {n: i for i, n in enumerate(graph_module.graph.nodes)}
    for node in graph_module.graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        if not isinstance(target, torch._ops.OpOverload):
            if target is operator.getitem or getattr(target, "__module__", "") in ("_operator", "torch", "math"):
                continue  # Python-level symbolic arithmetic (sym_size, sym_max, ...): translated as such
            return f"{target} is no ATen op"
        name = str(target)
        if name in _ASSERTS:
            continue
        if name in _ALIASES:
            todo.append((node, "alias"))
            continue
        if name == "aten.copy_.default":
            why = _fill_refused(node, order)
            if why:
                return f"{name} writes its input ({why})"
            if torch.ops.aten.slice_scatter.default not in translated:
                return f"{name} writes its input (no translation of slice_scatter)"
            todo.append((node, "fill"))
            continue
        if target._schema.is_mutable:  # the retrace would make it functional
            why = _in_place_refused(node, order, translated)
            if why:
                return f"{name} writes its input ({why})"
            todo.append((node, "functional"))
            continue
        if target in translated:
            continue
        if name in _RENAMES:
            todo.append((node, "rename"))
        elif name in _CASTS and _cast_is_plain(node):
            todo.append((node, "cast"))
        else:
            return f"{name} has no translation"
    return todo


_FRESH = ("aten.new_empty.default", "aten.empty.memory_format", "aten.new_zeros.default", "aten.zeros.default")


def _fill_refused(copy: Any, order: dict[Any, int]) -> str:
    """Why ``copy_`` is not a fill of a slice of a fresh tensor that the retrace's functionalisation would write as
    ``slice_scatter`` ('' when it is): ``x = new_empty(...); x[..., a:b].copy_(y); ...; read x`` (MLA's keys in
    transformers' DeepSeek-V2/V3 and MiniCPM3). A fresh tensor aliases nothing, so each fill is the tensor before it
    with the slice replaced, as long as the tensor is read only after its last fill."""
    view, source = copy.args[0], copy.args[1]
    if len(copy.args) > 2 or any(v for v in copy.kwargs.values()) or copy.users:
        return "non_blocking, or its result read"
    if getattr(view, "op", None) != "call_function" or str(view.target) != "aten.slice.Tensor" or len(view.users) != 1:
        return "not into a slice read by nothing else"
    base = view.args[0]
    step = view.args[4] if len(view.args) > 4 else 1
    if getattr(base, "op", None) != "call_function" or str(base.target) not in _FRESH or step != 1 or view.kwargs:
        return "not into a unit-step slice of a fresh tensor"
    got, want = getattr(source, "meta", {}).get("val"), view.meta.get("val")
    if got is None or want is None or got.dtype != want.dtype or str(tuple(got.shape)) != str(tuple(want.shape)):
        return "from a tensor of another dtype or shape"
    fills = [u for u in base.users if _is_fill_view(u)]
    last = max(order[next(iter(v.users))] for v in fills)
    if any(u not in fills and order[u] < last for u in base.users):
        return "the tensor read between its fills"
    return ""


def _functional(target: Any) -> Any:
    """``aten.op_.overload`` -> ``aten.op.overload`` (None when there is none)."""
    import torch

    packet = target.overloadpacket.__name__
    if not packet.endswith("_") or packet.startswith("_"):
        return None
    return getattr(getattr(torch.ops.aten, packet[:-1], None), target._overloadname, None)


def _returns_fresh(node: Any) -> bool:
    """Whether ``node`` makes a new tensor: an ATen op that writes nothing and returns no alias of an input."""
    import torch

    target = getattr(node, "target", None)
    if getattr(node, "op", None) != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    schema = target._schema
    return not schema.is_mutable and not any(r.alias_info is not None for r in schema.returns)


def _in_place_refused(node: Any, order: dict[Any, int], translated: set[Any]) -> str:
    """Why the in-place ``node`` (``x.op_(...)``) is not the functional ``op(x, ...)`` ('' when it is): ``x`` is a
    fresh tensor (no view, input or weight: nothing else sees the write), read before the op only by ops that
    neither write it nor view it, and after the op only through the op's result (DeepSeek's MoE router:
    ``mask = zeros_like(s); mask.scatter_(1, idx, 1)``; ``w = gather(...); w /= w.sum(...)``; its experts' dispatch
    ``index_put_`` into ``empty_like``)."""
    functional = _functional(node.target)
    if functional is None or functional not in translated:
        return "no translated functional form"
    arguments = node.target._schema.arguments
    written = [i for i, a in enumerate(arguments) if a.alias_info is not None and a.alias_info.is_write]
    if written != [0]:
        return "it writes other than its first input"
    base = node.args[0]
    if not _returns_fresh(base):
        return "not into a fresh tensor"
    for user in base.users:
        if user is node:
            continue
        if order[user] > order[node] or not _returns_fresh(user):
            return "the tensor read after it, viewed or written"
    return ""


def _is_fill_view(node: Any) -> bool:
    return str(node.target) == "aten.slice.Tensor" and any(str(c.target) == "aten.copy_.default" for c in node.users)


def _fill(graph: Any, copy: Any, filled: dict[Any, tuple[Any, Any]]) -> None:
    """``copy_`` of a slice of a fresh tensor (:func:`_fill_refused`) -> ``slice_scatter`` into what the tensor was
    before it; after its last fill the tensor's readers read the last scatter. ``filled``: per fresh tensor, its
    first and latest scatter so far."""
    import torch

    view, source = copy.args[0], copy.args[1]
    base = view.args[0]
    first, current = filled.get(base, (None, base))
    dim, start, end = (list(view.args[1:4]) + [0, None, None][len(view.args) - 1 :])[:3]
    with graph.inserting_before(copy):
        scattered = graph.call_function(torch.ops.aten.slice_scatter.default, (current, source, dim, start, end, 1))
    scattered.meta = dict(base.meta)
    graph.erase_node(copy)
    graph.erase_node(view)
    first = first or scattered
    filled[base] = (first, scattered)
    if not any(_is_fill_view(u) for u in base.users):  # the last fill: the tensor's readers read what it made
        base.replace_all_uses_with(scattered, delete_user_cb=lambda user: user is not first)


def _cast_is_plain(node: Any) -> bool:
    """``aten.to`` that changes the dtype at most (same device, layout, strides-agnostic), as ONNX's Cast does."""
    source, result = node.args[0].meta.get("val"), node.meta.get("val")
    if source is None or result is None:
        return False
    return source.device == result.device and source.layout == result.layout


def lean_rewrite(graph_module: Any, translated: set[Any]) -> str | None:
    """Replace the graph's untranslated one-for-one ops in place; None, or (graph untouched) why it needs the
    retrace."""
    import torch

    todo = _plan(graph_module, translated)
    if isinstance(todo, str):
        return todo
    graph = graph_module.graph
    aten = torch.ops.aten
    filled: dict[Any, tuple[Any, Any]] = {}
    for node, kind in todo:
        if kind == "fill":
            _fill(graph, node, filled)
            continue
        if kind == "functional":  # the node itself, its name kept: the graph signature may name it as an output
            node.target = _functional(node.target)
            continue
        source = node.args[0]
        if kind == "alias" or (kind == "cast" and source.meta["val"].dtype == node.meta["val"].dtype):
            node.replace_all_uses_with(source)
            graph.erase_node(node)
            continue
        if kind == "rename":
            packet, overload = _RENAMES[str(node.target)].split(".")
            target, args, kwargs = getattr(getattr(aten, packet), overload), node.args, node.kwargs
        else:
            target, args, kwargs = aten._to_copy.default, (source,), {"dtype": node.meta["val"].dtype}
        with graph.inserting_before(node):
            new = graph.call_function(target, args, kwargs)
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
    graph.lint()
    graph_module.recompile()
    return None


def _promotion_changes(arg: Any, dtype: Any) -> bool:
    """Whether torch.onnx's type promotion pass would rewrite ``arg`` to ``dtype`` (its ``_maybe_promote_arg``)."""
    import torch
    from torch.onnx._internal.fx import type_utils

    if dtype is None:
        return False
    if isinstance(arg, torch.fx.Node):
        val = arg.meta.get("val")
        if isinstance(val, torch.Tensor):
            return val.dtype != dtype
        if type_utils.is_torch_symbolic_type(val):
            return type_utils.from_scalar_type_to_torch_dtype(type(val)) != dtype
        return True  # nothing to judge by: the pass decides
    scalar = type_utils.from_scalar_type_to_torch_dtype(type(arg))
    if scalar is not None:
        return scalar != dtype
    if isinstance(arg, (tuple, list)):
        return any(_promotion_changes(a, dtype) for a in arg)
    return True


def promotion_needed(graph_module: Any) -> bool:
    """Whether torch.onnx's ``insert_type_promotion_nodes`` would change the graph: its rules previewed on the
    nodes' recorded values, without the pass's re-execution of every node in fake tensors (~1 s)."""
    import torch
    from torch.onnx._internal.fx.passes import type_promotion

    table = type_promotion.TypePromotionTable()
    for module in graph_module.modules():
        if not isinstance(module, torch.fx.GraphModule):
            return True
        for node in module.graph.nodes:
            if node.op != "call_function":
                continue
            rule = type_promotion.get_type_promotion_rule(node, table)
            if rule is None:
                continue
            args = torch.fx.node.map_arg(node.args, lambda n: n.meta.get("val"))
            kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: n.meta.get("val"))
            info = rule.preview_type_promotion(args, kwargs)
            if any(_promotion_changes(a, info.args_dtypes.get(i)) for i, a in enumerate(node.args)):
                return True
            if any(_promotion_changes(a, info.kwargs_dtypes.get(k)) for k, a in node.kwargs.items()):
                return True
    return False


ENV = "ORTPA_EXPORT_DECOMPOSITION"  # "retrace": torch.onnx.export's own decomposition always (for comparison)


@contextlib.contextmanager
def lean_decomposition(lazy_signatures: bool = True) -> Iterator[dict[str, str]]:
    """Inside the block, ``torch.onnx.export`` decomposes by :func:`lean_rewrite` where that suffices; yields a
    record whose ``"decomposition"`` says which path the last export took: ``"lean"`` or ``"retraced"``
    (``ORTPA_EXPORT_DECOMPOSITION=retrace`` forces the latter), and ``"retraced_because"`` why; ``"type_promotion"``
    whether torch.onnx's type promotion pass ran (``"run"``) or was previewed to change nothing (``"not needed"``).

    ``lazy_signatures``: torchlib's registry is built without inferring each translation's ONNX signature up front
    (see the module docstring); False keeps torch's eager inference."""
    from torch.onnx._internal.exporter import _decomp, _fx_passes, _registration

    original = _fx_passes.decompose_with_registry
    record = {"decomposition": "retraced", "retraced_because": "not run", "type_promotion": "not run"}
    forced = os.environ.get(ENV, "").strip().lower()
    if forced not in ("", "lean", "retrace"):
        raise ValueError(f"{ENV} must be 'lean' or 'retrace', found {forced!r}")

    def decompose(exported_program, registry):
        translated = set(_decomp.get_onnx_implemented_overloads(registry))
        why = ENV + "=retrace" if forced == "retrace" else lean_rewrite(exported_program.graph_module, translated)
        record.update(decomposition="retraced" if why else "lean", retraced_because=why or "")
        return original(exported_program, registry) if why else exported_program

    original_promotion = _fx_passes.insert_type_promotion_nodes

    def promote(graph_module) -> None:
        needed = forced == "retrace" or promotion_needed(graph_module)
        record["type_promotion"] = "run" if needed else "not needed"
        if needed:
            original_promotion(graph_module)

    original_post_init = _registration.OnnxDecompMeta.__post_init__

    def post_init(meta) -> None:
        if meta.is_custom:  # a caller's translation: inferred (and warned about) as torch does
            original_post_init(meta)

    _fx_passes.decompose_with_registry = decompose
    _fx_passes.insert_type_promotion_nodes = promote
    if lazy_signatures and forced != "retrace":
        _registration.OnnxDecompMeta.__post_init__ = post_init
    try:
        yield record
    finally:
        _fx_passes.decompose_with_registry = original
        _fx_passes.insert_type_promotion_nodes = original_promotion
        _registration.OnnxDecompMeta.__post_init__ = original_post_init
