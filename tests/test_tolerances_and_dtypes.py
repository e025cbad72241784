"""The one rule's bounds and tie rule (``ortpa.tolerances``) and the one dtype table (``ortpa.dtypes``)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest

from ortpa import dtypes
from ortpa.tolerances import (
    max_tie_flips,
    precision_kl_bound,
    precision_logit_bound,
    precision_ties,
    structure_bound,
    structure_tolerance,
    tie_bound,
    tol_for,
    unit_roundoff,
)


def test_tolerance_follows_the_dtype():
    assert tol_for(np.float16) == tol_for("float16") == tol_for(onnx.TensorProto.FLOAT16)
    assert tol_for(ml_dtypes.bfloat16) == tol_for("bfloat16")
    rtol16, atol16 = tol_for(np.float16)
    rtol_bf, atol_bf = tol_for(ml_dtypes.bfloat16)
    assert rtol_bf > rtol16 and atol_bf > atol16  # 8-bit mantissa against 11
    with pytest.raises(KeyError, match="no tolerance"):
        tol_for(np.int32)


def test_the_rule_s_bounds_follow_from_dtypes_alone():
    """Unit roundoffs from the formats' mantissas (not measured), the structure bound from float32's and the
    model's sums, the precision bounds from the deployed dtype's."""
    assert unit_roundoff(np.float32) == np.finfo(np.float32).eps / 2
    assert unit_roundoff(np.float16) == np.finfo(np.float16).eps / 2
    assert unit_roundoff(ml_dtypes.bfloat16) == float(ml_dtypes.finfo(ml_dtypes.bfloat16).eps) / 2
    assert unit_roundoff("int8") == 1 / 254
    # u * sqrt(n * L) with 4 bits of headroom; grows with the sums, 4x for 16x the width
    assert structure_tolerance("float32", 64, 2) == pytest.approx(16 * 2**-24 * np.sqrt(128))
    assert structure_tolerance("float32", 1024, 2) == pytest.approx(4 * structure_tolerance("float32", 64, 2))
    assert structure_tolerance("float32", 14336, 60) < 1e-3 < structure_tolerance("float16", 64, 2)
    row = np.array([[0.5, -8.0, 2.0], [0.1, 0.2, -0.3]], np.float32)  # scale max(1, max |row|): 8 and 1
    expected = np.array([8.0, 1.0]) * structure_tolerance("float32", 64, 2)
    np.testing.assert_allclose(structure_bound(row, "float32", 64, 2)[:, 0], expected, rtol=1e-6)
    assert precision_logit_bound("float16") == pytest.approx(2 * 2**-5.5)
    assert precision_kl_bound("float16") == pytest.approx(precision_logit_bound("float16") ** 2 / 2)
    assert precision_kl_bound("float16") < precision_kl_bound("bfloat16")
    assert precision_ties("int8").margin(row[0]) == pytest.approx(2 * precision_logit_bound("int8"))
    with pytest.raises(KeyError, match="no unit roundoff"):
        unit_roundoff(np.int32)


def test_tie_rule_margin_and_count():
    ties = tie_bound(np.float16)
    row = np.array([1.0, 0.99, 0.0], np.float32)  # gap 0.01: two rows each within atol of it may swap these
    assert ties.classify(row, 0) == "exact"
    assert ties.classify(row, 1) == "tie"
    assert ties.classify(row, 2) == "mismatch"
    # the margin is twice the elementwise bound at the row's top logit: a gap just past it is no tie
    bound = tol_for(np.float16)[1] + tol_for(np.float16)[0] * 1.0
    assert ties.classify(np.array([1.0, 1.0 - 2 * bound - 1e-4], np.float32), 1) == "mismatch"
    assert ties.classify(np.array([1.0, 1.0 - 2 * bound + 1e-4], np.float32), 1) == "tie"
    assert tie_bound(np.float16, extra_atol=0.1).classify(np.array([1.0, 0.85], np.float32), 1) == "tie"
    assert [max_tie_flips(n) for n in (1, 24, 99, 100, 1000)] == [1, 1, 1, 1, 10]


@pytest.mark.parametrize(
    ("spelling", "elem", "name"),
    [
        (np.float32, onnx.TensorProto.FLOAT, "float32"),
        ("tensor(float)", onnx.TensorProto.FLOAT, "float32"),
        ("float16", onnx.TensorProto.FLOAT16, "float16"),
        (ml_dtypes.bfloat16, onnx.TensorProto.BFLOAT16, "bfloat16"),
        ("tensor(bfloat16)", onnx.TensorProto.BFLOAT16, "bfloat16"),
        (ml_dtypes.float8_e4m3fn, onnx.TensorProto.FLOAT8E4M3FN, "float8e4m3fn"),
        ("float8e4m3fn", onnx.TensorProto.FLOAT8E4M3FN, "float8e4m3fn"),
        (onnx.TensorProto.INT64, onnx.TensorProto.INT64, "int64"),
        ("int4", onnx.TensorProto.INT4, "int4"),
    ],
)
def test_one_dtype_table(spelling, elem, name):
    assert dtypes.onnx_elem_type(spelling) == elem
    assert dtypes.dtype_name(spelling) == name
    assert dtypes.numpy_dtype(elem) == dtypes.numpy_dtype(name)


def test_dtype_sizes_and_unknowns():
    assert [dtypes.bits(x) for x in ("float32", "bfloat16", "int8", "int4")] == [32, 16, 8, 4]
    assert dtypes.ort_type("float32") == "tensor(float)" and dtypes.ort_type(np.float16) == "tensor(float16)"
    for bad in (999, "float128x", object()):
        with pytest.raises(TypeError):
            dtypes.onnx_elem_type(bad)
