"""One drawn config through the whole path a user takes, and its outcome.

The model is built from the draw's config with seeded random weights and saved as a Hugging Face checkpoint in
the draw's dtype (FP8 block-quantized in DeepSeek-V3's layout for ``fp8``). The checkpoint is exported by the
draw's tool: ``dynamo`` as ``ortpa convert HF_DIR`` exports it (:func:`ortpa.export.hf.export_hf`, its default
dtype: float16 for bfloat16 and FP8 folders); ``genai``, ``optimum`` and ``onnx_exporter`` by that tool with its
default options, in its own venv (:func:`ortpa.testing.export_tools.export_in_venv`, which also saves the
checkpoint there, with that venv's transformers). The export (the tool's output folder, or its decode model for
``onnx_exporter``) is converted by :func:`ortpa.convert_file` with its default options (verification on), and the
written model judged against the export run by ONNX Runtime (:mod:`ortpa.testing.sweep.judge`). Outcomes:

* ``converted-and-correct``: written, and its greedy tokens batched and alone are the original's (tie rule);
* ``refused-with-a-named-leak``: refused by the per-sequence flow, every reason a definite leak (a value shown
  to mix sequences), or refused up front for a computation that mixes them by definition
  (:class:`~ortpa.errors.UnsupportedModel` ``mixes_sequences``: dynamic NTK RoPE);
* ``refused-unsupported``: refused up front, naming a computation the op cannot express
  (:class:`~ortpa.errors.UnsupportedModel` without ``mixes_sequences``: ALiBi's bias on the scores);
* ``refused-other``: any other refusal (verification, a layer no recogniser takes, a gap in the flow): a bug;
* ``wrong``: written, with tokens outside the tie rule: a bug;
* ``error``: the sweep could not get as far as a verdict (the build or export failed, a run crashed): a bug.

Nothing here raises for one config: the exception's class and first line become the reason.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from ortpa.testing.sweep.judge import judge_conversion, sweep_prompts
from ortpa.testing.sweep.space import Draw

__all__ = ["OUTCOMES", "UNSUPPORTED", "Outcome", "classify_refusal", "convert_and_judge", "run_draw"]

CORRECT, LEAK, OTHER, WRONG, ERROR = (
    "converted-and-correct",
    "refused-with-a-named-leak",
    "refused-other",
    "wrong",
    "error",
)
UNSUPPORTED = "refused-unsupported"
# UNSUPPORTED last: reports show its column only where a draw has it (tables written before it keep their columns)
OUTCOMES = (CORRECT, LEAK, OTHER, WRONG, ERROR, UNSUPPORTED)

# the per-sequence pass's refusal (ortpa.rewriter.per_sequence.reductions)
_FLOW_REFUSAL = "values computed over the whole packed step"
# reasons the flow gives when it lost track rather than found a leak (ortpa.rewriter.per_sequence.segments)
# RoPE scalings that compute differently past the original length (YaRN and llama3 scale statically)
_SWITCHING = ("dynamic", "longrope")
_GAPS = ("cannot follow", "unknown is step-wide", "no rule", "regrouped")


@dataclass(frozen=True)
class Outcome:
    """One config's result: what was drawn, the outcome, why, and how long it took."""

    family: str
    seed: int
    config: str  # Draw.summary()
    outcome: str  # one of OUTCOMES
    reason: str
    seconds: float
    stage: str  # where it ended: build, export, convert, judge, done
    max_abs_logit_error: float | None = None
    tool: str = "dynamo"  # the exporter (space.TOOLS)

    def to_dict(self) -> dict:
        return asdict(self)


def _first_line(exc: BaseException, limit: int = 300) -> str:
    text = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
    return f"{type(exc).__name__}: {text[:limit]}"


def classify_refusal(exc: BaseException) -> tuple[str, str]:
    """``(outcome, reason)`` for an exception ``ortpa.convert_file`` raised: a named leak only when the per-sequence
    pass refused and every failure it lists is definite (no "cannot follow", no op without a rule); an up-front
    :class:`~ortpa.errors.UnsupportedModel` is a named leak where the model mixes sequences, else unsupported."""
    from ortpa.errors import ConversionError, UnsupportedModel

    if isinstance(exc, UnsupportedModel):
        return (LEAK if exc.mixes_sequences else UNSUPPORTED), _first_line(exc)

    failures = list(getattr(exc, "failures", None) or [])
    listed = "; ".join(f"{where}: {why}" for where, why in failures)
    reason = _first_line(exc) + (f" [{listed[:600]}]" if listed else "")
    if not isinstance(exc, ConversionError):
        return ERROR, reason
    if str(exc).startswith(_FLOW_REFUSAL) and failures and not any(g in why for _, why in failures for g in _GAPS):
        return LEAK, reason
    return OTHER, reason


def _save_checkpoint(draw: Draw, folder: Path) -> None:
    import torch
    from transformers.utils import logging as hf_logging

    from ortpa.export.hf import build_model
    from ortpa.testing.checkpoints import save_fp8_checkpoint

    model = build_model(draw.config, seed=draw.seed, attn_implementation=draw.attn_implementation)
    hf_logging.disable_progress_bar()  # one line per config in the sweep's output, not a bar per save
    size = sum(p.numel() for p in model.parameters()) * 2
    shard = f"{max(100, size // 3 // 1000)}KB"  # two or more shards, as checkpoints ship
    if draw.source_dtype == "fp8":
        save_fp8_checkpoint(model, folder, shard=shard)
    else:
        model.to(getattr(torch, draw.source_dtype)).save_pretrained(folder, max_shard_size=shard)


def convert_and_judge(
    dense: Path,
    out: Path,
    prompts: list[list[int]],
    *,
    steps: int = 6,
    convert: Callable[..., object] | None = None,
    source: Path | None = None,
) -> tuple[str, str, float | None]:
    """``(outcome, reason, max |dlogit|)`` of converting ``source`` (``dense`` unless given: a tool's output
    folder, say) into ``out`` with the default options, judged against the dense model file ``dense``.

    A refusal that is not a named leak gets a second opinion: the same conversion unverified
    (``verify=False``), judged like any other, so the table says whether a correct model was refused (its
    tokens are the original's) or a wrong one (they are not). ``convert``: :func:`ortpa.convert_file` unless given
    (tests hand in a deliberately wrong one)."""
    if convert is None:
        import ortpa

        convert = ortpa.convert_file
    source = dense if source is None else source
    try:
        convert(str(source), str(out))
    except Exception as exc:  # a refusal (or a crash): which kind is the point of the sweep
        outcome, reason = classify_refusal(exc)
        if outcome == OTHER:
            reason = f"{reason} -- unverified: {_second_opinion(dense, out, prompts, steps, convert, source)}"
        return outcome, reason, None
    verdict = judge_conversion(dense, out, prompts, steps=steps)
    reason = verdict.reason
    if verdict.correct and verdict.float32_activations_error is not None:  # an int8-activation original's figures
        reason = (
            f"{verdict.int8_ties} tie flip(s) under int8's rule; float32 activations max |dlogit| "
            f"{verdict.float32_activations_error:.2e}"
        )
    return (CORRECT if verdict.correct else WRONG), reason, verdict.max_abs_logit_error


def _second_opinion(
    dense: Path, out: Path, prompts: list[list[int]], steps: int, convert: Callable, source: Path
) -> str:
    try:
        convert(str(source), str(out), verify=False)
        verdict = judge_conversion(dense, out, prompts, steps=steps)
    except Exception as exc:  # what the unverified path says is information, never the sweep's end
        return f"not written ({_first_line(exc, 200)})"
    if verdict.correct:
        return f"written, greedy tokens the original's (max |dlogit| {verdict.max_abs_logit_error:.2e})"
    return f"written, WRONG: {verdict.reason}"


def run_draw(draw: Draw, workdir: str | Path | None = None, *, steps: int = 6) -> Outcome:
    """Build, save, export, convert (verification on) and judge ``draw``; never raises for the config's sake.

    ``workdir``: where the checkpoint, the export and the converted model go (a temporary folder, removed after,
    by default)."""
    start = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix=f"sweep-{draw.family}-{draw.seed}-", dir=workdir))
    stage = "build"

    def done(outcome: str, reason: str, err: float | None = None) -> Outcome:
        seconds = time.perf_counter() - start
        summary = draw.summary()
        return Outcome(draw.family, draw.seed, summary, outcome, reason, round(seconds, 1), stage, err, draw.tool)

    try:
        out = root / "paged" / "model.onnx"
        if draw.tool == "dynamo":
            from ortpa.export.hf import export_hf

            folder, dense = root / "ckpt", root / "dense" / "model.onnx"
            _save_checkpoint(draw, folder)
            stage = "export"
            export_hf(folder, dense, random_weights=False, attn_implementation=draw.attn_implementation)
            source = dense
        else:
            from ortpa.testing.export_tools import export_in_venv

            stage = "export"  # the tool's venv saves the checkpoint with its own transformers, then exports it
            made = export_in_venv(
                draw.tool, draw.config, root / "tool", seed=draw.seed, dtype=draw.source_dtype, opts=draw.tool_options
            )
            # what a user hands to `ortpa convert`: the output folder where the tool writes one model to a folder
            dense, source = made.model, (made.model if draw.tool == "onnx_exporter" else made.folder)
        stage = "convert"
        prompts = sweep_prompts(draw.config["vocab_size"], _thresholds(draw.config), draw.seed)
        outcome, reason, err = convert_and_judge(dense, out, prompts, steps=steps, source=source)
        stage = "done"
        return done(outcome, reason, err)
    except Exception as exc:  # the sweep goes on: the class and first line are the record
        from ortpa.errors import UnsupportedModel

        if isinstance(exc, UnsupportedModel):
            return done(*classify_refusal(exc))
        return done(ERROR, _first_line(exc))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _thresholds(config: dict) -> list[int]:
    """Lengths past which the model computes differently: windows, RoPE's original length (a long prompt must
    pass each; ``ortpa.formats.length_thresholds`` finds them in genai graphs, not in dynamo exports)."""
    found = [config.get("sliding_window") or 0]
    rope = config.get("rope_parameters") or {}
    for params in [rope, *(v for v in rope.values() if isinstance(v, dict))]:
        if params.get("rope_type") in _SWITCHING:
            found.append(params.get("original_max_position_embeddings") or config["original_max_position_embeddings"])
    return [t for t in found if t]
