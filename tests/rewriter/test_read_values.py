"""Read, never assume: each value a recogniser takes from the graph, computed at run time in a near-miss graph.

Every near miss keeps the fixture's meaning. Where the value is a function of static shapes (q's head size) the
conversion folds it and is verified against the original (``convert_file`` runs the parity check before it
writes); where it changes with the prompt (q's sequence axis) no constant can stand in for it and the conversion
is refused, naming the node. The first case is the issue's: torch's SDPA decomposition scaling q and k by
``head_dim ** -0.25`` read with ``Shape``, which used to convert with exit 0 and max |dlogit| 3.9.
"""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from near_miss import hide_scalar, runtime_qk_scale
from support.parity import attrs, paged_nodes

import ortpa
from ortpa.errors import ConversionError

FIXTURES = Path(__file__).parents[1] / "fixtures"


def _save(model: onnx.ModelProto, folder: Path) -> Path:
    path = folder / "dense.onnx"
    onnx.save(model, path)
    return path


def _reference_attrs(fixture: str, **options) -> dict:
    return attrs(paged_nodes(ortpa.convert(str(FIXTURES / fixture), **options))[0])


SCALE = ("llama_sdpa_op18.onnx", lambda m, axis: runtime_qk_scale(m, axis=axis), "scale", {})
SOFTCAP = ("gemma2_eager_op18.onnx", lambda m, axis: hide_scalar(m, "val_274", "add_332", axis=axis), "softcap", {})
EPSILON = ("qwen3_sdpa_op18.onnx", lambda m, axis: hide_scalar(m, "val_81", "mean", axis=axis), "qk_norm_epsilon",
           {"rope_in_op": True, "max_positions": 64})  # fmt: skip
CASES = {"scale": SCALE, "softcap": SOFTCAP, "epsilon": EPSILON}


@pytest.mark.parametrize("case", sorted(CASES))
def test_value_folded_from_static_shapes_converts_verified(case, tmp_path):
    fixture, mutate, attr, options = CASES[case]
    dense = _save(mutate(onnx.load(str(FIXTURES / fixture)), -1), tmp_path)
    assert any(n.op_type == "Shape" and n.name.startswith("near_miss.") for n in onnx.load(str(dense)).graph.node)
    out = tmp_path / "paged.onnx"
    verified = [ortpa.convert_file(dense, out, **options).verification]
    assert verified and verified[0].ok  # parity with the near-miss original, checked before writing
    assert verified[0].verdict.structure.twin  # the structure proven in float32, whatever the family
    got = attrs(paged_nodes(onnx.load(str(out)))[0])
    want = _reference_attrs(fixture, **options)
    # the same attribute as the fixture's own conversion (scale: absent when it is the op's 1/sqrt(head size))
    assert got.get(attr, 0.0) == pytest.approx(want.get(attr, 0.0), rel=1e-6), (got, want)


@pytest.mark.parametrize("case", sorted(CASES))
def test_value_that_changes_with_the_prompt_is_refused(case, tmp_path):
    fixture, mutate, _, options = CASES[case]
    dense = _save(mutate(onnx.load(str(FIXTURES / fixture)), -2), tmp_path)
    out = tmp_path / "paged.onnx"
    with pytest.raises(ConversionError) as err:
        ortpa.convert_file(dense, out, **options)
    assert "near_miss." in str(err.value) or "cannot move into PagedAttention" in str(err.value), str(err.value)
    assert not out.exists()


def test_runtime_scale_names_the_node(tmp_path):
    dense = _save(runtime_qk_scale(onnx.load(str(FIXTURES / "llama_sdpa_op18.onnx")), axis=-2), tmp_path)
    with pytest.raises(ConversionError, match=r"Mul by 'near_miss\.0\.scale', a factor computed at run time"):
        ortpa.convert(str(dense))
