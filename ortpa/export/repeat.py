"""Trace a few decoder layers, write them all: the export's trace at a cost that does not grow with the depth.

``torch.onnx.export`` spends about a second per decoder layer (symbolic shapes, decompositions, translation), so a
checkpoint of 60 layers spent a minute tracing the same layer over and over. Layers whose modules are built alike
trace alike; :func:`plan` groups the layers by what their modules are (class, plain attributes, parameter shapes and
dtypes, buffers' values, and the config's per-layer entries such as ``layer_types``) and keeps the first two layers
of each group; :func:`reduced` makes the model those layers only while the tracer runs; :func:`expand` then writes
every layer of the full model from its group's second traced copy, with that layer's own parameters, past inputs
and present outputs.

Nothing here is trusted on the plan alone. :func:`expand` checks, on the traced graph, that the two copies of each
group are the same graph up to their own weights, caches and incoming hidden state (structurally: every value
they share with the rest of the graph must compute the same thing), that a layer reads nothing from a layer
other than the one before it, and that the layers hand one hidden state to the next. Anything else
(a layer reading a per-layer slice of a shared tensor, two hidden states crossing, a control-flow node) raises
:class:`NotRepeatable` and the export traces every layer instead. ``tests/test_export_repeat.py`` compares the
expanded graph with the full trace (:func:`fingerprint`) for every family the export supports.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import re
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["LayerPlan", "NotRepeatable", "expand", "fingerprint", "plan", "reduced"]

_SCOPES = "pkg.torch.onnx.name_scopes"
_WRAPPER = "inner."  # ortpa.export.hf's wrapper module holds the model as ``inner``


class NotRepeatable(Exception):
    """The traced layers cannot stand for the others: the reason, for the progress line."""


@dataclass(frozen=True)
class LayerPlan:
    """Which decoder layers the reduced trace holds, and the group (kind) of every layer of the full model."""

    path: str  # the decoder layers' ModuleList, e.g. "model.layers"
    kinds: tuple[int, ...]  # kind of each layer of the full model
    traced: tuple[int, ...]  # full-model indices of the traced layers, ascending

    @property
    def num_layers(self) -> int:
        return len(self.kinds)


# ------------------------------------------------------------------------------------------------ the plan
def _layers(model: Any, n_layers: int) -> tuple[str, Any]:
    import torch

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == n_layers and name:
            return name, module
    raise NotRepeatable(f"no list of {n_layers} decoder layers in {type(model).__name__}")


def _plain(value: Any) -> bool:
    if isinstance(value, (bool, int, float, str, type(None))):
        return True
    return isinstance(value, (tuple, list)) and all(_plain(v) for v in value)


def _digest(tensor: Any) -> str:
    import torch

    raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)  # any dtype, bfloat16 included
    return hashlib.sha1(raw.numpy().tobytes()).hexdigest()


def _signature(layer: Any, config: Any, index: int, n_layers: int) -> Hashable:
    parts = []
    for path, module in layer.named_modules():
        attrs = tuple(
            sorted(
                (k, repr(v))
                for k, v in vars(module).items()
                if not k.startswith("_") and k not in ("layer_idx", "training") and _plain(v)
            )
        )
        params = tuple((n, tuple(p.shape), str(p.dtype)) for n, p in module.named_parameters(recurse=False))
        buffers = tuple(
            (n, tuple(b.shape), str(b.dtype), _digest(b))
            if b.device.type != "meta"
            else (n, tuple(b.shape), str(b.dtype))
            for n, b in module.named_buffers(recurse=False)
        )
        parts.append((path, type(module).__module__, type(module).__qualname__, attrs, params, buffers))
    per_layer = tuple(
        (k, repr(v[index]))
        for k, v in sorted(vars(config).items())
        if isinstance(v, (list, tuple)) and len(v) == n_layers
    )
    return tuple(parts), per_layer


def plan(model: Any) -> LayerPlan | None:
    """The layers to trace for ``model``; None when that is every layer (nothing to gain)."""
    n_layers = model.config.num_hidden_layers
    path, layers = _layers(model, n_layers)
    seen: dict[Hashable, int] = {}
    kinds = tuple(
        seen.setdefault(_signature(layer, model.config, i, n_layers), len(seen)) for i, layer in enumerate(layers)
    )
    traced: list[int] = []
    for kind in range(len(seen)):
        traced += [i for i, k in enumerate(kinds) if k == kind][:2]
    if len(traced) >= n_layers:
        return None
    return LayerPlan(path, kinds, tuple(sorted(traced)))


@contextlib.contextmanager
def reduced(model: Any, layer_plan: LayerPlan) -> Iterator[None]:
    """Inside the block ``model`` is the traced layers only: its layer list, ``num_hidden_layers``, the config's
    per-layer lists and every module's ``layer_idx`` renumbered to match; all restored on exit."""
    import torch

    config = model.config
    n_layers = layer_plan.num_layers
    parent_name, _, attr = layer_plan.path.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    full = getattr(parent, attr)
    lists = {k: v for k, v in vars(config).items() if isinstance(v, (list, tuple)) and len(v) == n_layers}
    indexed = [(m, m.layer_idx) for m in full.modules() if isinstance(getattr(m, "layer_idx", None), int)]
    order = {original: j for j, original in enumerate(layer_plan.traced)}
    try:
        setattr(parent, attr, torch.nn.ModuleList([full[i] for i in layer_plan.traced]))
        config.num_hidden_layers = len(layer_plan.traced)
        for k, v in lists.items():
            setattr(config, k, type(v)(v[i] for i in layer_plan.traced))
        for module, original in indexed:
            if original in order:
                module.layer_idx = order[original]
        yield
    finally:
        setattr(parent, attr, full)
        config.num_hidden_layers = n_layers
        for k, v in lists.items():
            setattr(config, k, v)
        for module, original in indexed:
            module.layer_idx = original


# ----------------------------------------------------------------------------------------- structural hashes
def _tensor_key(value: Any) -> str:
    tensor = value.const_value
    return hashlib.sha1(f"{tensor.dtype}{tuple(tensor.shape)}".encode() + bytes(tensor.tobytes())).hexdigest()


def _attr_key(attr: Any) -> str:
    import onnx_ir as ir

    if attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS):
        raise NotRepeatable(f"attribute {attr.name} holds a subgraph")
    if attr.type == ir.AttributeType.TENSOR:
        t = attr.value
        return f"{attr.name}:T{t.dtype}{tuple(t.shape)}:" + hashlib.sha1(bytes(t.tobytes())).hexdigest()
    return f"{attr.name}:{attr.type}:{attr.value!r}"


def _node_key(node: Any) -> str:
    attrs = ",".join(sorted(_attr_key(a) for a in node.attributes.values()))
    return f"{node.domain}::{node.op_type}::{node.overload}[{attrs}]"


def _hashes(graph: Any, name_of: Callable[[Any], str | None]) -> dict[int, str]:
    """A hash of what each value of ``graph`` computes: graph inputs by name, initializers by ``name_of`` (a
    parameter's name) or else by content, node outputs by op, attributes and their inputs' hashes."""
    out: dict[int, str] = {}
    for value in graph.inputs:
        out[id(value)] = "input:" + value.name
    for value in graph.initializers.values():
        name = name_of(value)
        out[id(value)] = "param:" + name if name is not None else "const:" + _tensor_key(value)
    for node in graph:
        key = _node_key(node) + "(" + ",".join(out[id(v)] if v is not None else "-" for v in node.inputs) + ")"
        digest = hashlib.sha1(key.encode()).hexdigest()
        for i, value in enumerate(node.outputs):
            out[id(value)] = f"{digest}:{i}"
    return out


def fingerprint(graph: Any) -> tuple[Any, ...]:
    """What ``graph`` computes, as hashes: its inputs (names, types), and each output's name, type and hash. Two
    graphs with equal fingerprints compute the same outputs from the same inputs and parameters by the same
    nodes (initializers compared by name, the tracer's constants by content), however their nodes are ordered
    or deduplicated."""
    hashes = _hashes(graph, lambda v: v.name if v.name.startswith(_WRAPPER) else None)
    inputs = tuple((v.name, str(v.type), str(v.shape)) for v in graph.inputs)
    outputs = tuple((v.name, str(v.type), hashes[id(v)]) for v in graph.outputs)
    return inputs, outputs


# -------------------------------------------------------------------------------------------------- the graph
def _layer_of(node: Any, scope: str) -> int | None:
    text = node.metadata_props.get(_SCOPES)
    if not text:
        return None
    for entry in ast.literal_eval(text):
        if entry.startswith(scope):
            head = entry[len(scope) :].split(".")[0]
            if head.isdigit():
                return int(head)
    return None


def _symbolic_shape(node: Any, past_roles: dict[int, Any]) -> bool:
    """Whether ``node`` reads only named (symbolic) dims of a past input's shape: the same for every layer."""
    import onnx_ir as ir

    if node.op_type != "Shape" or node.domain != "" or id(node.inputs[0]) not in past_roles:
        return False
    dims = list(node.inputs[0].shape or [])
    start = node.attributes.get("start")
    end = node.attributes.get("end")
    picked = dims[start.as_int() if start else 0 : end.as_int() if end else len(dims)]
    return bool(picked) and all(isinstance(d, ir.SymbolicDim) for d in picked)


@dataclass
class _Copy:
    """One traced layer in the graph: its own nodes (those reading something of the layer), what it reads from
    outside and what it hands on."""

    index: int  # reduced index (position in the trace)
    nodes: list[Any]
    hidden_in: Any = None  # the value it reads from the layer before (None: from the shared part)
    hidden_out: Any = None
    presents: dict[str, Any] | None = None  # "key"/"value" -> graph output value


def expand(
    irm: Any,
    layer_plan: LayerPlan,
    tensor_of: Callable[[int, str], Any],
    past_name: Callable[[int, str], str],
    present_name: Callable[[int, str], str],
) -> None:
    """Rewrite the reduced trace ``irm`` (in place) into the full model's graph (see the module docstring).

    ``tensor_of(layer, relative name)``: the full model's parameter or buffer (a torch tensor) the cloned
    initializer holds; ``past_name(layer, "key"|"value")`` / ``present_name(...)``: the graph's input and output
    names. Raises :class:`NotRepeatable` (the graph untouched) when the traced copies do not show the layers to
    be repeats of each other."""

    graph = irm.graph
    traced = layer_plan.traced
    scope = _WRAPPER + layer_plan.path + "."
    param_prefix = scope  # parameters are named by module path under the wrapper
    n_traced = len(traced)

    def param_of(value: Any) -> tuple[int, str] | None:
        if not (value.is_initializer() and value.name.startswith(param_prefix)):
            return None
        head, _, rel = value.name[len(param_prefix) :].partition(".")
        return (int(head), rel) if head.isdigit() else None

    past_roles = _roles(graph.inputs, past_name, n_traced, "input")
    present_roles = _roles(graph.outputs, present_name, n_traced, "output")

    owner, copies, shared_nodes, tail = _partition(graph, scope, n_traced, past_roles, param_of, None)
    _link(copies, owner, present_roles, traced)
    # the first layer reads the hidden state from the shared part (the embedding): the one value of the hidden
    # state's type that the tracer scoped into it; owned, so that the layer's own nodes on it are its own
    first = copies[0]
    candidates = {
        id(v): v
        for node in graph
        if _layer_of(node, scope) == 0
        for v in node.inputs
        if v is not None
        and owner[id(v)] is None
        and v.producer() is not None
        and _layer_of(v.producer(), scope) != 0
        and v.type == first.hidden_out.type
        and str(v.shape) == str(first.hidden_out.shape)
    }
    if not candidates:
        raise NotRepeatable("no value could be the first layer's hidden state")
    # shared values compared by what they compute (parameters by name: their bytes are not read)
    hashes = _hashes(graph, lambda v: v.name if param_of(v) is not None else None)
    failure = NotRepeatable("")
    # several values of the hidden state's type (rotary tables as wide as the model): the one under which the
    # copies match
    for first_in in candidates.values():
        owner, copies, shared_nodes, tail = _partition(graph, scope, n_traced, past_roles, param_of, first_in)
        try:
            _link(copies, owner, present_roles, traced)
            copies[0].hidden_in = first_in
            template = _templates(layer_plan, copies, owner, hashes, param_of, past_roles)
            break
        except NotRepeatable as exc:
            failure = exc
    else:
        raise failure
    last_out = copies[-1].hidden_out
    for node in tail:
        for value in node.inputs:
            if value is not None and owner[id(value)] not in (None, _TAIL) and value is not last_out:
                raise NotRepeatable(f"{node.op_type} node {node.name} after the layers reads {value.name}")

    _rewrite(irm, layer_plan, copies, shared_nodes, tail, template, param_of, past_roles, tensor_of,
             past_name, present_name)  # fmt: skip


def _roles(values, name_of: Callable[[int, str], str], n_traced: int, what: str) -> dict[int, tuple[int, str]]:
    """id of the graph input / output (``what``) named ``name_of(layer, role)`` -> (traced layer, role), for every
    traced layer."""
    roles: dict[int, tuple[int, str]] = {}
    for j in range(n_traced):
        for role in ("key", "value"):
            found = [v for v in values if v.name == name_of(j, role)]
            if len(found) != 1:
                raise NotRepeatable(f"no graph {what} {name_of(j, role)}")
            roles[id(found[0])] = (j, role)
    return roles


_FIRST_IN = "first layer's input"
_TAIL = "after the layers"


def _partition(graph, scope: str, n_traced: int, past_roles, param_of, first_in):  # fmt: skip
    """Which traced layer each node belongs to: (owner of each value, the copies, the shared nodes, the tail).

    Shared: the graph's inputs, the tracer's constants and whatever is computed from them alone, wherever the
    tracer scoped it. A layer's: its parameters, its past inputs and what its scope computes from them (and from
    the layer before); the wrapper's handling of a layer's past outside any scope goes with the layer. The tail:
    what reads the last layer outside every layer's scope (the final norm, the head)."""
    import onnx_ir as ir

    owner: dict[int, Any] = {}
    for value in graph.inputs:
        owner[id(value)] = past_roles[id(value)][0] if id(value) in past_roles else None
    for value in graph.initializers.values():
        found = param_of(value)
        owner[id(value)] = found[0] if found else None
    if first_in is not None:
        owner[id(first_in)] = _FIRST_IN
    copies = [_Copy(j, []) for j in range(n_traced)]
    shared_nodes: list[Any] = []
    cache_side: set[int] = set()
    tail: list[Any] = []
    for node in graph:
        if any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values()):
            raise NotRepeatable(f"{node.op_type} node {node.name} holds a subgraph")
        owners = {owner[id(v)] for v in node.inputs if v is not None} - {None}
        if _symbolic_shape(node, past_roles):
            owners = set()  # the batch or past length, one dim of every layer's cache: shared
        scoped = _layer_of(node, scope)
        layers = {o for o in owners if isinstance(o, int)}
        place: Any
        if not owners:
            place = None
        elif (
            scoped is None
            and len(layers) == 1
            and owners == layers
            and all(
                owner[id(v)] is None or id(v) in past_roles or id(v) in cache_side for v in node.inputs if v is not None
            )
        ):
            place = next(iter(layers))  # the wrapper's cache handling of a layer's past, outside its scope
            cache_side.update(id(v) for v in node.outputs)
        elif _TAIL in owners or (scoped is None and owners == {n_traced - 1}):
            place = _TAIL
        elif scoped is not None and all(o <= scoped for o in layers) and (_FIRST_IN not in owners or scoped == 0):
            place = scoped
        else:
            raise NotRepeatable(f"{node.op_type} node {node.name} (layer {scoped}) reads {sorted(map(str, owners))}")
        if place is None:
            shared_nodes.append(node)
        elif place == _TAIL:
            tail.append(node)
        else:
            copies[place].nodes.append(node)
        for value in node.outputs:
            owner[id(value)] = _FIRST_IN if value is first_in else place
    return owner, copies, shared_nodes, tail


def _link(copies: list[_Copy], owner: dict[int, Any], present_roles, traced) -> None:
    """Each copy's hidden state in (from the copy before) and out (the one value it hands on besides its
    presents); raises :class:`NotRepeatable` for any other traffic between layers."""
    for copy in copies:
        members = {id(n) for n in copy.nodes}
        for node in copy.nodes:
            for value in node.inputs:
                if value is None or owner[id(value)] in (None, copy.index, _FIRST_IN):
                    continue
                if owner[id(value)] != copy.index - 1:
                    raise NotRepeatable(f"layer {traced[copy.index]} reads {value.name} of another layer")
                if copy.hidden_in is not None and copy.hidden_in is not value:
                    raise NotRepeatable(f"layer {traced[copy.index]} reads two values of the layer before it")
                copy.hidden_in = value
        copy.presents = {}
        outs = []
        for node in copy.nodes:
            for value in node.outputs:
                if id(value) in present_roles:
                    copy.presents[present_roles[id(value)][1]] = value
                    if any(id(c) not in members for c, _ in value.uses()):
                        raise NotRepeatable(f"{value.name} is read outside its layer")
                elif value.is_graph_output():
                    raise NotRepeatable(f"graph output {value.name} comes from a layer")
                elif any(id(c) not in members for c, _ in value.uses()):
                    outs.append(value)
        if len(outs) != 1 or set(copy.presents) != {"key", "value"}:
            raise NotRepeatable(f"layer {traced[copy.index]} hands on {len(outs)} values, not one hidden state")
        copy.hidden_out = outs[0]
    for j in range(1, len(copies)):
        if copies[j].hidden_in is not copies[j - 1].hidden_out:
            raise NotRepeatable(f"layer {traced[j]} does not read the hidden state of layer {traced[j - 1]}")


def _templates(layer_plan: LayerPlan, copies: list[_Copy], owner, hashes, param_of, past_roles) -> dict[int, _Copy]:
    """The copy each kind's untraced layers are cloned from (its second), once the two are shown to be one graph."""
    traced = layer_plan.traced
    by_kind: dict[int, list[int]] = {}
    for j, original in enumerate(traced):
        by_kind.setdefault(layer_plan.kinds[original], []).append(j)
    template: dict[int, _Copy] = {}
    for kind, members in by_kind.items():
        if layer_plan.kinds.count(kind) == len(members):
            continue  # every layer of this kind was traced: nothing to clone
        if len(members) < 2:
            raise NotRepeatable(f"layers of kind {kind} were traced once")
        a, b = copies[members[0]], copies[members[1]]
        _same(a, b, owner, hashes, param_of, past_roles, traced)
        template[kind] = b
    return template


def _same(a: _Copy, b: _Copy, owner: dict[int, Any], hashes: dict[int, str], param_of, past_roles, traced) -> None:
    """Raise :class:`NotRepeatable` unless copies ``a`` and ``b`` are one graph (see :func:`expand`)."""
    where = f"layers {traced[a.index]} and {traced[b.index]}"
    if len(a.nodes) != len(b.nodes):
        raise NotRepeatable(f"{where} trace to {len(a.nodes)} and {len(b.nodes)} nodes")
    mapped: dict[int, Any] = {}
    if a.hidden_in is not None:
        mapped[id(a.hidden_in)] = b.hidden_in
    for na, nb in zip(a.nodes, b.nodes, strict=True):
        if _node_key(na) != _node_key(nb) or len(na.inputs) != len(nb.inputs) or len(na.outputs) != len(nb.outputs):
            raise NotRepeatable(f"{where} differ at {na.op_type} node {na.name} / {nb.op_type} node {nb.name}")
        for va, vb in zip(na.inputs, nb.inputs, strict=True):
            if va is None or vb is None:
                if va is not vb:
                    raise NotRepeatable(f"{where} differ at an optional input of {na.name}")
                continue
            if id(va) in mapped:
                ok = mapped[id(va)] is vb
            elif id(vb) in past_roles:
                ok = id(va) in past_roles and past_roles[id(va)][1] == past_roles[id(vb)][1]
            elif param_of(vb) is not None:
                pa = param_of(va)
                ok = pa is not None and pa[1] == param_of(vb)[1] and va.shape == vb.shape and va.dtype == vb.dtype
            elif owner[id(vb)] is None:
                ok = owner[id(va)] is None and hashes[id(va)] == hashes[id(vb)]
            else:
                ok = False
            if not ok:
                raise NotRepeatable(f"{where} differ at input {vb.name} of {nb.op_type} node {nb.name}")
        for va, vb in zip(na.outputs, nb.outputs, strict=True):
            mapped[id(va)] = vb
    if mapped.get(id(a.hidden_out)) is not b.hidden_out:
        raise NotRepeatable(f"{where} hand on different values")
    for role in ("key", "value"):
        if mapped.get(id(a.presents[role])) is not b.presents[role]:
            raise NotRepeatable(f"{where} write their {role} cache differently")


def _rewrite(irm, layer_plan, copies, shared_nodes, tail, template, param_of, past_roles, tensor_of,
             past_name, present_name) -> None:  # fmt: skip
    graph = irm.graph
    traced = layer_plan.traced
    scope = _WRAPPER + layer_plan.path + "."
    by_original = {original: copies[j] for j, original in enumerate(traced)}
    pasts = {(past_roles[id(v)][0], past_roles[id(v)][1]): v for v in graph.inputs if id(v) in past_roles}
    other_inputs = [v for v in graph.inputs if id(v) not in past_roles]
    head_outputs = [v for v in graph.outputs if not any(v is c.presents[r] for c in copies for r in c.presents)]

    # the traced copies keep their nodes; names move to their full-model index
    for j, original in enumerate(traced):
        for node in copies[j].nodes if j != original else ():
            if _SCOPES in node.metadata_props:
                node.metadata_props[_SCOPES] = _rescoped(node.metadata_props[_SCOPES], scope, j, original)
        for role in ("key", "value"):
            pasts[(j, role)].name = past_name(original, role)
            copies[j].presents[role].name = present_name(original, role)
    # all moved out before any is renamed: a traced copy's new name may be another's old one (layers 0, 1, 3, 4
    # traced: copy 2 becomes layer 3 while copy 3 still holds that name)
    moved = []
    for value in list(graph.initializers.values()):
        found = param_of(value)
        if found is not None and traced[found[0]] != found[0]:
            graph.initializers.pop(value.name)
            moved.append((value, f"{scope}{traced[found[0]]}.{found[1]}"))
    for value, name in moved:
        value.name = name
        graph.register_initializer(value)

    new_inputs = list(other_inputs)
    new_outputs = list(head_outputs)
    order: list[Any] = list(shared_nodes)
    hidden = None  # the hidden state the next layer reads (None: the first layer, traced, reads its own)
    for t in range(layer_plan.num_layers):
        copy = by_original.get(t)
        if copy is not None:
            if hidden is not None and copy.hidden_in is not hidden:
                for node in copy.nodes:
                    for i, value in enumerate(node.inputs):
                        if value is copy.hidden_in:
                            node.replace_input_with(i, hidden)
            order += copy.nodes
            new_inputs += [pasts[(copy.index, "key")], pasts[(copy.index, "value")]]
            new_outputs += [copy.presents["key"], copy.presents["value"]]
            hidden = copy.hidden_out
            continue
        src = template[layer_plan.kinds[t]]
        nodes, hidden, inputs, outputs = _clone(graph, src, traced[src.index], t, hidden, scope, param_of, pasts,
                                                tensor_of, past_name, present_name)  # fmt: skip
        order += nodes
        new_inputs += inputs
        new_outputs += outputs
    last = copies[-1].hidden_out
    for node in tail:
        for i, value in enumerate(node.inputs):
            if value is last:
                node.replace_input_with(i, hidden)
    order += tail
    for node in list(graph):
        graph.remove(node)
    graph.extend(order)
    graph.inputs.clear()
    graph.inputs.extend(new_inputs)
    graph.outputs.clear()
    graph.outputs.extend(new_outputs)


def _rescoped(scopes: str, scope: str, old: int, new: int) -> str:
    """Node metadata's module scopes of layer ``old`` as layer ``new``'s (``layers.1`` and not ``layers.10``)."""
    return re.sub(rf"{re.escape(scope)}{old}(?=[.'\"]|$)", f"{scope}{new}", scopes)


def _copy_value(value: Any, name: str):
    import onnx_ir as ir

    shape = ir.Shape(list(value.shape)) if value.shape is not None else None
    return ir.Value(name=name, shape=shape, type=value.type)


def _clone(graph, src: _Copy, src_layer: int, t: int, hidden: Any, scope: str, param_of, pasts, tensor_of, past_name,
           present_name) -> tuple[list[Any], Any, list[Any], list[Any]]:  # fmt: skip
    """Layer ``t`` as a copy of ``src``'s nodes (layer ``src_layer`` of the full model): its own parameters
    (initializers holding ``tensor_of(t, ...)``), past inputs and present outputs, reading ``hidden``."""
    import onnx_ir as ir

    mapped: dict[int, Any] = {id(src.hidden_in): hidden}
    new_inputs = []
    for role in ("key", "value"):
        value = _copy_value(pasts[(src.index, role)], past_name(t, role))
        mapped[id(pasts[(src.index, role)])] = value
        new_inputs.append(value)

    def resolve(value: Any) -> Any:
        if value is None:
            return None
        if id(value) in mapped:
            return mapped[id(value)]
        found = param_of(value)
        if found is None:
            return value  # shared
        name = f"{scope}{t}.{found[1]}"
        tensor = tensor_of(t, found[1])
        clone = _copy_value(value, name)
        clone.const_value = type(value.const_value)(tensor, name=name)
        graph.register_initializer(clone)
        mapped[id(value)] = clone
        return clone

    nodes = []
    for node in src.nodes:
        metadata = dict(node.metadata_props)
        if _SCOPES in metadata:
            metadata[_SCOPES] = _rescoped(metadata[_SCOPES], scope, src_layer, t)
        outputs = [_copy_value(v, f"{v.name}__{t}") for v in node.outputs]
        clone = ir.Node(
            node.domain,
            node.op_type,
            [resolve(v) for v in node.inputs],
            attributes=list(node.attributes.values()),
            overload=node.overload,
            outputs=outputs,
            name=f"{node.name}__{t}" if node.name else None,
            metadata_props=metadata,
        )
        for old, new in zip(node.outputs, outputs, strict=True):
            mapped[id(old)] = new
        nodes.append(clone)
    presents = []
    for role in ("key", "value"):
        value = mapped[id(src.presents[role])]
        value.name = present_name(t, role)
        presents.append(value)
    return nodes, mapped[id(src.hidden_out)], new_inputs, presents
