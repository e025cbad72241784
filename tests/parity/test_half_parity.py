"""``ortpa parity`` on an original that computes in float16 takes ``convert``'s path: the original's float32 twin,
drafted by the deployed model's tokens, is the reference (never the half original itself), so the same pair gives
the same verdict and the same figures from both, and a defect is refused by both, naming the same layer. Before,
``ortpa parity`` ran the half original as its reference: its precision statistics measured another thing
(the deployed model against the original's float16 arithmetic) and the run cost the verification's slowest
phase (docs/large_models.md)."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest

from ortpa.cli import main
from ortpa.cli._common import EXIT_INVALID, EXIT_OK
from ortpa.conversion import convert_file
from ortpa.errors import ConversionError
from ortpa.formats.detect import length_thresholds
from ortpa.parity import reference
from ortpa.parity.verify import DEFAULT_STEPS, verification_prompts, verify_conversion
from ortpa.testing import defects

FP16 = Path(__file__).parents[1] / "fixtures" / "formats" / "genai_llama_fp16.onnx"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("half_parity") / "paged.onnx"
    return out, json.loads(json.dumps(convert_file(FP16, out).verification.summary()))  # as --json writes it


def _parity(converted: Path, capsys) -> tuple[int, dict]:
    """``ortpa parity`` on convert's own prompts and steps."""
    prompts = verification_prompts(length_thresholds(onnx.load(str(FP16), load_external_data=False)))
    args = ["parity", str(FP16), str(converted), "--max-new-tokens", str(DEFAULT_STEPS), "--json"]
    for p in prompts:
        args += ["--prompt-ids", ",".join(map(str, p))]
    code = main(args)
    return code, json.loads(capsys.readouterr().out)


def test_parity_of_a_half_original_reports_converts_figures(converted, capsys, monkeypatch):
    path, summary = converted
    # the half original is never run: only where the twin's runs fail is it opened, to say it cannot load
    monkeypatch.setattr(reference, "open_original", lambda *a: pytest.fail("the half original was run"))
    code, result = _parity(path, capsys)
    assert code == EXIT_OK and result["ok"] and summary["ok"]
    s, p = result["structure"], result["precision"]
    assert s["twin"] and s["arithmetic"] == "float32" and 0 < s["max_relative_error"] < s["tolerance"]
    assert p["dtype"] == "float16" and 0 < p["kl_max"] < p["kl_bound"]
    # the same reference, sessions and options: the same numbers, not merely the same verdict
    assert s == summary["structure"] and p == summary["precision"], (result, summary)


def test_a_defect_is_refused_by_both_naming_the_same_layer(converted, tmp_path, capsys):
    bad = tmp_path / "bad" / "paged.onnx"
    bad.parent.mkdir()
    onnx.save(defects.inject("scale", onnx.load(str(converted[0]))), str(bad))  # one layer's scale x1.1
    with pytest.raises(ConversionError) as err:
        verify_conversion(FP16, bad)
    code, result = _parity(bad, capsys)
    text = str(err.value)
    assert code == EXIT_INVALID and not result["structure"]["ok"], result
    where = result["first_diverging_layer"]
    assert where.startswith("layer ") and f"first diverging layer: {where}" in text, (where, text)


def test_buffers_are_reused_only_running_ortpas_own_export():
    """The float32 twin of ortpa's own export runs with ONNX Runtime's buffer reuse (without it every value of a
    run stays allocated: 0.83 GB above the opening of a 14-layer DeepSeek-V3 MoE's twin, 0.24 GB with it); a genai
    fp16 build keeps it off (its value_info declares a buffer too small for reuse) and so does a half session's
    memory pattern (docs/large_models.md)."""
    fixtures = Path(__file__).resolve().parents[1] / "fixtures"
    own = onnx.load(str(fixtures / "llama_sdpa_op18.onnx"), load_external_data=False)
    genai = onnx.load(str(fixtures / "formats" / "genai_llama_fp16.onnx"), load_external_data=False)
    assert reference._reusable(own)
    assert not reference._reusable(genai)
    assert reference.original_options(half=True, reuse=True).enable_mem_reuse
    assert not reference.original_options(half=True).enable_mem_reuse
    assert not reference.half_options().enable_mem_pattern
    # nor any verification session (the pattern also reserves one block of every weight's bytes at opening:
    # std::bad_alloc for a model larger than memory)
    assert not reference.original_options(half=True, reuse=True).enable_mem_pattern
    assert not reference.original_options(half=False).enable_mem_pattern


def test_an_original_onnx_runtime_cannot_allocate_is_said_as_memory_with_what_failed_first(monkeypatch):
    """A 26 GB float16 original on a 25 GB machine: the deployed model's run failed, then ONNX Runtime could not
    open the original (std::bad_alloc), which was reported as a missing bfloat16 kernel and hid the first failure."""
    import onnxruntime as ort
    from onnxruntime.capi.onnxruntime_pybind11_state import RuntimeException

    fixtures = Path(__file__).resolve().parents[1] / "fixtures"
    original = fixtures / "llama_sdpa_op18.onnx"

    real = ort.InferenceSession

    def no_memory(model, *args, **kwargs):  # the session of the original's path; read_model's own probe runs
        if model == str(original):
            raise RuntimeException("Exception during initialization: std::bad_alloc")
        return real(model, *args, **kwargs)

    monkeypatch.setattr(ort, "InferenceSession", no_memory)
    with pytest.raises(ConversionError, match="ran out of memory opening the original") as err:
        reference.open_original(original)
    assert "bfloat16" not in str(err.value)

    class Failing(reference.Deployment):
        def open(self, model, options):
            raise MemoryError("the deployed model's session")

    with pytest.raises(ConversionError, match="ran out of memory") as err:
        reference.twin_reference(original, original, [[1, 2, 3]], 2, 4, Failing(4))
    assert "failed first: MemoryError: the deployed model's session" in str(err.value)
