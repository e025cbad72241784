"""The conversion's own proof: a converted model against its original, before the converted model is written.

:func:`verify_conversion` runs the converted model (batched, :func:`~ortpa.parity.greedy.paged_greedy`) and the
original (alone, in its own format, :func:`~ortpa.parity.greedy.dense_greedy`) on a few seeded prompts — a short
one, a longer one, and one past every length threshold of the original (:func:`ortpa.formats.length_thresholds`)
— for a few greedy steps, and compares them with :func:`~ortpa.parity.check.compare_runs` within the one tolerance
table (:mod:`ortpa.tolerances`). The original follows the converted run's tokens (teacher forcing), so a greedy
tie (two tokens within the bound of each other, :func:`ortpa.tolerances.tie_bound`) neither fails the check nor
makes the later steps incomparable; ties past :func:`ortpa.tolerances.max_tie_flips` fail it.

On a mismatch the error names the first layer whose output diverges: both graphs get, for each layer, the first
value after its attention that keeps its name through the rewrite (the output projection's output; the residual
sum where MLA absorption folded the projection) as an extra graph output (temporary header copies; the weights
stay in their files), one prompt's prefill runs on each, and the first layer past the bound is the cause
reported. Comparing there rather than only the logits points at the layer, not at the end of the model.

Memory: the two sessions open from their paths one after the other (the converted first, then the original), with
ONNX Runtime's weight prepacking off, so the weights stay memory-mapped from their files (read, not copied into
private memory) and convert's memory bound holds with verification.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from ortpa.errors import ConversionError, InvalidModel
from ortpa.parity.check import ParityResult, compare_runs
from ortpa.parity.greedy import dense_greedy, paged_greedy
from ortpa.providers import CPU
from ortpa.tolerances import FAMILY_EXTRA_ATOL, logit_tolerance

__all__ = ["DEFAULT_STEPS", "Verification", "verification_prompts", "verify_conversion"]

DEFAULT_STEPS = 3  # greedy steps: the prefill and two decodes (the first decode reads the cache the prefill wrote)
_BLOCK_SIZE = 16


@dataclass
class Verification:
    """What :func:`verify_conversion` found: the parity verdict, the tie flips it allowed, the cost."""

    parity: ParityResult
    tie_flips: int
    seconds: float
    steps: int
    prompt_lengths: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.parity.ok

    def summary(self) -> dict:
        """The figures for the ``--json`` result and the model's metadata."""
        return {
            "ok": self.ok,
            "max_abs_logit_error": self.parity.max_abs_logit_error,
            "atol": self.parity.atol,
            "rtol": self.parity.rtol,
            "prompt_lengths": self.prompt_lengths,
            "steps": self.steps,
            "tie_flips": self.tie_flips,
            "seconds": round(self.seconds, 3),
        }

    def metadata(self) -> dict[str, str]:
        s = self.summary()
        return {
            "ortpa.verified": "1",
            "ortpa.verify.max_abs_logit_error": f"{s['max_abs_logit_error']:.3e}",
            "ortpa.verify.tolerance": f"atol {s['atol']:g} + rtol {s['rtol']:g} * |original|",
            "ortpa.verify.prompt_lengths": ",".join(str(n) for n in s["prompt_lengths"]),
            "ortpa.verify.steps": str(s["steps"]),
            "ortpa.verify.tie_flips": str(s["tie_flips"]),
        }


def verification_prompts(thresholds: Sequence[int]) -> list[list[int]]:
    """A short prompt, a longer one (past one cache block, so the op reads two blocks), and one past every
    length threshold of the original. Seeded (fixed) token ids below 64: every fixture's vocabulary has them."""
    rng = np.random.default_rng(24)
    prompts = [[int(t) for t in rng.integers(1, 64, 3)], [int(t) for t in rng.integers(1, 64, _BLOCK_SIZE + 3)]]
    if thresholds:
        prompts.append([int(t) for t in rng.integers(1, 64, max(thresholds) + 3)])
    return prompts


def _lean_options():
    """Session options for a few verification steps: no weight prepacking, so ONNX Runtime's CPU kernels read
    the memory-mapped weights in place instead of copying each MatMul's weight into private memory (measured on a
    0.85 GB model's original: 561 MB of private memory with prepacking, 2 MB without)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.add_session_config_entry("session.disable_prepacking", "1")
    return options


def _open_original(original: str | os.PathLike):
    """The original's CPU session from its path (as :func:`ortpa.parity.greedy.open_dense`: memory reuse off for
    the genai fp16 builds' value_info), with :func:`_lean_options`; and its interface."""
    import onnxruntime as ort

    from ortpa.formats.detect import dense_interface
    from ortpa.model.file import read_model

    options = _lean_options()
    options.enable_mem_reuse = False
    try:
        session = ort.InferenceSession(os.fspath(original), options, providers=[CPU])
    except Exception as exc:  # ONNX Runtime's own types (Fail, InvalidGraph...): a bfloat16 original, typically
        if not type(exc).__module__.startswith("onnxruntime"):
            raise
        raise ConversionError(
            "cannot verify the converted model on this machine: ONNX Runtime's CPU kernels do not run the original "
            "(bfloat16 arithmetic has no CPU kernel); nothing was written. Pass --no-verify (verify=False) to write "
            "it unverified, then check it with `ortpa parity ORIGINAL CONVERTED --provider cuda` on a GPU",
            [("original (CPU)", str(exc)[-300:])],
        ) from None
    return session, dense_interface(read_model(original, load_external_data=False).proto)


def _cache_dtype(session) -> str:
    from ortpa.dtypes import dtype_name

    declared = {i.name: i for i in session.session.model.graph.input}
    return dtype_name(declared[session.aliases[0].input_name].type.tensor_type.elem_type)


def verify_conversion(
    original: str | os.PathLike,
    converted: str | os.PathLike,
    *,
    steps: int = DEFAULT_STEPS,
    family: str | None = None,
    extra_atol: float = 0.0,
    progress: Callable[[str], None] | None = None,
) -> Verification:
    """Run ``converted`` against ``original`` (paths); raise :class:`ConversionError` naming the first diverging
    layer when they disagree, else return the figures. ``extra_atol`` adds to the tolerance table's bound (a
    whole-model float16 conversion: :data:`ortpa.tolerances.FP16_WEIGHTS_EXTRA_ATOL`)."""
    import time

    from ortpa.formats.detect import length_thresholds
    from ortpa.model.file import read_model
    from ortpa.runtime.session import PagedSession

    start = time.perf_counter()
    thresholds = length_thresholds(read_model(original, load_external_data=False).proto)
    prompts = verification_prompts(thresholds)
    if progress is not None:
        progress(f"verifying against the original ({len(prompts)} prompts, {steps} greedy steps)")
    blocks = sum(-(-(len(p) + steps) // _BLOCK_SIZE) for p in prompts) + 1
    try:
        paged = PagedSession(
            converted,
            num_blocks=blocks,
            block_size=_BLOCK_SIZE,
            providers=[CPU],
            sess_options=_lean_options(),
        )
    except InvalidModel as exc:
        if "Could not find an implementation" not in str(exc):
            raise
        raise ConversionError(
            "cannot verify the converted model on this machine: ONNX Runtime's CPU kernels do not run it "
            "(bfloat16 arithmetic has no CPU kernel); nothing was written. Pass --no-verify (verify=False) to write "
            "it unverified, then check it with `ortpa parity ORIGINAL CONVERTED --provider cuda` on a GPU",
            [("session (CPU)", str(exc)[-300:])],
        ) from None
    cache_dtype = _cache_dtype(paged)
    got = paged_greedy(paged, prompts, steps)
    del paged
    gc.collect()
    session, interface = _open_original(original)
    want = dense_greedy(session, prompts, steps, follow=got.tokens, interface=interface)
    del session
    gc.collect()
    rtol, atol = logit_tolerance(cache_dtype, family)
    atol += extra_atol
    # the original followed the converted tokens: every step compares the same inputs, and a flip is judged by
    # the one tie rule of compare_runs
    result = compare_runs(want, got, rtol=rtol, atol=atol)
    flips = result.ties
    verification = Verification(result, flips, time.perf_counter() - start, steps, [len(p) for p in prompts])
    if not result.ok:
        raise _mismatch(original, converted, prompts, got, want, result, flips, rtol, atol)
    return verification


# ------------------------------------------------------------------------------------------ the first layer
def _mismatch(original, converted, prompts, got, want, result, flips, rtol, atol) -> ConversionError:
    """The error for a failed verification: the figures, and the first diverging layer where it can be found."""
    bad = next(
        (
            p
            for p in range(len(prompts))
            if not np.allclose(got.logits[p], want.logits[p][: len(got.logits[p])], rtol=rtol, atol=atol)
        ),
        0,
    )
    step = next((s.step for s in result.steps if s.max_abs_logit_error > atol), 0)
    details = [
        ("logits", f"max |dlogit| {result.max_abs_logit_error:.3e} (atol {atol:g} + rtol {rtol:g} * |original|)"),
        ("first differing step", f"{step} (prompt {bad}, {len(prompts[bad])} tokens)"),
    ]
    if flips:
        details.append(("tie flips", f"{flips}"))
    try:
        where = first_diverging_layer(original, converted, prompts[bad], rtol, atol)
    except Exception as exc:  # the diagnosis must never hide the verdict
        where = f"not located ({type(exc).__name__}: {str(exc)[:200]})"
    details.insert(0, ("first diverging layer", where))
    return ConversionError(
        "the converted model does not match the original; nothing was written (pass --no-verify / verify=False "
        "to write it anyway)",
        details,
    )


def _layer_outputs(proto: onnx.ModelProto, known: set[str]) -> list[tuple[int, str]]:
    """(layer, name) for each PagedAttention node: the first value after it, along its single-consumer chain,
    that also exists in the original (``known``): its output projection's output, or where the rewrite folded
    that projection (MLA absorption), the residual sum after it."""
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in proto.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    found = []
    for index, node in enumerate(n for n in proto.graph.node if n.op_type == "PagedAttention"):
        value = node.output[0]
        for _ in range(12):  # Reshape / Cast / the projection(s) / the residual Add
            nexts = consumers.get(value, [])
            if len(nexts) != 1 or not nexts[0].output:
                break
            value = nexts[0].output[0]
            if value in known:
                found.append((index, value))
                break
    return found


def _probe(proto: onnx.ModelProto, names: Sequence[str]) -> onnx.ModelProto:
    """A copy of the graph (weights not read) with ``names`` as extra outputs, typed as inference finds them."""
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    try:
        inferred = onnx.shape_inference.infer_shapes(out).graph.value_info
    except Exception:  # contrib ops onnx cannot type: ORT still finds the types, float is the fallback
        inferred = []
    types = {vi.name: vi for vi in inferred}
    have = {o.name for o in out.graph.output}
    for name in names:
        if name in have:
            continue
        vi = onnx.ValueInfoProto()
        if name in types:
            vi.CopyFrom(types[name])
            vi.type.tensor_type.ClearField("shape")
        else:
            vi.name = name
            vi.type.tensor_type.elem_type = onnx.TensorProto.FLOAT
        out.graph.output.append(vi)
    return out


def first_diverging_layer(
    original: str | os.PathLike, converted: str | os.PathLike, prompt: Sequence[int], rtol: float, atol: float
) -> str:
    """``"layer i (value): max |d| x"`` for the first layer whose attention block output (its o_proj) differs
    past ``atol + rtol * |original|`` on ``prompt``'s prefill; a sentence saying why when none is found."""
    from ortpa.formats.detect import dense_interface
    from ortpa.model.file import LoadedModel, read_model
    from ortpa.runtime.kv import PagedKVCache
    from ortpa.runtime.session import InferenceSession, PagedSession

    paged_file = read_model(converted, load_external_data=False)
    dense_file = read_model(original, load_external_data=False)
    dense_names = {v for n in dense_file.proto.graph.node for v in n.output}
    layers = _layer_outputs(paged_file.proto, dense_names)
    if not layers:
        return "not located: no value after any layer's attention has the same name in both graphs"
    names = [name for _, name in layers]
    # a label that is not the file's path: the session then opens this graph, not the file (weights still from
    # the model's own data files)
    probe = LoadedModel(
        _probe(paged_file.proto, names), f"{paged_file.label} (probe)", paged_file.base_dir, paged_file.external
    )
    blocks = -(-len(prompt) // _BLOCK_SIZE) + 1
    paged = PagedSession(
        probe,
        num_blocks=blocks,
        block_size=_BLOCK_SIZE,
        providers=[CPU],
        sess_options=_lean_options(),
    )
    kv = PagedKVCache(paged.num_blocks, paged.block_size)
    kv.add_sequence(0)
    step = kv.plan_step([(0, len(prompt))])
    declared = {i.name for i in paged.session.get_inputs()}
    feed = step.model_feeds(
        np.array(list(prompt), np.int64),
        attention_metadata="attention_metadata" in declared,
        position_ids="position_ids" in declared,
    )
    got = paged.run(feed, names)
    del paged
    gc.collect()
    dense_probe = LoadedModel(
        _probe(dense_file.proto, names), f"{dense_file.label} (probe)", dense_file.base_dir, dense_file.external
    )
    options = _lean_options()
    options.enable_mem_reuse = False
    session = InferenceSession(dense_probe, options, providers=[CPU])
    io = dense_interface(dense_file.proto)
    want = dict(zip(names, session.run(names, io.feed(list(prompt), 0, io.empty_past())), strict=True))
    del session
    for layer, name in layers:
        a = np.asarray(got[name], np.float32).reshape(len(prompt), -1)
        b = np.asarray(want[name], np.float32).reshape(len(prompt), -1)
        if a.shape != b.shape:
            return f"not located: layer {layer}'s {name} is {a.shape} converted, {b.shape} original"
        err = float(np.abs(a - b).max())
        if not bool((np.abs(a - b) <= atol + rtol * np.abs(b)).all()):
            return f"layer {layer} ({name}): max |d| {err:.3e} after its attention"
    return f"none of {len(layers)} layers' attention outputs differs past the bound on the prefill; later steps do"


def family_of(original: str | os.PathLike) -> str | None:
    """A model family of :data:`ortpa.tolerances.FAMILY_EXTRA_ATOL` the original declares: its folder's
    ``config.json`` ``model_type`` (``gemma2``), and ``-genai`` when onnxruntime-genai built it."""
    import json

    folder = Path(original).parent
    try:
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(model_type, str):
        return None
    genai = (folder / "genai_config.json").is_file()
    for name in (f"{model_type}-genai" if genai else None, model_type):
        if name in FAMILY_EXTRA_ATOL:
            return name
    return None
