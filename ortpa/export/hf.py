"""Hugging Face / torch causal LMs -> dense ONNX with past/present KV (the optional ``export`` extra).

The exported graph is what :func:`ortpa.convert_file` consumes:

* inputs ``input_ids`` int64[batch, seq], ``attention_mask`` int64[batch, past + seq], ``position_ids``
  int64[batch, seq], and per layer ``past_key_values.{i}.key`` / ``.value``;
* outputs ``logits`` float[batch, seq, vocab] and per layer ``present.{i}.key`` / ``.value``.

For MLA models (DeepSeek-V3, GLM-4-MoE-Lite, ...) transformers 5.x caches the normalised latent as ``key``
(``[batch, 1, past, kv_lora_rank]``) and the roped shared key as ``value`` (``[batch, 1, past, qk_rope]``).

MoE experts export through transformers' ONNX lowering of ``grouped_mm`` (or ``batched_mm``), DeepSeek-V2's
complex RoPE through a real-valued equivalent: :mod:`ortpa.export.patches`. A failed export raises
:class:`ortpa.export.errors.ExportError`, one line naming the op or module and what to try.

No network: models are built from a config with seeded random weights, or loaded from a local directory
(safetensors, sharded or not; FP8 block-quantized through :mod:`ortpa.export.fp8`) in the dtype asked for, else
:func:`ortpa.export.checkpoint_dtype.default_export_dtype` (float16 for bfloat16 and FP8, else as stored).
Models whose weights pass :data:`EXTERNAL_DATA_THRESHOLD` are written with external data (``<name>.onnx.data``).
torch and transformers are imported lazily so that ``import ortpa`` never needs them.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "EXTERNAL_DATA_THRESHOLD",
    "ExportInfo",
    "build_model",
    "export_hf",
    "fixtures_main",
    "versions",
]

# protobuf cannot hold more than 2 GB; past this many bytes of weights the export keeps them in a side file
EXTERNAL_DATA_THRESHOLD = 1 << 30


class ExportInfo(dict):
    """What :func:`export_hf` did: versions, config summary, I/O names (a plain dict, JSON-serialisable)."""


def versions() -> dict[str, str]:
    """Versions of the libraries that shape an export (recorded next to every fixture)."""
    import onnx
    import onnxscript
    import torch
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "onnx": onnx.__version__,
        "onnxscript": onnxscript.__version__,
    }


def _load_config(config_or_model_dir: Any):
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(config_or_model_dir, PretrainedConfig):
        return config_or_model_dir
    if isinstance(config_or_model_dir, Mapping):
        cfg = dict(config_or_model_dir)
        model_type = cfg.pop("model_type")
        return AutoConfig.for_model(model_type, **cfg)
    path = Path(config_or_model_dir)
    if path.is_file():  # a config.json
        return _load_config(json.loads(path.read_text()))
    return AutoConfig.from_pretrained(str(path), local_files_only=True)


_DTYPES = ("float32", "float16", "bfloat16")


def _torch_dtype(dtype: str | None):
    import torch

    if dtype is None:
        return None
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
    return getattr(torch, dtype)


def build_model(
    config_or_model_dir: Any,
    *,
    random_weights: bool = True,
    seed: int = 0,
    attn_implementation="sdpa",
    dtype: str | None = None,
    scratch_dir: str | os.PathLike | None = None,
    progress: Callable[[str], None] | None = None,
):
    """A causal LM in eval mode: random (seeded) weights from a config, or local pretrained weights.

    ``dtype``: ``float32`` / ``float16`` / ``bfloat16``; default float32 for random weights and
    :func:`default_export_dtype` for pretrained ones (float16 for bfloat16 and FP8 checkpoints, else as stored).
    Pretrained weights are loaded once, straight into that dtype (no float32 copy next to a bf16 one); FP8
    block-quantized folders are dequantized by :mod:`ortpa.export.fp8` into a scratch folder under
    ``scratch_dir`` first. A float16 model whose weights overflow float16 is refused, naming the tensor.
    """
    import torch
    from transformers import AutoModelForCausalLM

    if random_weights:
        wanted = _torch_dtype(dtype)
        config = _load_config(config_or_model_dir)
        config._attn_implementation = attn_implementation
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
        # transformers initialises weights with std=initializer_range; tiny random models then produce nearly
        # uniform logits, which make greedy-token parity meaningless. Re-draw with a larger spread.
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
                elif p.ndim >= 2:
                    p.copy_(torch.randn(p.shape, generator=gen) / max(p.shape[-1], 1) ** 0.5)
        return model.to(wanted or torch.float32).eval()
    from ortpa.export.checkpoint_dtype import check_float16_range, default_export_dtype, stored_dtype
    from ortpa.export.fp8 import dequantized_copy, fp8_spec

    path = Path(config_or_model_dir)
    if path.is_file():  # a config.json inside the checkpoint folder
        path = path.parent
    stored = stored_dtype(path)
    dtype = default_export_dtype(stored, dtype)
    spec = fp8_spec(path)
    with contextlib.ExitStack() as stack:
        if spec is not None:
            path = stack.enter_context(dequantized_copy(path, spec, dtype, scratch_parent=scratch_dir, say=progress))
        model = AutoModelForCausalLM.from_pretrained(
            str(path), local_files_only=True, attn_implementation=attn_implementation, dtype=_torch_dtype(dtype)
        )
    if dtype == "float16" and stored != "float16":
        check_float16_range(model, str(config_or_model_dir), stored)
    return model.eval()


def _has_sliding_layers(config) -> bool:
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layer_types = getattr(text, "layer_types", None) or []
    return getattr(text, "sliding_window", None) is not None or any(t != "full_attention" for t in layer_types)


def _full_cache(cache_class, config):
    """A cache whose every layer keeps the whole past, so that ``present = Concat(past, new)`` on every layer.

    ``DynamicCache(config=...)`` gives sliding-window layers a cropped cache (``present`` keeps only the last
    ``sliding_window - 1`` tokens, a fixed size baked into the export); the window then lives in the attention
    mask only, which is what the paged conversion reads (``local_window_size``). Configs without sliding layers
    keep ``DynamicCache(config=...)`` unchanged.
    """
    return cache_class() if _has_sliding_layers(config) else cache_class(config=config)


def _cache_shapes(model, batch: int, past: int, *, fake: bool = False) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Per layer (key shape, value shape) of the cache, found by running one token through the model.

    ``fake``: the weights are placeholders (a checkpoint's skeleton), so the forward runs in fake tensors (shapes
    only, nothing read); the float16 check of the activations then falls to the conversion's verification, which
    runs the export on real prompts."""
    import torch
    from transformers import DynamicCache

    from ortpa.export.patches import export_patches

    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        # the cache's shapes do not depend on how MoE experts compute; batched_mm has fake kernels in every dtype
        with (
            _module_state_kept(model),
            torch.no_grad(),
            export_patches(model, "batched_mm"),
            FakeTensorMode(allow_non_fake_inputs=True),
        ):
            ids = torch.zeros((batch, 1), dtype=torch.long)
            out = model(input_ids=ids, use_cache=True, cache=DynamicCache(config=model.config))
            return _shapes_of(out, batch, past)
    ids = torch.zeros((batch, 1), dtype=torch.long)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True, cache=DynamicCache(config=model.config))
    if not bool(torch.isfinite(out.logits).all()):  # e.g. float16 activations past 65504
        from ortpa.errors import InvalidModel
        from ortpa.export.checkpoint_dtype import WIDER

        raise InvalidModel(
            model.name_or_path or model.config.model_type,
            f"a one-token forward in {model.dtype} gives non-finite logits (activations overflow it?); {WIDER}",
        )
    return _shapes_of(out, batch, past)


@contextlib.contextmanager
def _module_state_kept(model) -> Iterator[None]:
    """Modules' buffers and tensor attributes as they were before the block: a forward may cache tensors on its
    modules (LongRoPE's ``long_inv_freq``, a dynamic RoPE's ``inv_freq``), which in fake tensors would reach the
    trace as initializers without data."""
    import torch

    saved = []
    for module in model.modules():
        attrs = {k: v for k, v in vars(module).items() if isinstance(v, torch.Tensor)}
        saved.append((module, dict(module._buffers), attrs))
    try:
        yield
    finally:
        for module, buffers, attrs in saved:
            module._buffers.clear()
            module._buffers.update(buffers)
            for key in [k for k, v in vars(module).items() if isinstance(v, torch.Tensor) and k not in attrs]:
                delattr(module, key)
            for key, value in attrs.items():
                object.__setattr__(module, key, value)


def _shapes_of(out, batch: int, past: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    shapes = []
    for layer in out.cache.layers:
        k, v = layer.keys, layer.values
        shapes.append(((batch, *k.shape[1:2], past, k.shape[3]), (batch, *v.shape[1:2], past, v.shape[3])))
    return shapes


def export_hf(
    config_or_model_dir: Any,
    out_path: str | os.PathLike,
    *,
    random_weights: bool = True,
    opset: int = 18,
    attn_implementation: str = "sdpa",
    seed: int = 0,
    optimize: bool | None = None,
    experts: str | None = "grouped_mm",
    dtype: str | None = None,
    external_data: bool | None = None,
    progress: Callable[[str], None] | None = None,
    verbose: bool = False,
    written: Callable[[int, int], None] | None = None,
    layout: Callable[[str, bool], Path | None] | None = None,
    repeat_layers: bool | None = None,
    node_metadata: bool = True,
) -> ExportInfo:
    """Export a causal LM to dense ONNX with past/present KV; returns an :class:`ExportInfo`.

    ``config_or_model_dir``: a ``PretrainedConfig``, a dict with ``model_type``, a ``config.json`` path or a
    local model directory. The graph has symbolic ``batch``, ``seq`` and ``past`` dimensions.
    ``experts``: the MoE experts implementation to trace (:data:`ortpa.export.patches.EXPERTS_IMPLEMENTATIONS`).
    ``dtype``: see :func:`build_model`. ``optimize``: run torch.onnx's graph optimisation; default only for
    random weights: its constant folding stores a transposed copy of every Linear weight next to the model's own
    (two copies in memory), while unoptimised the initializers are the parameters themselves, under their names
    (``ortpa.convert`` optimises the graph on load anyway). ``external_data``: weights in ``<out>.data`` (default: past
    :data:`EXTERNAL_DATA_THRESHOLD`; a checkpoint's are always streamed there, and ``False`` reads them back into
    one inline file). ``config_or_model_dir`` may also be a ``torch.nn.Module``: traced with its weights, as they
    are in memory. ``written(done, total)``: the bytes of weights streamed so far. Raises
    :class:`ortpa.export.errors.ExportError` when torch.onnx fails.
    ``progress`` receives one line per stage; torch's and transformers' warnings and bars show only with
    ``verbose``. ``layout(parameter name, read transposed)``: for a checkpoint, the data file (in ``out_path``'s
    folder) each parameter is streamed into instead of ``<out>.data`` (:data:`ortpa.export.streamed.Layout`; a
    stage's own file when the export writes pipeline stages); the model always has external data then.
    ``repeat_layers``: trace the first two layers of each kind and write the others as their copies
    (:mod:`ortpa.export.repeat`; the full trace whenever the copies do not show the layers to be repeats);
    default on for a checkpoint folder, never with ``optimize``. ``node_metadata``: keep torch's per-node debugging
    metadata (the Python stack trace, module class hierarchy and FX node of each ONNX node: most of the graph's
    bytes); ``ortpa convert`` drops it from the dense model it rewrites at once (read and written twice otherwise).
    """
    say = progress or (lambda message: None)
    with contextlib.ExitStack() as stack:
        if not verbose:
            stack.enter_context(_quiet())
        return _export(
            config_or_model_dir,
            Path(out_path),
            random_weights=random_weights,
            opset=opset,
            attn_implementation=attn_implementation,
            seed=seed,
            optimize=random_weights and not _is_module(config_or_model_dir) if optimize is None else optimize,
            experts=experts,
            dtype=dtype,
            external_data=external_data,
            say=say,
            written=written,
            layout=layout,
            repeat_layers=repeat_layers,
            node_metadata=node_metadata,
        )


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence the libraries' warnings, info logs and progress bars for the length of an export.

    ``logging.disable`` rather than logger levels: torch.onnx's submodules log through loggers with levels of
    their own (e.g. "torchvision is not installed"), which a parent's level does not reach.
    """
    import logging
    import warnings

    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            logging.disable(previous)
            if bars:
                hf_logging.enable_progress_bar()


def _export(
    config_or_model_dir: Any,
    out_path: Path,
    *,
    random_weights: bool,
    opset: int,
    attn_implementation: str,
    seed: int,
    optimize: bool,
    experts: str | None,
    dtype: str | None,
    external_data: bool | None,
    say: Callable[[str], None],
    written: Callable[[int, int], None] | None,
    layout: Callable[[str, bool], Path | None] | None = None,
    repeat_layers: bool | None = None,
    node_metadata: bool = True,
) -> ExportInfo:
    from ortpa.errors import InvalidModel
    from ortpa.export.checkpoint_dtype import default_export_dtype, stored_dtype
    from ortpa.export.fp8 import fp8_spec
    from ortpa.export.rope_support import refuse_unrepresentable_rope
    from ortpa.export.streamed import skeleton

    in_memory = _is_module(config_or_model_dir)
    folder = None if random_weights or in_memory else _folder(config_or_model_dir)
    placeholders = None
    try:
        # before any weight is read: a RoPE no paged cache can hold is refused up front
        config = config_or_model_dir.config if in_memory else _load_config(config_or_model_dir)
        refuse_unrepresentable_rope(config, str(config_or_model_dir))
        if in_memory:
            model = config_or_model_dir.eval()
        elif folder is not None:
            stored = stored_dtype(folder)
            chosen = default_export_dtype(stored, dtype)
            why = "" if dtype is not None or chosen == stored else " (runs on CPU and CUDA; see --export-dtype)"
            say(f"reading the architecture of {config_or_model_dir}: stored {stored}, exporting in {chosen}{why}")
            if optimize:
                raise ValueError("optimize=True needs the weights in the trace: a checkpoint's are streamed after it")
            model, placeholders = skeleton(folder, chosen, attn_implementation, fp8_spec(folder))
        else:
            say(f"loading config from {config_or_model_dir}")
            model = build_model(
                config_or_model_dir,
                random_weights=True,
                seed=seed,
                attn_implementation=attn_implementation,
                dtype=dtype,
            )
    except InvalidModel:
        raise
    except (OSError, ValueError, KeyError, TypeError) as exc:  # transformers' loaders: missing/bad files, configs
        first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
        what = "config" if random_weights else "Hugging Face checkpoint"
        raise InvalidModel(
            str(config_or_model_dir), f"could not load it as a {what}: {type(exc).__name__}: {first}"
        ) from exc
    out_path.parent.mkdir(parents=True, exist_ok=True)
    trace_args = (model, str(config_or_model_dir), opset, optimize, experts, seed, say, placeholders)
    repeat = placeholders is not None if repeat_layers is None else repeat_layers
    traced = _trace_repeating(*trace_args) if repeat and not optimize else _trace(*trace_args)
    if not node_metadata:
        for node in traced.program.model.graph.all_nodes():
            for key in _DEBUG_METADATA:
                node.metadata_props.pop(key, None)
    if layout is not None and placeholders is None:
        raise ValueError("layout= places a checkpoint's streamed weights: expected a checkpoint folder")
    if placeholders is None:
        weight_bytes = _unique_bytes(model)
        if external_data is None:
            external_data = weight_bytes > EXTERNAL_DATA_THRESHOLD
        say(f"writing {out_path}" + (f" (weights in {out_path.name}.data)" if external_data else ""))
        traced.program.save(str(out_path), external_data=external_data)
    else:
        assert folder is not None
        external_data = _stream_weights(
            traced.program.model,
            folder,
            out_path,
            placeholders,
            chosen,
            stored,
            attn_implementation,
            external_data,
            say,
            written,
            layout,
        )
    cfg = model.config
    return ExportInfo(
        path=str(out_path),
        model_type=cfg.model_type,
        opset=opset,
        attn_implementation=attn_implementation,
        dtype=str(traced.dtype).removeprefix("torch."),
        external_data=external_data,
        num_hidden_layers=cfg.num_hidden_layers,
        input_names=traced.input_names,
        output_names=traced.output_names,
        versions=versions(),
        **traced.applied,
    )


def _is_module(obj: Any) -> bool:
    try:
        import torch
    except ImportError:
        return False
    return isinstance(obj, torch.nn.Module)


def _folder(config_or_model_dir: Any) -> Path:
    if isinstance(config_or_model_dir, Mapping) or not isinstance(config_or_model_dir, (str, os.PathLike)):
        raise ValueError("random_weights=False needs a local checkpoint folder (or its config.json)")
    path = Path(config_or_model_dir)
    return path.parent if path.is_file() else path


def _unique_bytes(model) -> int:
    """The model's weights in bytes, a tensor shared by two names (tied embeddings) once."""
    seen: dict[int, int] = {}
    for t in model.state_dict().values():
        seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


def _stream_weights(
    irm,
    folder: Path,
    out_path: Path,
    placeholders,
    dtype: str,
    stored: str,
    attn_implementation: str,
    external_data: bool | None,
    say: Callable[[str], None],
    written: Callable[[int, int], None] | None,
    layout: Callable[[str, bool], Path | None] | None = None,
) -> bool:
    """The traced graph's weights streamed from ``folder`` into ``<out>.data`` (:mod:`ortpa.export.streamed`; each
    into the file ``layout`` names, if given), then the graph written; ``external_data=False`` reads them back into
    one inline file. Returns whether external."""
    import onnx_ir as ir

    from ortpa.export.fp8 import fp8_spec
    from ortpa.export.streamed import destinations, stream

    data_path = out_path.with_name(out_path.name + ".data")
    plan = destinations(irm, placeholders, data_path, layout)
    names = ", ".join(sorted(p.name for p in plan.files)) or data_path.name
    say(f"streaming {plan.nbytes / 1e6:.1f} MB of weights from {folder} into {names}")
    float16_from = stored if dtype == "float16" and stored != "float16" else None
    stream(
        folder,
        plan,
        dtype=dtype,
        attn_implementation=attn_implementation,
        fp8=fp8_spec(folder),
        float16_from=float16_from,
        written=written,
    )
    say(f"writing {out_path}")
    if external_data is False and layout is None:
        ir.save(ir.external_data.load_to_model(irm), out_path)
        data_path.unlink()
        return False
    ir.save(irm, out_path)
    return True


class _Traced:
    """What :func:`_trace` made: the ONNX program and the names and dtype it was traced with."""

    def __init__(self, program, dtype, input_names, output_names, applied) -> None:
        self.program, self.dtype, self.input_names, self.output_names = program, dtype, input_names, output_names
        self.applied = applied


def _trace_repeating(model, label, opset, optimize, experts, seed, say, placeholders) -> _Traced:
    """:func:`_trace` of the layers :func:`ortpa.export.repeat.plan` picks, expanded to every layer; the full trace
    when the plan traces every layer or the traced copies do not show the others to be repeats."""
    from ortpa.export import repeat

    args = (model, label, opset, optimize, experts, seed, say, placeholders)
    n_layers = model.config.num_hidden_layers
    try:
        layer_plan = repeat.plan(model)
    except repeat.NotRepeatable as exc:
        say(f"tracing every layer: {exc}")
        return _trace(*args)
    if layer_plan is None:
        return _trace(*args)
    with repeat.reduced(model, layer_plan):
        traced = _trace(*args, of_layers=n_layers)
    layers = model.get_submodule(layer_plan.path)

    def tensor_of(index: int, name: str):
        layer = layers[index]
        try:
            return layer.get_parameter(name)
        except AttributeError:
            return layer.get_buffer(name)

    try:
        repeat.expand(traced.program.model, layer_plan, tensor_of, _past_name, _present_name)
    except repeat.NotRepeatable as exc:
        say(f"tracing all {n_layers} layers: the traced ones do not stand for the others ({exc})")
        return _trace(*args)
    traced.input_names = traced.input_names[:3] + [_past_name(i, r) for i in range(n_layers) for r in _ROLES]
    traced.output_names = traced.output_names[:1] + [_present_name(i, r) for i in range(n_layers) for r in _ROLES]
    return traced


_ROLES = ("key", "value")


# torch.onnx's per-node debugging metadata (``node_metadata=False`` drops it); the name scopes stay
_DEBUG_METADATA = ("pkg.torch.onnx.stack_trace", "pkg.torch.onnx.class_hierarchy", "pkg.torch.onnx.fx_node")


def _past_name(layer: int, role: str) -> str:
    return f"past_key_values.{layer}.{role}"


def _present_name(layer: int, role: str) -> str:
    return f"present.{layer}.{role}"


def _trace(
    model, label: str, opset: int, optimize: bool, experts: str | None, seed: int, say, placeholders,
    of_layers: int | None = None,
) -> _Traced:  # fmt: skip
    """``model`` traced by ``torch.onnx.export`` (dynamo) with flat past/present tensors and symbolic dims.

    With ``placeholders`` (a checkpoint's skeleton) nothing reads a weight: the cache shapes come from a forward
    in fake tensors and the tracer sees shapes only."""
    import torch
    from transformers import DynamicCache

    from ortpa.export.decompose import lean_decomposition
    from ortpa.export.errors import ExportError, summarize
    from ortpa.export.patches import export_patches, has_experts, translation_table

    model_dtype = next(model.parameters()).dtype
    n_layers = model.config.num_hidden_layers
    batch, seq, past = 2, 3, 4  # distinct sizes, all > 1, so that no dimension is specialised away
    shapes = _cache_shapes(model, batch, past, fake=placeholders is not None)

    class _Wrapper(torch.nn.Module):
        """Flat past tensors in, flat present tensors out: no pytree registration of Cache classes needed."""

        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask, position_ids, *past):
            cache = _full_cache(DynamicCache, self.inner.config)
            for i in range(n_layers):
                cache.update(past[2 * i], past[2 * i + 1], i)
            out = self.inner(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=True,
            )
            presents = []
            for layer in out.cache.layers:
                presents += [layer.keys, layer.values]
            return (out.logits, *presents)

    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    args = [
        torch.randint(0, vocab, (batch, seq), generator=gen),
        torch.ones((batch, past + seq), dtype=torch.long),
        (torch.arange(seq) + past).unsqueeze(0).expand(batch, seq).contiguous(),
    ]
    for k_shape, v_shape in shapes:
        args += [
            torch.randn(k_shape, generator=gen).to(model_dtype),
            torch.randn(v_shape, generator=gen).to(model_dtype),
        ]

    b, s, p = torch.export.Dim("batch"), torch.export.Dim("seq"), torch.export.Dim("past")
    total = torch.export.Dim("total")  # past + seq; torch cannot express a sum of two dims
    dynamic_shapes = (
        {0: b, 1: s},
        {0: b, 1: total},
        {0: b, 1: s},
        tuple({0: b, 2: p} for _ in range(2 * n_layers)),
    )
    input_names = ["input_ids", "attention_mask", "position_ids"]
    output_names = ["logits"]
    for i in range(n_layers):
        input_names += [_past_name(i, r) for r in _ROLES]
        output_names += [_present_name(i, r) for r in _ROLES]

    weight_bytes = placeholders.nbytes if placeholders is not None else _unique_bytes(model)
    what = "weights (not read: streamed after the trace)" if placeholders is not None else "weights"
    layers = f"{n_layers} layers" if of_layers is None else f"{n_layers} of {of_layers} layers (the others repeat them)"
    say(f"tracing {model.config.model_type}: {layers}, {weight_bytes / 1e6:.1f} MB of {what}, {model_dtype}")
    with torch.no_grad(), export_patches(model, experts) as applied, lean_decomposition() as decomposition:
        try:
            program = torch.onnx.export(
                _Wrapper(model).eval(),
                tuple(args),
                dynamo=True,
                dynamic_shapes=dynamic_shapes,
                input_names=input_names,
                output_names=output_names,
                opset_version=opset,
                optimize=optimize,
                custom_translation_table=translation_table() if has_experts(model) else {},
                verbose=False,
            )
        except Exception as exc:
            raise ExportError(label, summarize(exc)) from exc
    applied.update(decomposition)
    return _Traced(program, model_dtype, input_names, output_names, applied)


def fixtures_main(
    fixtures: Mapping[str, tuple[dict, dict]], description: str, default_out: Path, argv: list[str] | None = None
) -> int:
    """The fixture scripts' command line: export each ``name -> (config, export options)`` to ``--out``.

    Writes ``<name>.onnx`` and ``<name>.json`` (export info plus the config), prints the versions used and one
    line per fixture; ``--only NAME ...`` limits the run. A failed export is reported and the rest still run;
    returns 1 if any failed.
    """
    import argparse
    import time

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", default=str(default_out))
    ap.add_argument("--only", nargs="*", default=None)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(json.dumps(versions()))
    failed = []
    for name, (cfg, opts) in fixtures.items():
        if args.only and name not in args.only:
            continue
        t = time.time()
        try:
            info = export_hf(cfg, out / f"{name}.onnx", **opts)
        except Exception as exc:  # report every variant, keep going
            failed.append(name)
            print(f"FAIL {name}: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
            continue
        info["config"] = cfg
        (out / f"{name}.json").write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")
        size = (out / f"{name}.onnx").stat().st_size
        print(f"ok   {name}: {size / 1e6:.2f} MB, {time.time() - t:.1f} s")
    return 1 if failed else 0
