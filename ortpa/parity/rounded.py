"""The original's side of the float32 twins of a ``dtype=`` conversion (float16 / bfloat16) of a float32 original.

Such a conversion rewrites in float32, then stores every float32 weight and constant but the integer-derived ones
in T (:func:`ortpa.rewriter.dtype.convert_float_type`): its twin (``float32_twin(upcast=True)``,
:mod:`ortpa.parity.twin`) computes in float32 from weights rounded to T, which the original's are not. Judged
against the original as it is, that rounding (2^-11 of every weight for float16) would be in the structure's error,
30x the float32 bound; judged at T's bound, a scale x1.1 passed. :func:`rounded_original` gives the original the
same rounding, in its graph header only, so that both sides differ by the rewrite and reordered float32 sums.
"""

from __future__ import annotations

import dataclasses
import os

import onnx

from ortpa.dtypes import dtype_name
from ortpa.model.file import LoadedModel
from ortpa.parity.twin import folded_original, is_lowered_call
from ortpa.parity.upcast import HALF_TYPES as _HALF
from ortpa.parity.upcast import round_through

__all__ = ["rounded_original"]


def rounded_original(original: str | os.PathLike, converted: LoadedModel) -> tuple[LoadedModel, set[str]]:
    """The twin of a float32 original whose conversion computes in T throughout (``dtype=``: the rewrite in
    float32, then every float32 weight and constant but the integer-derived ones stored in T,
    :func:`ortpa.rewriter.dtype.convert_float_type`): the original computing in float32 from its weights rounded
    to T, as the conversion stores them, to be compared with the conversion's upcast twin
    (``float32_twin(upcast=True)``) at a float32 bound. Returns it, and the names of the converted model's half
    constants it accounts for under other names (see below).

    The constants the conversion folds are folded first, in float32 as the conversion folds them (a Gemma norm's
    ``1 + weight`` is rounded once, after the sum). Then each initializer or constant that the converted model
    stores in T under the same name and shape is read through ``Cast(T)``, ``Cast(float)``
    (:func:`ortpa.parity.upcast.round_through`; the weights stay in the original's files). The op's constant
    inputs (RoPE tables, sinks, q/k-norm weights: :func:`ortpa.rewriter.attention.op_constant`) are copies under
    new names: an original constant of the same shape whose values rounded to T are the copy's is rounded too. What
    the rewrite absorbed stays float32 here as it does there (a scale constant becomes the op's float ``scale``
    attribute); what it computed anew in T (MLA's absorbed projections) the original lacks: those count in
    :attr:`Twin.computed`."""
    loaded, proto = folded_original(original)
    mine = _float_shapes(proto)
    theirs = {n: (k, d) for n, (k, d) in _float_shapes(converted.proto).items() if k in _HALF}
    stored = {n: k for n, (k, d) in theirs.items() if mine.get(n, (0, ()))[1] == d}
    copies = _copies(proto, loaded, converted, {n: kd for n, kd in theirs.items() if n not in mine})
    stored.update({name: theirs[copy][0] for copy, name in copies.items()})
    names = round_through(proto, stored)
    kinds = sorted({dtype_name(stored[n]) for n in names}) or ["T"]
    label = f"{loaded.label} (float32 twin, weights rounded to {'/'.join(kinds)})"
    return dataclasses.replace(loaded, proto=proto, label=label), set(copies)


# the op's constant inputs compared by value: RoPE tables of every position (a 128k-position, 128-wide table is
# 32 MB in float32), sinks and q/k-norm weights; never a weight matrix
_COPY_BYTES = 64 << 20
_CONSTANT_INPUTS = ("cos_cache", "sin_cache", "head_sink", "q_norm_weight", "k_norm_weight")


def _copies(
    proto: onnx.ModelProto, loaded: LoadedModel, converted: LoadedModel, unnamed: dict[str, tuple[int, tuple]]
) -> dict[str, str]:
    """Converted half constant -> the float32 initializer of ``proto`` (the original's header) it is a copy of.
    Only the op's constant inputs (:data:`_CONSTANT_INPUTS`, of a PagedAttention node or of its lowered call,
    directly or through a ``Cast``) among ``unnamed`` are looked for: an original initializer of the same shape
    whose values rounded to T are the copy's. Each at most :data:`_COPY_BYTES`; an original read once."""
    import numpy as np
    from onnx import numpy_helper

    from ortpa.dtypes import numpy_dtype

    wanted = _constant_inputs(converted.proto) & set(unnamed)
    originals: dict[tuple, list[onnx.TensorProto]] = {}
    for init in proto.graph.initializer:
        if init.data_type == onnx.TensorProto.FLOAT and 4 * _size(init) <= _COPY_BYTES:
            originals.setdefault(tuple(init.dims), []).append(init)
    read: dict[str, np.ndarray] = {}
    found: dict[str, str] = {}
    for init in converted.proto.graph.initializer:
        if init.name not in wanted or tuple(init.dims) not in originals:
            continue
        copy = numpy_helper.to_array(init, os.fspath(converted.base_dir or ""))
        for candidate in originals[tuple(init.dims)]:
            if candidate.name not in read:
                read[candidate.name] = numpy_helper.to_array(candidate, os.fspath(loaded.base_dir or ""))
            if np.array_equal(read[candidate.name].astype(numpy_dtype(init.data_type)), copy):
                found[init.name] = candidate.name
                break
    return found


def _constant_inputs(proto: onnx.ModelProto) -> set[str]:
    """The values that feed the op's constant inputs (:data:`_CONSTANT_INPUTS`) of every PagedAttention node and
    every lowered call in ``proto``, and what each ``Cast`` among them reads."""
    from ortpa.ops.spec import PAGED_ATTENTION

    slots = [PAGED_ATTENTION.input_index(name) for name in _CONSTANT_INPUTS]
    formals = {f.name: list(f.input) for f in proto.functions}
    names: set[str] = set()
    for node in proto.graph.node:
        if node.op_type == "PagedAttention":
            names.update(node.input[k] for k in slots if k < len(node.input) and node.input[k])
        elif is_lowered_call(node):
            formal = formals.get(node.op_type, [])
            names.update(a for f, a in zip(formal, node.input, strict=False) if f in _CONSTANT_INPUTS and a)
    producers = {o: n for n in proto.graph.node for o in n.output}
    for name in list(names):
        cast = producers.get(name)
        if cast is not None and cast.op_type == "Cast":
            names.add(cast.input[0])
    return names


def _float_shapes(proto: onnx.ModelProto) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Name -> (element type, dims) of each float initializer and ``Constant`` tensor of the main graph."""
    out = {i.name: (i.data_type, tuple(i.dims)) for i in proto.graph.initializer}
    for node in proto.graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            for a in node.attribute:
                if a.name == "value" and a.type == onnx.AttributeProto.TENSOR:
                    out[node.output[0]] = (a.t.data_type, tuple(a.t.dims))
    return out


def _size(init: onnx.TensorProto) -> int:
    n = 1
    for d in init.dims:
        n *= d
    return n
