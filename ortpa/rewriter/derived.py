"""Weights an MLA conversion computes from the original's (absorbed projections), and where each came from.

The absorbed form (:mod:`ortpa.rewriter.mla`) stores weights the original lacks: ``W_UK`` / ``W_UV`` (``kv_b_proj``
rearranged per head) and, where folding shrinks the work, the products ``Wq_nope · W_UK`` (``q_absorbed_weight``)
and ``W_UV · Wo`` (``o_absorbed_weight``). A conversion that stores them in a half type T rounds each product once
more than the original's own arithmetic does; the verification's float32 twin (docs/verification.md) rebuilds
each product as the float32 product of the original's factors rounded to T, and so needs to know the factors.
The conversion writes the recipe into the model's metadata (:data:`DERIVED_KEY`, JSON: weight name -> kind, the
factors' initializer names in the original, the head dims), and :func:`derived_weight` computes a weight from
its factors for both: the conversion (in float64, then the model's type) and the twin (in float64 from factors
rounded to T, then float32).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

import numpy as np

__all__ = ["DERIVED_KEY", "KINDS", "constant_recipe", "copy_recipe", "derived_weight", "dumps", "loads", "recipe"]

DERIVED_KEY = "ortpa.derived_weights"
# q: Wq [D, H*(P+R)] and kv_b [L, H*(P+V)] -> [D, H*L]; o: kv_b and Wo [H*V, D] -> [H*L, D];
# uk: kv_b -> W_UK [H, P, L]; uv: kv_b -> W_UV [H, L, V] (uk, uv: a permutation, no arithmetic); const: a value
# the rewrite took from the original's graph and keeps exact elsewhere (the expanded prefill's softmax scale, the
# absorbed node's float ``scale`` attribute); copy: an initializer of the original under a new name (kv_b_proj's
# weight for the expanded prefill)
KINDS = ("q", "o", "uk", "uv", "const", "copy")


def recipe(kind: str, factors: Sequence[str], heads: int, nope: int, rope: int, rank: int, v_head: int) -> dict:
    """The metadata entry of one derived weight (``factors``: the original's initializer names, in order)."""
    if kind not in KINDS:
        raise ValueError(f"derived weight kind: expected one of {KINDS}, got {kind!r}")
    return {"kind": kind, "factors": list(factors), "H": heads, "P": nope, "R": rope, "L": rank, "V": v_head}


def constant_recipe(value: float) -> dict:
    """The metadata entry of a constant the rewrite made from ``value`` (no factors)."""
    return {"kind": "const", "factors": [], "value": float(value)}


def copy_recipe(name: str) -> dict:
    """The metadata entry of a copy of the original's initializer ``name``."""
    return {"kind": "copy", "factors": [name]}


def dumps(entries: dict[str, dict]) -> str:
    return json.dumps(entries, separators=(",", ":"), sort_keys=True)


def loads(metadata: Iterable) -> dict[str, dict]:
    """The recipes of a model's ``metadata_props`` (protobuf entries or ``(key, value)`` pairs); {} where none."""
    for entry in metadata:
        key, value = (entry.key, entry.value) if hasattr(entry, "key") else entry
        if key == DERIVED_KEY:
            return json.loads(value)
    return {}


def derived_weight(entry: dict, factors: Sequence[np.ndarray]) -> np.ndarray:
    """The weight ``entry`` (:func:`recipe`, :func:`constant_recipe`) describes, from its ``factors`` (arrays in
    ``entry["factors"]``'s order), in float64."""
    if entry["kind"] == "const":
        return np.array(entry["value"], np.float64)
    if entry["kind"] == "copy":
        return np.asarray(factors[0], np.float64)
    H, P, R, L, V = (entry[k] for k in ("H", "P", "R", "L", "V"))
    kv_b = np.asarray(factors[1] if entry["kind"] == "q" else factors[0], np.float64).reshape(L, H, P + V)
    w_uk = kv_b[:, :, :P].transpose(1, 2, 0)  # [H, P, L]
    w_uv = kv_b[:, :, P:].transpose(1, 0, 2)  # [H, L, V]
    kind = entry["kind"]
    if kind == "uk":
        return np.ascontiguousarray(w_uk)
    if kind == "uv":
        return np.ascontiguousarray(w_uv)
    if kind == "q":
        wq = np.asarray(factors[0], np.float64)
        wq_nope = wq.reshape(wq.shape[0], H, P + R)[:, :, :P]
        return np.einsum("ihp,hpl->ihl", wq_nope, w_uk).reshape(wq.shape[0], H * L)
    wo = np.asarray(factors[1], np.float64)
    return np.einsum("hlv,hvd->hld", w_uv, wo.reshape(H, V, -1)).reshape(H * L, -1)
