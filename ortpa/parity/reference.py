"""The runs verification judges against, and the sessions it opens for them (:mod:`ortpa.parity.verify`).

The original runs in its own format (:func:`~ortpa.parity.greedy.dense_greedy`); an original that computes in a
half type is not run itself: its float32 twin's greedy run is the reference (:func:`twin_reference`,
docs/verification.md), drafted by the deployed model's own tokens (:func:`dense_twin_run`). Every session opens
from its path (or a rewritten header over the same files) with the options of :func:`original_options`,
:func:`half_options` or :func:`~ortpa.parity.locate.twin_options`: no weight prepacking, a half model's casts of
its weights per use (docs/large_models.md).
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import numpy as np
import onnx

from ortpa.errors import ConversionError, InvalidModel, OrtpaError
from ortpa.model.file import LoadedModel
from ortpa.parity.greedy import GreedyRun, paged_greedy
from ortpa.parity.locate import lean_options, twin_options
from ortpa.parity.twin import float32_original, source_arithmetic
from ortpa.providers import CPU

__all__ = [
    "BLOCK_SIZE",
    "Deployment",
    "Reference",
    "declared_cache_dtype",
    "dense_twin_run",
    "half_options",
    "open_original",
    "original_options",
    "paged_session",
    "twin_reference",
]

BLOCK_SIZE = 16  # tokens per cache block of the verification's paged sessions


def original_options(half: bool, reuse: bool = False):
    """Session options of every run of an original or its twin (its own, its float32 twin's, the routing
    probe's): memory reuse off (as :func:`ortpa.parity.greedy.open_dense`, for the genai fp16 builds'
    value_info) unless ``reuse``; for a ``half`` (float16/bfloat16) original's twin, :func:`twin_options`: its casts
    of the weights run per use instead of being folded into float32 copies at creation (2x the weights;
    docs/large_models.md)."""
    options = twin_options() if half else lean_options()
    options.enable_mem_reuse = reuse
    return options


def _reusable(proto: onnx.ModelProto) -> bool:
    """Whether ONNX Runtime may reuse buffers running ``proto``: ortpa's own export (``ortpa export``, ``convert
    HF_DIR``), whose value_info is the exporter's. Without reuse every value of a run stays allocated: a 14-layer
    DeepSeek-V3 MoE's float32 twin ran 0.83 GB above its opening, 0.24 GB with it."""
    from ortpa.formats.detect import SourceFormat, detect_format

    try:
        return detect_format(proto) is SourceFormat.ORTPA_DYNAMO
    except OrtpaError:
        return False


def half_options():
    """Session options of a model that computes in a half type on CPU (a float16 original's conversion).

    ONNX Runtime's CPU kernels take most float16 ops through float32 casts it inserts
    (``InsertedPrecisionFreeCast_*``), of the weights too; :func:`twin_options` keeps it from folding those into
    float32 copies at creation (2x the weights). Its default execution order (a depth-first walk from the outputs
    that visits a node's inputs by node index) then runs every inserted weight cast, indexed after the model's
    own nodes, before the first layer: all the float32 copies alive at once (1.2 GB running a 0.9 GB float16
    model). The priority-based order (Kahn's, lowest index first) reaches an inserted cast only when nothing of
    the model's own is ready, just before the node that reads it, which frees the copy after its use: 0.4 GB
    (the memory pattern off: see below).
    The same kernels in another order: the same arithmetic. Not for the float32 twins: their own casts come
    first in the graph (:mod:`ortpa.parity.upcast`), so that order would run them all first; the default order
    runs each where it is read."""
    import onnxruntime as ort

    options = twin_options()
    options.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    # no memory pattern (lean_options): its block planned from a run's allocations also held far more than the run
    # needs in this order (a 14-layer DeepSeek-V3 MoE of 0.9 GB in float16: 1.19 GB above the session's opening,
    # 0.74 GB without)
    return options


def declared_cache_dtype(session) -> str:
    """The element type of a :class:`~ortpa.runtime.session.PagedSession`'s first cache input, as declared."""
    from ortpa.dtypes import dtype_name

    declared = {i.name: i for i in session.session.model.graph.input}
    return dtype_name(declared[session.aliases[0].input_name].type.tensor_type.elem_type)


def _cannot_run_on_cpu(what: str, where: str, exc: Exception) -> ConversionError:
    """The refusal when ONNX Runtime's CPU kernels cannot run ``what`` (the converted model or the original)."""
    return ConversionError(
        f"cannot verify the converted model on this machine: ONNX Runtime's CPU kernels do not run {what} "
        "(bfloat16 arithmetic has no CPU kernel); nothing was written. Pass --no-verify (verify=False) to write "
        "it unverified, then check it with `ortpa parity ORIGINAL CONVERTED --provider cuda` on a GPU",
        [(where, str(exc)[-300:])],
    )


def paged_session(model, blocks: int, options, block_size: int = BLOCK_SIZE):
    from ortpa.runtime.session import PagedSession

    try:
        return PagedSession(model, num_blocks=blocks, block_size=block_size, providers=[CPU], sess_options=options)
    except InvalidModel as exc:
        if "Could not find an implementation" not in str(exc):
            raise
        raise _cannot_run_on_cpu("it", "session (CPU)", exc) from None


@dataclass(frozen=True)
class Deployment:
    """Where the rule runs the deployed model: ``providers`` (None: ONNX Runtime's CPU with the verification's
    own session options, as ``convert`` runs it; else these, with ONNX Runtime's default options), a cache of
    ``blocks`` blocks of ``block_size`` tokens. ``ortpa parity --provider cuda`` runs it on the GPU; the float32
    twins always run on CPU."""

    blocks: int
    block_size: int = BLOCK_SIZE
    providers: tuple[str, ...] | None = None

    def open(self, model, options):
        """The deployed model's :class:`~ortpa.runtime.session.PagedSession` (``options``: the CPU session's)."""
        from ortpa.runtime.session import PagedSession

        if self.providers is None:
            return paged_session(model, self.blocks, options, self.block_size)
        return PagedSession(model, num_blocks=self.blocks, block_size=self.block_size, providers=list(self.providers))

    @property
    def provider_list(self) -> list[str]:
        return list(self.providers) if self.providers is not None else [CPU]


@dataclass
class Reference:
    """A half original's reference: its float32 twin ``model`` (:func:`~ortpa.parity.twin.float32_original`),
    whose own greedy run is the ``want`` handed to :func:`~ortpa.parity.verify.run_rule` with it; ``deployed``,
    the deployed model's run where it already is teacher-forced on ``want``'s tokens (None: ``run_rule`` runs
    it), of cache type ``cache_dtype``."""

    model: LoadedModel
    deployed: GreedyRun | None = None
    cache_dtype: str = ""


def twin_reference(
    original, converted, prompts, steps: int, blocks: int, deployment: Deployment | None = None
) -> tuple[GreedyRun, Reference]:
    """The reference of an original that computes in a half type: its float32 twin's greedy run, not its own.

    The half original on ONNX Runtime's CPU runs every weight through a float32 cast anyway, and the twin is that
    computation without the half roundings between ops: the float32 computation a float32 original's deployed
    model is judged against (docs/verification.md). The deployed model runs first, greedy on its own tokens; they
    draft the twin's run (:func:`dense_twin_run`: one forward per prompt where they are the twin's own tokens).
    Where they are, the deployed run was fed the reference's tokens: it is the teacher-forced run the rule judges,
    and :func:`~ortpa.parity.verify.run_rule` does not run it again. ``deployment``: where the deployed model
    runs (default: CPU, ``blocks`` blocks)."""
    deployment = deployment or Deployment(blocks)
    try:
        paged = deployment.open(converted, half_options())
        cache_dtype = declared_cache_dtype(paged)
        free = paged_greedy(paged, prompts, steps)
        del paged
        gc.collect()
        model = float32_original(original)
        want = dense_twin_run(model, prompts, steps, free.tokens, own=True)
    except Exception as first:
        # the original itself is never run here: where ONNX Runtime cannot even load it, say so (as a float32
        # original's verification does when it opens it), not what that made of its conversion or twin; with
        # what failed first, which may be another cause (memory)
        try:
            session, _ = open_original(original)
        except ConversionError as err:
            raise ConversionError(
                err.reason, [*err.failures, ("failed first", f"{type(first).__name__}: {str(first)[-300:]}")]
            ) from first
        del session
        raise
    fed = all(w[: steps - 1] == f[: steps - 1] for w, f in zip(want.tokens, free.tokens, strict=True))
    return want, Reference(model, free if fed else None, cache_dtype)


def open_original(original: str | os.PathLike):
    """The original's CPU session from its path (as :func:`ortpa.parity.greedy.open_dense`: memory reuse off for
    the genai fp16 builds' value_info), with :func:`original_options`; and its interface.
    :class:`~ortpa.errors.ConversionError` where ONNX Runtime cannot load it."""
    import onnxruntime as ort

    from ortpa.formats.detect import dense_interface
    from ortpa.model.file import read_model

    proto = read_model(original, load_external_data=False).proto
    options = original_options(source_arithmetic(proto) in ("float16", "bfloat16"))
    try:
        session = ort.InferenceSession(os.fspath(original), options, providers=[CPU])
    except Exception as exc:  # ONNX Runtime's own types (Fail, InvalidGraph...): a bfloat16 original, typically
        if not type(exc).__module__.startswith("onnxruntime"):
            raise
        if "bad_alloc" in str(exc):  # out of memory, not a missing kernel
            raise ConversionError(
                "cannot verify the converted model on this machine: ONNX Runtime ran out of memory opening the "
                "original; nothing was written. Pass --no-verify (verify=False) to write it unverified",
                [("original (CPU)", str(exc)[-300:])],
            ) from None
        raise _cannot_run_on_cpu("the original", "original (CPU)", exc) from None
    return session, dense_interface(proto)


def dense_twin_run(model: LoadedModel, prompts, steps: int, tokens, *, own: bool = False) -> GreedyRun:
    """The original's float32 twin (:func:`~ortpa.parity.twin.float32_original`) on each prompt alone, fed
    ``tokens`` (teacher-forced), or with ``own`` greedy on its own tokens, ``tokens`` a draft of them (the
    deployed model's). Every step's input known, one forward of the prompt and the fed tokens gives each step's
    logits (the rows at the prompt's last position and after): the same function as prefill-then-decodes in one
    run instead of ``steps`` (each run casts every weight once). ``own``: a row is the twin's own step exactly
    when every token fed before it is the twin's own choice, so past the first drafted token that is not, the
    run goes on one forward per step."""
    import time

    from ortpa.formats.detect import dense_interface
    from ortpa.parity.greedy import dense_forward
    from ortpa.runtime.session import InferenceSession

    session = InferenceSession(model, original_options(half=True, reuse=_reusable(model.proto)), providers=[CPU])
    interface = dense_interface(model.proto)
    start = time.perf_counter()
    chosen, logits, runs = [], [], 0
    for p, prompt in enumerate(prompts):
        mine: list[int] = []
        rows: list = []
        guess = [int(t) for t in tokens[p][: steps - 1]]
        while len(mine) < steps:
            out = dense_forward(session, [*prompt, *mine, *guess], interface=interface)[len(prompt) + len(mine) - 1 :]
            runs += 1
            for j, row in enumerate(out):
                mine.append(int(row.argmax()))
                rows.append(row)
                if len(mine) == steps or j == len(guess) or (own and mine[-1] != guess[j]):
                    break  # done, or the next row was fed a token that is not the twin's own
            guess = []  # past a wrong guess the draft says nothing: one step per forward
        chosen.append(mine)
        logits.append(np.stack(rows))
    del session
    gc.collect()
    return GreedyRun(chosen, logits, time.perf_counter() - start, runs)
