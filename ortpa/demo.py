"""``ortpa demo``: the whole pipeline on a built-in model, no downloads, in a few seconds on a laptop CPU.

1. build a small DeepSeek-style dense MLA model (:mod:`ortpa.testing.dense_mla`, random seeded weights) and save it;
2. :func:`ortpa.convert_file` it to PagedAttention LATENT (progress per layer, verified against the original);
3. validate every PagedAttention node against ONNX Runtime's rules for the CUDA kernel;
4. greedy-generate for four prompts of different lengths with :class:`~ortpa.runtime.engine.Engine`
   (continuous batching) on the best provider present: CUDA's native kernel where a GPU is, else ortpa's native
   CPU kernel (the portable CPU path where it is not built);
5. check parity with the dense original run by ONNX Runtime on CPU. The engine returns tokens only, so a
   step-by-step greedy loop on the same paged model and provider (:func:`ortpa.parity.greedy.paged_greedy`:
   one packed prefill, then packed decodes) records each step's logits; the dense model is teacher-forced on
   that loop's tokens so every step is comparable. Checked with the precision half of the one verification rule
   (:mod:`ortpa.parity.rule`): next-token KL within the float16 bound, the same greedy token as the dense model
   at every step, and the engine's tokens equal to the loop's.

A token may differ only at a *near tie* (:mod:`ortpa.tolerances`' tie rule: the dense gap between the two
tokens within twice the float16 logit tolerance, where either pick is correct within the precision of the paged
model's attention), and at most :func:`ortpa.tolerances.max_tie_flips` of the checked tokens. Such steps are
counted and reported, never hidden; any other difference makes the summary not ``ok``.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from ortpa.conversion import convert_file
from ortpa.errors import InvalidParameter
from ortpa.ops.validate import validate_model
from ortpa.parity.greedy import GreedyRun, dense_greedy, paged_greedy
from ortpa.parity.rule import judge_precision
from ortpa.providers import CPU, providers_for
from ortpa.runtime.device import best_providers
from ortpa.runtime.engine import Engine, SamplingParams
from ortpa.runtime.session import PagedSession
from ortpa.testing.dense_mla import DenseMlaConfig, build_dense_mla
from ortpa.tolerances import max_tie_flips, precision_logit_bound, precision_ties

__all__ = ["DEMO_CONFIG", "DEMO_PROMPT_LENGTHS", "DemoSummary", "run_demo"]

# Small enough for a 2-core CPU, wide enough that the latent cache's advantage shows (8 heads).
# The seed is one whose greedy choices are far from ties (top-2 gap > 10x the float16 parity error).
DEMO_CONFIG = DenseMlaConfig(
    hidden=128, layers=4, heads=8, q_lora_rank=96, kv_lora_rank=64, qk_nope=32, qk_rope=16, v_head=32,
    vocab=512, intermediate=256, seed=3,
)  # fmt: skip
DEMO_PROMPT_LENGTHS = (3, 7, 12, 20)
DEMO_NEW_TOKENS = 8  # one prefill + 7 decode steps
BLOCK_SIZE = 16
# The precision rule of the one verification rule (ortpa.parity.rule) for the op's float16: ties within twice
# the float16 logit bound, KL within its square / 2; the structure was proven by convert's float32 twin.
PARITY_RTOL, PARITY_ATOL = 0.0, precision_logit_bound("float16")
_TIES = precision_ties("float16")


@dataclass
class DemoSummary:
    """What the demo wrote, converted, measured and checked. ``ok`` is False when parity or validation failed."""

    ok: bool
    provider: str
    paged_attention: str  # what ran the PagedAttention nodes: native-cpu, cuda, portable (InferenceSession)
    dense_model: str
    paged_model: str
    dense_model_bytes: int
    paged_model_bytes: int
    layers: int
    paged_attention_nodes: int
    dense_nodes: int
    paged_nodes: int
    kv_bytes_per_token_dense: int  # per layer, the dense export's own cache (latent + k_pe, float32)
    kv_bytes_per_token_paged: int  # per layer, the paged LATENT cache (float16)
    kv_bytes_per_token_mha: int  # per layer, per-head K and V as an un-absorbed MHA cache would hold (float16)
    validation_ok: bool
    validation_backend: str
    prompt_lengths: list[int]
    new_tokens: int
    max_abs_error: float
    max_abs_error_per_step: list[float]
    tolerance: tuple[float, float]  # (rtol, atol)
    tokens_identical: bool  # paged greedy tokens == dense greedy tokens, every prompt and step
    engine_tokens_identical: bool  # Engine.generate's tokens == the step-by-step paged loop's
    token_mismatches: int  # steps whose tokens differ where the dense model has no tie
    near_ties: int  # steps whose tokens differ at a tie of the dense model (ortpa.tolerances.TieBound)
    min_top2_gap: float
    tokens_per_second: float  # Engine.generate: new tokens / its wall time (prefill included)
    dense_tokens_per_second: float
    seconds: dict[str, float] = field(default_factory=dict)
    outputs: list[list[int]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def kv_bytes_per_token_dense_total(self) -> int:
        return self.kv_bytes_per_token_dense * self.layers

    @property
    def kv_bytes_per_token_paged_total(self) -> int:
        return self.kv_bytes_per_token_paged * self.layers

    @property
    def kv_bytes_per_token_mha_total(self) -> int:
        return self.kv_bytes_per_token_mha * self.layers

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["tolerance"] = list(self.tolerance)
        data["kv_bytes_per_token_dense_total"] = self.kv_bytes_per_token_dense_total
        data["kv_bytes_per_token_paged_total"] = self.kv_bytes_per_token_paged_total
        data["kv_bytes_per_token_mha_total"] = self.kv_bytes_per_token_mha_total
        return data

    def format(self) -> str:
        mib = 1024 * 1024
        per_step = ", ".join(f"{e:.1e}" for e in self.max_abs_error_per_step)
        lines = [
            f"ortpa demo: {'OK' if self.ok else 'FAILED'}",
            f"  dense model   {self.dense_model}  ({self.dense_model_bytes / mib:.2f} MiB, {self.dense_nodes} nodes)",
            f"  paged model   {self.paged_model}  ({self.paged_model_bytes / mib:.2f} MiB, {self.paged_nodes} nodes)",
            f"  converted     {self.paged_attention_nodes} of {self.layers} layers to PagedAttention (LATENT); "
            f"validation for {self.validation_backend}: {'ok' if self.validation_ok else 'FAILED'}",
            f"  KV bytes/token  per layer / total ({self.layers} layers):",
            _kv_line("dense export (latent+k_pe, fp32)", self.kv_bytes_per_token_dense, self.layers),
            _kv_line("paged LATENT (fp16)", self.kv_bytes_per_token_paged, self.layers),
            _kv_line("un-absorbed MHA K+V (fp16)", self.kv_bytes_per_token_mha, self.layers)
            + f"  ({self.kv_bytes_per_token_mha / self.kv_bytes_per_token_paged:.0f}x the LATENT row)",
            f"  generation    {len(self.prompt_lengths)} prompts (lengths {self.prompt_lengths}), "
            f"{self.new_tokens} new tokens each, batched on {self.provider} (PagedAttention: {self.paged_attention})",
            f"  parity        max |logit diff| {self.max_abs_error:.2e} (per step: {per_step}); "
            f"tolerance rtol {self.tolerance[0]:g}, atol {self.tolerance[1]:g}",
            f"                greedy tokens {'identical' if self.tokens_identical else 'DIFFER'}"
            f" (mismatches {self.token_mismatches}, near ties {self.near_ties}, min top-2 gap {self.min_top2_gap:.3f});"
            f" engine tokens {'identical' if self.engine_tokens_identical else 'DIFFER'}",
            f"  speed         engine {self.tokens_per_second:.0f} tok/s, dense (CPU, one prompt at a time) "
            f"{self.dense_tokens_per_second:.0f} tok/s",
            "  time          " + ", ".join(f"{k} {v:.2f}s" for k, v in self.seconds.items()),
        ]
        lines += [f"  FAILURE: {f}" for f in self.failures]
        return "\n".join(lines)


def _kv_line(what: str, per_layer: int, layers: int) -> str:
    return f"    {what:<34}{per_layer:>6} / {per_layer * layers}"


def _provider(provider: str | None) -> str:
    if provider is None:
        return best_providers()[0]
    name = providers_for(provider)[0]
    if name not in ort.get_available_providers():
        available = ort.get_available_providers()
        raise InvalidParameter("ortpa demo", "provider", f"an available provider (one of {available})", provider)
    return name


def _kv_bytes(model: onnx.ModelProto, heads_axis: int) -> int:
    """Bytes one token adds to layer 0's caches: heads x width x itemsize over ``past_key_values.0.*``.

    ``heads_axis`` is 1 for the dense ``[batch, heads, past, width]`` caches, 2 for the paged
    ``[num_blocks, block_size, heads, width]`` ones.
    """
    total = 0
    for vi in model.graph.input:
        if vi.name.startswith("past_key_values.0."):
            t = vi.type.tensor_type
            dims = [d.dim_value for d in t.shape.dim]
            total += dims[heads_axis] * dims[-1] * onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).itemsize
    return total


def _parity(paged: GreedyRun, dense: GreedyRun) -> tuple[list[float], int, int, float, list[str]]:
    """(max error per step, real mismatches, near ties, min top-2 gap, failures)."""
    steps = max(len(t) for t in paged.tokens)
    per_step = [0.0] * steps
    mismatches = ties = checked = 0
    min_gap = float("inf")
    failures = []
    for p, (pl, dl) in enumerate(zip(paged.logits, dense.logits, strict=True)):
        for s in range(len(pl)):
            err = np.abs(pl[s] - dl[s])
            per_step[s] = max(per_step[s], float(err.max()))
            top2 = np.sort(dl[s])[-2:]
            gap = float(top2[1] - top2[0])
            min_gap = min(min_gap, gap)
            checked += 1
            verdict = _TIES.classify(dl[s], paged.tokens[p][s])
            if verdict == "tie":
                ties += 1
            elif verdict == "mismatch":
                mismatches += 1
                failures.append(f"prompt {p}, step {s}: paged token {paged.tokens[p][s]}, dense {dense.tokens[p][s]}")
    if ties > max_tie_flips(checked):
        failures.append(f"{ties} near ties in {checked} tokens (at most {max_tie_flips(checked)})")
    precision = judge_precision(dense, paged, "float16")
    if precision.kl_max > precision.kl_bound:
        failures.append(f"next-token KL {precision.kl_max:.2e} above the float16 bound {precision.kl_bound:.2e}")
    return per_step, mismatches, ties, min_gap, failures


def run_demo(
    out_dir: str | os.PathLike | None = None,
    *,
    provider: str | None = None,
    quiet: bool = False,
    progress: Callable[[str], None] | None = print,
) -> DemoSummary:
    """Build, convert, validate, generate and check parity; write the two models to ``out_dir``.

    ``out_dir`` defaults to a new temporary directory (kept, its path is in the summary). ``provider``: None
    for the best present (CUDA where a GPU is, else CPU), or ``"cpu"`` / ``"cuda"`` / a provider name.
    ``progress`` receives each step's message (None: silent); unless ``quiet``, it also receives the final
    summary (``summary.format()``), so the default prints everything and ``quiet=True`` leaves the summary to
    the caller. Returns the summary; parity or validation failures make ``summary.ok`` False (the CLI exits 1),
    errors of ortpa itself are raised.
    """
    say: Callable[[str], None] = (lambda _msg: None) if progress is None else progress
    chosen = _provider(provider)
    out = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="ortpa-demo-"))
    out.mkdir(parents=True, exist_ok=True)
    dense_path, paged_path = out / "dense_mla.onnx", out / "paged_mla.onnx"
    seconds: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        seconds[name] = now - clock
        clock = now

    c = DEMO_CONFIG
    say(f"building a dense DeepSeek-style MLA model: {c.layers} layers, {c.heads} heads, hidden {c.hidden}, "
        f"kv_lora_rank {c.kv_lora_rank}, qk_rope {c.qk_rope}, vocab {c.vocab}")  # fmt: skip
    dense = build_dense_mla(c)
    onnx.save(dense, str(dense_path))
    lap("build")
    say(f"converting {dense_path.name} -> {paged_path.name}")
    conversion = convert_file(dense_path, paged_path, progress=lambda event: say(f"  convert: {event}"))
    paged = conversion.model  # sessions open it from its path
    lap("convert")
    say("validating PagedAttention nodes for the cuda backend")
    report = validate_model(paged, backend="cuda")
    lap("validate")

    rng = np.random.default_rng(c.seed)
    prompts = [[int(t) for t in rng.integers(0, c.vocab, n)] for n in DEMO_PROMPT_LENGTHS]
    say(f"generating {DEMO_NEW_TOKENS} tokens for {len(prompts)} prompts on {chosen} (Engine, continuous batching)")
    blocks = len(prompts) * -(-(max(DEMO_PROMPT_LENGTHS) + DEMO_NEW_TOKENS) // BLOCK_SIZE)
    providers = providers_for(chosen)
    engine = Engine(paged, num_blocks=blocks, block_size=BLOCK_SIZE, providers=providers)
    lap("session")
    start = time.perf_counter()
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=DEMO_NEW_TOKENS))
    engine_seconds = time.perf_counter() - start
    lap("generate")
    say("recording per-step logits (paged, step by step) and running the dense model on CPU for parity")
    session = PagedSession(paged, num_blocks=blocks, block_size=BLOCK_SIZE, providers=providers)
    run = paged_greedy(session, prompts, DEMO_NEW_TOKENS)
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    dense_sess = ort.InferenceSession(str(dense_path), opts, providers=[CPU])
    ref = dense_greedy(dense_sess, prompts, DEMO_NEW_TOKENS, follow=run.tokens)
    lap("parity")

    per_step, mismatches, ties, min_gap, failures = _parity(run, ref)
    if outputs != run.tokens:
        failures.append(f"Engine.generate tokens {outputs} differ from the step-by-step paged run's {run.tokens}")
    if not report.ok:
        failures.insert(0, "validation failed:\n" + report.format())
    n_paged = conversion.paged_attention_nodes
    paged_graph = onnx.load(str(paged), load_external_data=False)  # declared shapes: the figures below
    if n_paged != c.layers:
        failures.append(f"{n_paged} PagedAttention nodes for {c.layers} layers")
    H, P, R, V = c.heads, c.qk_nope, c.qk_rope, c.v_head
    summary = DemoSummary(
        ok=not failures,
        provider=chosen,
        paged_attention=", ".join(sorted(set(engine.session.session.implementations.values()))),
        dense_model=str(dense_path),
        paged_model=str(paged_path),
        dense_model_bytes=dense_path.stat().st_size,
        paged_model_bytes=paged_path.stat().st_size,
        layers=c.layers,
        paged_attention_nodes=n_paged,
        dense_nodes=len(dense.graph.node),
        paged_nodes=len(paged_graph.graph.node),
        kv_bytes_per_token_dense=_kv_bytes(dense, heads_axis=1),
        kv_bytes_per_token_paged=_kv_bytes(paged_graph, heads_axis=2),
        kv_bytes_per_token_mha=H * (P + R + V) * 2,
        validation_ok=report.ok,
        validation_backend="cuda",
        prompt_lengths=list(DEMO_PROMPT_LENGTHS),
        new_tokens=DEMO_NEW_TOKENS,
        max_abs_error=max(per_step),
        max_abs_error_per_step=per_step,
        tolerance=(PARITY_RTOL, PARITY_ATOL),
        tokens_identical=run.tokens == ref.tokens,
        engine_tokens_identical=outputs == run.tokens,
        token_mismatches=mismatches,
        near_ties=ties,
        min_top2_gap=min_gap,
        tokens_per_second=sum(len(t) for t in outputs) / engine_seconds,
        dense_tokens_per_second=ref.new_tokens / ref.seconds,
        seconds={**seconds, "total": sum(seconds.values())},
        outputs=outputs,
        failures=failures,
    )
    if not quiet:
        say(summary.format())
    return summary
