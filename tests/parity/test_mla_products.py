"""MLA's absorbed projections in the float32 twins of a ``dtype=float16`` conversion (ortpa.parity.products).

The conversion stores ``Wq_nope · W_UK`` and ``W_UV · Wo`` (and the expanded prefill's softmax scale) rounded to
float16, which the original computes unrounded. The bound used to widen for them (2.5e-2 of the logits' scale on a
5-layer model): a scale x1.01 passed, x1.1 was refused at 2.9x. Now the conversion records each such weight's
factors, the conversion's twin rebuilds it in float32 from the factors rounded to float16, the original's twin
rounds the factors: both compute the same function from the same weights, at float32's bound."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest

from ortpa.conversion import convert_file
from ortpa.errors import ConversionError
from ortpa.parity.twin import folded_original
from ortpa.parity.verify import verify_conversion
from ortpa.rewriter.derived import loads
from ortpa.testing import defects
from ortpa.tolerances import structure_tolerance

DSV3 = Path(__file__).parents[1] / "fixtures" / "dsv3_sdpa_op18.onnx"  # small dims: both products folded


@pytest.fixture(scope="module")
def half_dsv3(tmp_path_factory):
    out = tmp_path_factory.mktemp("mla_products") / "paged.onnx"
    return out, convert_file(DSV3, out, dtype="float16").verification.verdict


def test_the_conversion_records_each_computed_weight_and_its_factors(half_dsv3):
    converted = onnx.load(str(half_dsv3[0]), load_external_data=False)
    recipes = loads(converted.metadata_props)
    stored = {i.name: i.data_type for i in converted.graph.initializer}
    originals = {i.name for i in folded_original(DSV3)[1].graph.initializer}
    kinds = sorted(e["kind"] for e in recipes.values())
    # two layers: both products, and the expanded prefill's scale and kv_b_proj copy
    assert kinds == ["const"] * 2 + ["copy"] * 2 + ["o"] * 2 + ["q"] * 2, recipes
    assert all(stored.get(n) == onnx.TensorProto.FLOAT16 for n in recipes), recipes
    assert all(f in originals for e in recipes.values() for f in e["factors"]), recipes


def test_a_float16_mla_conversion_is_judged_at_the_float32_bound(half_dsv3):
    s = half_dsv3[1].structure
    # no widening term: the bound of a float32 conversion (widest sum: W_UV·Wo's H·L = 256, 2 attention layers)
    assert s.twin and not s.reason and s.tolerance == structure_tolerance("float32", 256, 2), s
    assert s.max_relative_error < 0.1 * s.tolerance, s  # before: 1.0e-3, 70x this bound


def test_a_scale_off_by_one_percent_is_refused(half_dsv3, tmp_path):
    bad = tmp_path / "paged.onnx"
    onnx.save(defects.inject("scale", onnx.load(str(half_dsv3[0])), 1.01), str(bad))
    with pytest.raises(ConversionError, match=r"first diverging layer: layer \d") as err:
        verify_conversion(DSV3, bad)
    assert "does not match the original (structure)" in str(err.value)
