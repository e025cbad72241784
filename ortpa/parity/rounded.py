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
from ortpa.parity.products import factor_types
from ortpa.parity.tensors import reader as _reader
from ortpa.parity.tensors import size as _size
from ortpa.parity.twin import folded_original
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
    (:func:`ortpa.parity.upcast.round_through`; the weights stay in the original's files). Some are copies under
    new names (the op's constant inputs: RoPE tables, sinks, q/k-norm weights,
    :func:`ortpa.rewriter.attention.op_constant`; MLA's ``kv_b_proj`` kept for the expanded prefill): an original
    weight of the same shape whose values rounded to T are the copy's is rounded too. What the rewrite absorbed
    stays float32 here as it does there (a scale constant becomes the op's float ``scale`` attribute); what it
    computed anew in T (MLA's absorbed projections) the original lacks: those count in :attr:`Twin.computed`."""
    loaded, proto = folded_original(original)
    mine = _float_shapes(proto)
    theirs = {n: (k, d) for n, (k, d) in _float_shapes(converted.proto).items() if k in _HALF}
    stored = {n: k for n, (k, d) in theirs.items() if mine.get(n, (0, ()))[1] == d}
    copies = _copies(proto, loaded, converted, {n: kd for n, kd in theirs.items() if n not in mine})
    stored.update({name: theirs[copy][0] for copy, name in copies.items()})
    # the factors of the weights the conversion computed (MLA's absorbed projections), rounded as the conversion's
    # were: its twin rebuilds each product from them (ortpa.parity.products)
    for name, kind in factor_types(converted.proto).items():
        if mine.get(name, (0, ()))[0] == onnx.TensorProto.FLOAT:
            stored.setdefault(name, kind)
    names = round_through(proto, stored)
    kinds = sorted({dtype_name(stored[n]) for n in names}) or ["T"]
    label = f"{loaded.label} (float32 twin, weights rounded to {'/'.join(kinds)})"
    return dataclasses.replace(loaded, proto=proto, label=label), set(copies)


# copies are told by their first elements, then compared in chunks: memory stays one chunk of each whatever the
# weight, and a weight whose first elements differ is never read further
_PREFIX = 1024
_CHUNK = 1 << 20


def _copies(
    proto: onnx.ModelProto, loaded: LoadedModel, converted: LoadedModel, unnamed: dict[str, tuple[int, tuple]]
) -> dict[str, str]:
    """Converted half weight -> the float32 initializer of ``proto`` (the original's header) it is a copy of:
    the same shape, and its values rounded to T are the copy's (the op's constant inputs, MLA's ``kv_b_proj``
    kept for the expanded prefill). Looked for among ``unnamed`` (the half weights under names the original lacks)
    by their first :data:`_PREFIX` elements, then compared whole, :data:`_CHUNK` elements at a time."""
    originals: dict[tuple, list[onnx.TensorProto]] = {}
    for init in proto.graph.initializer:
        if init.data_type == onnx.TensorProto.FLOAT:
            originals.setdefault(tuple(init.dims), []).append(init)
    found: dict[str, str] = {}
    for init in converted.proto.graph.initializer:
        # a scalar is no copy to look for: equal scalars of other roles abound (an absorbed scale among them)
        if init.name not in unnamed or tuple(init.dims) not in originals or _size(init) < 2:
            continue
        copy = _reader(init, converted.base_dir)
        for candidate in originals[tuple(init.dims)]:
            if _same(_reader(candidate, loaded.base_dir), copy, _size(init), init.data_type):
                found[init.name] = candidate.name
                break
    return found


def _same(original, copy, size: int, kind: int) -> bool:
    """Whether ``original``'s elements (float32) rounded to ``kind`` are ``copy``'s (readers of :func:`_reader`)."""
    import numpy as np

    from ortpa.dtypes import numpy_dtype

    dtype = numpy_dtype(kind)
    for start, count in [(0, min(_PREFIX, size)), *((k, _CHUNK) for k in range(0, size, _CHUNK))]:
        a, b = original(start, count), copy(start, count)
        with np.errstate(over="ignore"):  # past T's range: infinite, as the conversion stores it
            if len(a) != len(b) or not np.array_equal(a.astype(dtype), b):
                return False
    return True


def _float_shapes(proto: onnx.ModelProto) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Name -> (element type, dims) of each float initializer and ``Constant`` tensor of the main graph."""
    out = {i.name: (i.data_type, tuple(i.dims)) for i in proto.graph.initializer}
    for node in proto.graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            for a in node.attribute:
                if a.name == "value" and a.type == onnx.AttributeProto.TENSOR:
                    out[node.output[0]] = (a.t.data_type, tuple(a.t.dims))
    return out
