"""``convert`` proves each model against its original before writing it (ortpa.parity.verify).

A conversion made wrong on purpose (one layer's attention scale off by 1.5x, injected into the rewriter) must be
refused with nothing written and the error naming that layer, for both families (MHA/GQA SEPARATE and MLA
LATENT); ``verify=False`` / ``--no-verify`` writes it anyway; a correct one carries the rule's figures
(structure on the float32 twin, precision statistics) in its metadata and the CLI's ``--json`` result. The wider
defect suite is tests/test_defects.py.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import onnx
import pytest

import ortpa
import ortpa.rewriter.pipeline as pipeline
from ortpa.cli import main
from ortpa.errors import ConversionError
from ortpa.parity.verify import verification_prompts
from ortpa.tolerances import precision_kl_bound, structure_tolerance

FIXTURES = Path(__file__).parent / "fixtures"
GQA = FIXTURES / "llama_sdpa_op18.onnx"
MLA = FIXTURES / "dsv3_sdpa_op18.onnx"


def _wrong_scale_in_layer(monkeypatch, layer: int) -> None:
    """Make the rewriter emit layer ``layer`` with 1.5x its attention scale: a wrong model that still loads."""
    for name in ("rewrite_attention_layer", "rewrite_mla_layer"):
        original = getattr(pipeline, name)

        def wrong(graph, m, *args, _original=original, **kwargs):
            if m.layer == layer:
                m = dataclasses.replace(m, scale=m.scale * 1.5)
            return _original(graph, m, *args, **kwargs)

        monkeypatch.setattr(pipeline, name, wrong)


def _metadata(path: Path) -> dict[str, str]:
    return {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}


@pytest.mark.parametrize("fixture", [GQA, MLA], ids=["gqa", "mla"])
def test_a_wrong_conversion_is_never_written_and_names_its_layer(tmp_path, monkeypatch, fixture):
    _wrong_scale_in_layer(monkeypatch, 1)
    out = tmp_path / "out" / "paged.onnx"
    with pytest.raises(ConversionError) as err:
        ortpa.convert_file(fixture, out)
    text = str(err.value)
    assert "does not match the original (structure)" in text
    assert "first diverging layer: layer 1 " in text, text  # not layer 0: it was right
    assert not (tmp_path / "out").exists()  # nothing written, not even the folder or a temp file
    # the same wrong model, asked for explicitly
    ortpa.convert_file(fixture, out, verify=False)
    assert out.is_file() and "ortpa.verified" not in _metadata(out)


def test_a_verified_model_carries_its_figures(tmp_path, capsys):
    out = tmp_path / "paged.onnx"
    assert main(["convert", str(GQA), str(out), "--json", "--quiet"]) == 0
    result = json.loads(capsys.readouterr().out)["verification"]
    structure, precision = result["structure"], result["precision"]
    # the float32 twin: llama_sdpa_op18's widest sum is its 128-wide MLP, over 2 attention layers
    assert result["ok"] and structure["twin"] and structure["tolerance"] == structure_tolerance("float32", 128, 2)
    assert 0 < structure["max_relative_error"] < structure["tolerance"]
    # the deployed float16 model: never bit-exact, always within its dtype's bound
    assert 0 < precision["kl_max"] < precision["kl_bound"] == precision_kl_bound("float16")
    assert precision["tokens_agree"] == precision["tokens_checked"] == 3 * 2 and precision["top_k_overlap_min"] == 1
    assert result["prompt_lengths"] == [len(p) for p in verification_prompts([])]
    meta = _metadata(out)
    assert meta["ortpa.verified"] == "1"
    assert float(meta["ortpa.verify.kl_max"]) == pytest.approx(precision["kl_max"], rel=1e-3)
    assert float(meta["ortpa.verify.max_abs_logit_error"]) == pytest.approx(result["max_abs_logit_error"], rel=1e-3)
    assert meta["ortpa.verify.structure"].startswith("float32 twin")
    assert main(["convert", str(GQA), str(out), "--json", "--quiet", "--no-verify"]) == 0
    assert json.loads(capsys.readouterr().out)["verification"] is None
    assert "ortpa.verified" not in _metadata(out)


def test_prompts_pass_every_length_threshold():
    short, longer, past = verification_prompts([40, 7])
    assert len(short) < len(longer) and len(past) > 40
    assert verification_prompts([]) == [short, longer]  # seeded: the same prompts every time


def test_a_model_the_cpu_cannot_run_is_not_written_unverified(tmp_path):
    """bfloat16 arithmetic has no ONNX Runtime CPU kernel: meant for CPU it is refused by the run check; meant for
    CUDA only it cannot be verified on this machine, so refused unless verification is turned off."""
    out = tmp_path / "paged.onnx"
    with pytest.raises(ConversionError, match="cannot run on CPU"):
        ortpa.convert_file(GQA, out, dtype="bfloat16")
    with pytest.raises(ConversionError, match="cannot verify the converted model on this machine"):
        ortpa.convert_file(GQA, out, dtype="bfloat16", providers=("cuda",))
    assert not out.exists()
    ortpa.convert_file(GQA, out, dtype="bfloat16", providers=("cuda",), verify=False)
    assert out.is_file()


def test_convert_writes_nothing_and_convert_file_is_verified(tmp_path):
    """The two names say how they differ: convert is in memory (an output path is refused, pointing at
    convert_file); convert_file writes a verified deployment."""
    with pytest.raises(TypeError, match="convert_file"):
        ortpa.convert(str(GQA), out_path=tmp_path / "paged.onnx")
    assert not list(tmp_path.iterdir())
    assert any(n.op_type == "PagedAttention" for n in ortpa.convert(str(GQA)).graph.node)
    out = tmp_path / "paged.onnx"
    result = ortpa.convert_file(str(GQA), out)
    assert _metadata(out)["ortpa.verified"] == "1" and result.verification is not None
    assert (tmp_path / "genai_config.json").is_file()


def test_a_float16_original_with_an_int8_cache_is_proved_on_its_twins(tmp_path):
    """A float16 original (the GQA fixture rewritten in float16) converted with an int8 cache: the float32 twins of
    both sides (the conversion's without the cache's quantization, its scales dropped) prove the structure at
    float32's bound; precision is judged at int8's."""
    from ortpa.testing.half_file import float16_copy

    original = float16_copy(GQA, tmp_path / "fp16" / "model.onnx")
    result = ortpa.convert_file(original, tmp_path / "paged" / "paged.onnx", kv_cache_dtype="int8")
    s, p = result.verification.verdict.structure, result.verification.verdict.precision
    assert s.twin and s.tolerance == structure_tolerance("float32", 128, 2) and s.max_relative_error < s.tolerance
    assert p.dtype == "int8" and 0 < p.kl_max < p.kl_bound


def test_a_float16_originals_reference_is_its_float32_twins_own_greedy_run(tmp_path, monkeypatch):
    """A float16 original is not run itself: its reference is its float32 twin's greedy run, drafted by the deployed
    model's tokens. A right draft costs one forward per prompt and spares the deployed model a second run; a wrong
    one costs more forwards, never other tokens or logits than the twin's own prefill-then-decode run."""
    import numpy as np

    import ortpa.parity.reference as reference
    import ortpa.parity.verify as verify
    from ortpa.formats.detect import dense_interface
    from ortpa.parity.greedy import dense_greedy
    from ortpa.parity.twin import float32_original
    from ortpa.testing.half_file import float16_copy

    original = float16_copy(GQA, tmp_path / "fp16" / "model.onnx")
    twin = float32_original(original)
    prompts = verification_prompts([])
    session = ortpa.InferenceSession(twin, reference.original_options(half=True), providers=["CPUExecutionProvider"])
    own = dense_greedy(session, prompts, 4, interface=dense_interface(twin.proto))  # prefill, then decodes
    vocab = own.logits[0].shape[-1]
    right = reference.dense_twin_run(twin, prompts, 4, own.tokens, own=True)
    wrong = reference.dense_twin_run(twin, prompts, 4, [[(t + 1) % vocab for t in ts] for ts in own.tokens], own=True)
    assert right.tokens == wrong.tokens == own.tokens
    assert right.runs == len(prompts) and wrong.runs == len(prompts) * 4  # every drafted token wrong: one per step
    for a, b, c in zip(own.logits, right.logits, wrong.logits, strict=True):
        scale = max(1.0, float(np.abs(a).max()))
        assert np.abs(b - a).max() < 1e-5 * scale and np.abs(c - a).max() < 1e-5 * scale  # float32's sums

    # through convert: the half original never opens, the deployed model runs once (its own greedy tokens were the
    # twin's), the conversion's twin once
    runs = []
    real = verify.paged_greedy
    for module in (verify, reference):
        monkeypatch.setattr(module, "open_original", lambda *a: pytest.fail("the float16 original itself was run"))
    for module in (verify, reference):
        monkeypatch.setattr(module, "paged_greedy", lambda *a, **k: runs.append(k.get("follow")) or real(*a, **k))
    result = ortpa.convert_file(original, tmp_path / "paged" / "paged.onnx")
    s, p = result.verification.verdict.structure, result.verification.verdict.precision
    assert s.twin and s.arithmetic == "float32" and s.max_relative_error < s.tolerance
    assert p.ok and p.dtype == "float16" and 0 < p.kl_max < p.kl_bound  # the deployed float16 model vs. float32
    assert len(runs) == 2 and runs[0] is None and runs[1] is not None  # deployed on its own tokens; the twin fed them


def test_the_original_twins_folding_is_the_conversions_without_its_rewrite_rules():
    """float32_original folds constants as onnxscript's optimizer (what the conversion runs) does, without its
    rewrite rules (90 % of its time): every value the optimizer leaves keeps its name (the layer and router probes
    find them in both graphs) and every folded constant its value (a float16 softmax scale is the same in both
    twins)."""
    import numpy as np
    import onnx_ir as ir
    import onnxscript.optimizer
    from onnx import numpy_helper

    from ortpa.parity.twin import _fold_as_the_conversion
    from ortpa.rewriter.model_store import load_ir

    fp16 = FIXTURES / "formats" / "genai_llama_fp16.onnx"
    optimized, folded = load_ir(fp16), load_ir(fp16)
    onnxscript.optimizer.optimize(optimized)
    _fold_as_the_conversion(folded)
    a, b = ir.serde.serialize_model(optimized), ir.serde.serialize_model(folded)
    assert {o for n in a.graph.node for o in n.output} <= {o for n in b.graph.node for o in n.output}
    inits = {i.name: i for i in b.graph.initializer}
    for init in a.graph.initializer:
        if init.name in inits:
            assert np.array_equal(numpy_helper.to_array(init), numpy_helper.to_array(inits[init.name])), init.name
        else:  # what the rules add: shapes, not weights
            assert init.data_type == onnx.TensorProto.INT64, init.name
    assert len(b.graph.node) > len(a.graph.node)  # the rules did run in the optimizer, and not here
