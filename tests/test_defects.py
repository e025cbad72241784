"""Sensitivity: deliberate conversion defects that ``convert``'s verification and ``ortpa parity`` must refuse.

The defects (:mod:`ortpa.testing.defects`) are the issue's: one layer's scale off by 10 %, the RoPE base doubled,
the window off by one, the softcap dropped, two query heads swapped, a sink dropped, one layer's norm epsilon
x100, one layer's cache position shifted by one; and one MoE router's scores negated (routing changed at a wide
margin, which no routing tie excuses). Each is injected into a fixture that has the feature (a window
needs a windowed model, a sink a model with sinks) and checked twice: by
:func:`ortpa.parity.verify.verify_conversion` (what ``convert`` runs before it writes) and by ``ortpa parity``.
The same models undefected pass both. A seeded draw of dense MLA configs (depth, width, heads, LoRA ranks, RoPE
layout, vocabulary, cache dtype) repeats the check on models no fixture fixes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from ortpa.cli import main
from ortpa.cli._common import EXIT_INVALID, EXIT_OK
from ortpa.conversion import convert_file
from ortpa.errors import ConversionError
from ortpa.parity.verify import verify_conversion
from ortpa.testing import defects
from ortpa.testing.dense_mla import DenseMlaConfig, build_dense_mla
from ortpa.tolerances import structure_tolerance

FIXTURES = Path(__file__).parent / "fixtures"
LLAMA = FIXTURES / "llama_sdpa_op18.onnx"
WINDOWED = FIXTURES / "qwen2_sliding_sdpa_op18.onnx"
SOFTCAPPED = FIXTURES / "gemma2_eager_op18.onnx"
SINKS = FIXTURES / "formats" / "genai_gptoss_fp32.onnx"
# defect -> the fixture that has what it changes
WHERE = {
    "scale": LLAMA,
    "rope_base": LLAMA,
    "window": WINDOWED,
    "softcap": SOFTCAPPED,
    "heads": LLAMA,
    "sink": SINKS,
    "norm_eps": LLAMA,
    "cache_position": LLAMA,
    "routing": FIXTURES / "dsv3_moe_sdpa_op18.onnx",  # the middle router's scores negated: a wide-margin change
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Each fixture converted once, verified (the undefected model passes convert's own check)."""
    root = tmp_path_factory.mktemp("defects")
    out = {}
    for k, original in enumerate(sorted(set(WHERE.values()))):
        convert_file(original, root / f"m{k}" / "paged.onnx")
        out[original] = root / f"m{k}" / "paged.onnx"
    return out


def _defected(kind: str, converted, tmp_path: Path) -> Path:
    original = WHERE[kind]
    bad = tmp_path / "bad" / "paged.onnx"
    if kind in defects.ORIGINAL_DEFECTS:  # the conversion of a defected original, against the true original
        bad_original = tmp_path / "bad_original.onnx"
        onnx.save(defects.inject(kind, onnx.load(str(original))), str(bad_original))
        convert_file(bad_original, bad, verify=False)
    else:
        bad.parent.mkdir()
        onnx.save(defects.inject(kind, onnx.load(str(converted[original]))), str(bad))
    return bad


def _parity(original: Path, model: Path, capsys) -> int:
    code = main(["parity", str(original), str(model), "--max-new-tokens", "2", "--json"])
    capsys.readouterr()
    return code


# ortpa parity runs the same rule (ortpa.parity.verify.run_rule): two defects in CI, all with ORTPA_SLOW=1
_PARITY_IN_CI = ("scale", "window")


@pytest.mark.parametrize("kind", [k if k in _PARITY_IN_CI else pytest.param(k, marks=pytest.mark.slow) for k in WHERE])
def test_defects_are_refused_by_parity(kind, converted, tmp_path, capsys):
    assert _parity(WHERE[kind], _defected(kind, converted, tmp_path), capsys) == EXIT_INVALID


@pytest.mark.parametrize("kind", list(WHERE))
def test_every_defect_is_refused_by_convert(kind, converted, tmp_path):
    bad = _defected(kind, converted, tmp_path)
    with pytest.raises(ConversionError) as err:
        verify_conversion(WHERE[kind], bad)
    text = str(err.value)
    assert "does not match the original (structure)" in text, text
    # the fixture's router is in its last layer, after every attention output the probe compares
    located = "first diverging layer: none of" if kind == "routing" else "first diverging layer: layer "
    assert located in text, text


@pytest.mark.parametrize(
    "original",
    [o if o == LLAMA else pytest.param(o, marks=pytest.mark.slow) for o in sorted(set(WHERE.values()))],
    ids=lambda p: p.stem,
)
def test_the_same_models_undefected_pass_both(original, converted, capsys):
    path = converted[original]
    assert {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}["ortpa.verified"]
    assert _parity(original, path, capsys) == EXIT_OK


# An original that computes in float16 itself (onnxruntime-genai's fp16 build): no cast marks the attention's
# boundary, so both sides get a float32 twin (ortpa.parity.upcast) and structure is judged at float32's bound.
# At float16's own bound these two defects passed (a scale x1.1 cost the deployed model a KL of 5e-4).
FP16 = FIXTURES / "formats" / "genai_llama_fp16.onnx"


@pytest.fixture(scope="module")
def converted_fp16(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp16") / "paged.onnx"
    return out, convert_file(FP16, out).verification.verdict


def test_a_float16_original_passes_at_the_float32_bound(converted_fp16):
    _, verdict = converted_fp16
    s, p = verdict.structure, verdict.precision
    # float32's bound, not float16's: its widest sum is the 128-wide MLP, over 2 attention layers
    assert s.twin and s.arithmetic == "float32" and s.tolerance == structure_tolerance("float32", 128, 2)
    assert s.max_relative_error < s.tolerance
    assert p.dtype == "float16" and 0 < p.kl_max < p.kl_bound  # precision: the deployed model against the original


@pytest.mark.parametrize("kind", ["scale", "rope_base"])
def test_a_float16_originals_defects_are_refused_by_structure(kind, converted_fp16, tmp_path):
    bad = tmp_path / "bad" / "paged.onnx"
    if kind in defects.ORIGINAL_DEFECTS:  # genai's cos/sin tables recomputed for the base x2
        bad_original = tmp_path / "bad_original.onnx"
        onnx.save(defects.inject(kind, onnx.load(str(FP16))), str(bad_original))
        convert_file(bad_original, bad, verify=False)
    else:
        bad.parent.mkdir()
        onnx.save(defects.inject(kind, onnx.load(str(converted_fp16[0]))), str(bad))
    with pytest.raises(ConversionError) as err:
        verify_conversion(FP16, bad)
    text = str(err.value)
    assert "does not match the original (structure)" in text, text
    assert "first diverging layer: layer " in text and "(float32 twin)" in text, text


def _sampled_configs(seed: int, n: int):
    """A seeded draw over the dense MLA config space (what no fixture fixes), with the cache dtype."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        nope = int(rng.choice([16, 32, 64]))
        hidden = int(rng.choice([64, 128, 256]))
        config = DenseMlaConfig(
            hidden=hidden,
            layers=int(rng.integers(2, 5)),
            heads=int(rng.choice([2, 4, 8])),
            q_lora_rank=[None, 48, 96][int(rng.integers(3))],
            kv_lora_rank=int(rng.choice([32, 64, 128])),
            qk_nope=nope,
            qk_rope=int(rng.choice([16, 32])),
            v_head=nope,
            vocab=int(rng.choice([256, 1024, 4096])),
            intermediate=2 * hidden,
            rope_interleave=bool(rng.integers(2)),
            seed=seed * 100 + i,
        )
        yield config, [None, "int8"][int(rng.integers(2))]


def _sampled_cases():
    cases = list(_sampled_configs(28, 4))
    return [pytest.param(*case, marks=[pytest.mark.slow] if k else []) for k, case in enumerate(cases)]


@pytest.mark.parametrize("config,kv_cache_dtype", _sampled_cases(), ids=lambda v: str(v)[:40])
def test_sampled_models_pass_and_their_defects_do_not(config, kv_cache_dtype, tmp_path):
    original = tmp_path / "dense.onnx"
    onnx.save(build_dense_mla(config), str(original))
    out = tmp_path / "paged" / "paged.onnx"
    structure = convert_file(original, out, kv_cache_dtype=kv_cache_dtype).verification.verdict.structure
    assert structure.twin and structure.max_relative_error < structure.tolerance
    for kind in ("scale", "heads"):
        bad = tmp_path / f"{kind}.onnx"
        onnx.save(defects.inject(kind, onnx.load(str(out))), str(bad))
        with pytest.raises(ConversionError, match=r"first diverging layer: layer \d"):
            verify_conversion(original, bad)
    bad_original = tmp_path / "rope_base.onnx"
    onnx.save(defects.inject("rope_base", onnx.load(str(original))), str(bad_original))
    convert_file(bad_original, tmp_path / "rope" / "paged.onnx", kv_cache_dtype=kv_cache_dtype, verify=False)
    with pytest.raises(ConversionError, match="does not match the original"):
        verify_conversion(original, tmp_path / "rope" / "paged.onnx")


def test_a_defect_that_does_not_apply_says_so():
    with pytest.raises(defects.DefectNotApplicable, match="no PagedAttention node"):
        defects.inject("window", onnx.load(str(FIXTURES / "llama_sdpa_op18.onnx")))
    with pytest.raises(KeyError, match="unknown defect"):
        defects.inject("typo", onnx.ModelProto())
