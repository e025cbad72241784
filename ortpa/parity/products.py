"""The weights an MLA conversion computed, in the float32 twins: exact, not a widened bound.

An MLA conversion stores weights the original lacks (:mod:`ortpa.rewriter.derived`): ``W_UK`` / ``W_UV``,
``kv_b_proj`` rearranged per head, and where folding shrinks the work the products ``Wq_nope · W_UK`` and
``W_UV · Wo``. Stored in a half type T (a ``dtype=`` conversion of a float32 original, or a half original's),
a product is rounded once more than the original's arithmetic is: 2^-11 of its scale for float16, 70x the float32
structure bound on the MLA fixture, which the bound had to absorb (a scale x1.01 passed). The conversion records
each weight's factors (the original's initializer names) in its metadata; here, both twins share them:

- the original's twin reads each factor rounded to T (:func:`factor_types`, for
  :func:`~ortpa.parity.rounded.rounded_original`), as the conversion's factors were;
- the conversion's twin replaces each product by the float32 product of those rounded factors, and each recorded
  constant (the expanded prefill's softmax scale, exact in the absorbed node's ``scale`` attribute) by its float32
  value (:func:`rebuild_products`). A permutation (``W_UK``, ``W_UV``) or copy (the expanded prefill's
  ``kv_b_proj``) rounded to T is the rounded factor: kept as stored.

The two twins then compute the same function from the same rounded weights, up to reordered float32 sums, and
are compared at the float32 bound; the product's own rounding is the deployed model's, which precision measures.
Memory: each rebuilt product is held in float32 in the twin's header (the stored T product stays in its file).
Only where folding shrinks the work are there products (``absorb="auto"``): never larger than their factors.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from ortpa.dtypes import numpy_dtype
from ortpa.model.file import LoadedModel
from ortpa.parity.tensors import read_array
from ortpa.parity.upcast import HALF_TYPES
from ortpa.rewriter.derived import derived_weight, loads

__all__ = ["factor_types", "rebuild_products"]

# products, and constants kept exact elsewhere; "uk", "uv" (permutations) and "copy" are the factor rounded to T
_REBUILT = ("q", "o", "const")


def _half_recipes(converted: onnx.ModelProto) -> dict[str, tuple[dict, int]]:
    """Derived weight name -> (recipe, its stored half type), for those ``converted`` stores in a half type."""
    recipes = loads(converted.metadata_props)
    if not recipes:
        return {}
    stored = {i.name: i.data_type for i in converted.graph.initializer if i.name in recipes}
    return {n: (recipes[n], k) for n, k in stored.items() if k in HALF_TYPES}


def factor_types(converted: onnx.ModelProto) -> dict[str, int]:
    """The original's weights the conversion computed half weights from: name -> the half type to round it to."""
    out: dict[str, int] = {}
    for entry, kind in _half_recipes(converted).values():
        for name in entry["factors"]:
            out.setdefault(name, kind)
    return out


def rebuild_products(twin: onnx.ModelProto, original: LoadedModel) -> set[str]:
    """In ``twin`` (the converted model's header, before its upcast), each product stored in a half type T whose
    factors ``original`` (the original's twin) holds becomes the float32 product of those factors rounded to T;
    a permutation stays as stored. Returns the names so accounted for (no longer widening the bound)."""
    inits = {i.name: i for i in original.proto.graph.initializer}
    targets = {i.name: i for i in twin.graph.initializer}
    accounted: set[str] = set()
    for name, (entry, kind) in _half_recipes(twin).items():
        sources = [inits.get(f) for f in entry["factors"]]
        if any(s is None or s.data_type not in (onnx.TensorProto.FLOAT, *HALF_TYPES) for s in sources):
            continue  # a factor the original's twin does not hold as a float initializer: the bound counts it
        if entry["kind"] not in _REBUILT:
            accounted.add(name)
            continue
        half = numpy_dtype(kind)
        factors = [read_array(s, original.base_dir).astype(half).astype(np.float64) for s in sources]
        target = targets[name]
        try:
            value = derived_weight(entry, factors).astype(np.float32).reshape(tuple(target.dims))
        except ValueError:  # factors of other shapes than the recipe's: not these weights; the bound counts it
            continue
        target.CopyFrom(numpy_helper.from_array(value, name))
        accounted.add(name)
        del factors, value
    return accounted
