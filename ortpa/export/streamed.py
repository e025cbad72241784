"""A checkpoint's weights, from its safetensors shards to the export's external data one tensor at a time.

The export of a checkpoint never holds its model: the architecture is traced over placeholders and the weights are
streamed afterwards. Both steps go through transformers' own loader (``from_pretrained``), so that every key
conversion (fused MoE experts, renamed keys), dtype plan (``_keep_in_fp32_modules``) and weight tie is exactly the
one ``from_pretrained`` applies; ortpa only intercepts where a tensor is read and where a parameter is set.

1. :func:`skeleton`: the loader runs with every checkpoint tensor it reads standing as a meta tensor (nothing read),
   and every parameter it sets is a :class:`Placeholders` tensor: CPU address space from an anonymous ``mmap`` that
   nothing writes, so it costs no memory. The tracer reads shapes and dtypes, never data.
2. :func:`stream`: after the trace, the loader runs again on the real tensors (FP8 weights dequantized one at a
   time, :mod:`ortpa.export.fp8`); each parameter it produces is written at once to the data file, in every layout
   the graph reads it in (:class:`Destination`: a weight the graph only reads through a ``Transpose`` is written
   transposed, so neither the rewriter's optimizer nor ONNX Runtime folds it in memory later), then dropped.

Peak memory: one parameter as the loader builds it (for fused MoE experts, one layer's stacked experts) and its
transposed copy, plus the loader's constant overhead. After each parameter the allocator's freed pages go back to the
system (:func:`release_freed`): glibc serves tensors under its dynamic mmap threshold (up to 32 MB) from the heap, which
the loader's small long-lived allocations fragment, so without it every freed parameter left pages behind (a 2 GB
checkpoint's streaming grew by ~1 GB, released only when the loader returned). Which ONNX initializer holds which
parameter is decided by identity (the placeholder's address), never by name; an initializer the tracer derived from a
placeholder in any other way is refused (:func:`destinations`)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import mmap
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ortpa.errors import InvalidModel

__all__ = [
    "Destination",
    "Layout",
    "Placeholders",
    "StreamPlan",
    "destinations",
    "release_freed",
    "skeleton",
    "stream",
]

# safetensors' dtype codes -> torch dtype names (the loader's meta tensors need the stored dtype)
_ST_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}
_ALIGN = 4096  # every tensor starts on a page: ONNX Runtime memory-maps aligned external data
_MIN_EXTERNAL_BYTES = 1024  # smaller tensors the tracer produced (shapes, scalars) stay in the graph


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``; None on a C library without it (musl, macOS, Windows)."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_freed() -> bool:
    """Return the C allocator's free pages to the system (glibc: ``malloc_trim(0)``, which also releases whole free
    pages inside the heap, not only at its top). Whether it could be asked (False: not glibc)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


class Placeholders:
    """CPU tensors that reserve address space and never memory: anonymous ``mmap``s nothing writes to."""

    def __init__(self) -> None:
        self.by_address: dict[int, tuple[str, Any]] = {}  # data_ptr -> (parameter name, tensor)
        self._maps: list[mmap.mmap] = []

    def make(self, name: str, like: Any):
        import torch

        nbytes = like.numel() * like.element_size()
        if nbytes == 0:
            tensor = torch.empty(like.shape, dtype=like.dtype)
        else:
            region = mmap.mmap(-1, nbytes)
            self._maps.append(region)
            tensor = torch.frombuffer(region, dtype=like.dtype).view(like.shape)
            self.by_address[tensor.data_ptr()] = (name, tensor)
        return tensor

    def name_of(self, tensor: Any) -> str | None:
        """The parameter ``tensor`` is the placeholder of; None for a tensor that is no placeholder. A view into a
        placeholder that is not the placeholder itself (a slice, a reshape) is refused: its bytes are no one
        parameter's."""
        found = self.by_address.get(tensor.data_ptr())
        if found is not None and found[1].shape == tensor.shape and tensor.is_contiguous():
            return found[0]
        storage = tensor.untyped_storage().data_ptr()
        for address, (name, placeholder) in self.by_address.items():
            if address <= storage < address + placeholder.numel() * placeholder.element_size():
                raise InvalidModel(name, f"the export reads parameter {name} through a view {tuple(tensor.shape)}")
        return None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.by_address.values())


@dataclass(frozen=True)
class Destination:
    """One external initializer a parameter is written to: ``perm`` transposes it first (None: as loaded)."""

    external: Any  # onnx_ir.ExternalTensor in the plan's data file
    perm: tuple[int, ...] | None = None


# (parameter name, read transposed) -> the data file its initializer goes to; None: the plan's own data file
Layout = Callable[[str, bool], "Path | None"]


@dataclass
class StreamPlan:
    """The data files' layout: parameter name -> its initializers, and the tracer's own tensors written as they are.

    Every tensor goes to ``data_path`` unless the plan's ``layout`` names another file for a parameter (a stage's
    own data file, :mod:`ortpa.conversion.staged`); every file must be in ``data_path``'s folder."""

    data_path: Path
    targets: dict[str, list[Destination]] = field(default_factory=dict)
    computed: list[tuple[Any, Any]] = field(default_factory=list)  # (onnx_ir.Value, its ExternalTensor)
    sizes: dict[Path, int] = field(default_factory=dict)  # data file -> bytes laid out in it so far

    def place(self, name: str, dtype: Any, shape: Any, nbytes: int, file: Path | None = None):
        """The next page-aligned slot of ``nbytes`` in ``file`` (default: ``data_path``), as the external tensor that
        reads it."""
        import onnx_ir as ir

        file = file or self.data_path
        if file.parent != self.data_path.parent:
            raise ValueError(f"data file {file} is not in the model's folder {self.data_path.parent}")
        size = self.sizes.get(file, 0)
        offset = -(-size // _ALIGN) * _ALIGN
        self.sizes[file] = offset + nbytes
        return ir.ExternalTensor(
            file.name, offset, nbytes, dtype, shape=ir.Shape(shape), name=name, base_dir=file.parent
        )

    @property
    def files(self) -> list[Path]:
        """Every data file the plan writes."""
        return list(self.sizes)

    @property
    def nbytes(self) -> int:
        """What :func:`stream` writes (a weight in two layouts counts twice, a tied one once)."""
        return sum(d.external.length for ds in self.targets.values() for d in ds) + sum(
            e.length for _, e in self.computed
        )


# ------------------------------------------------------------------------------------------ the loader, intercepted
class _Dequantized:
    """An FP8 weight and its block scales, standing for the float32 weight they mean (read when sliced)."""

    def __init__(self, weight: Any, scale: Any, block: tuple[int, int], name: str, folder: str) -> None:
        self.weight, self.scale, self.block, self.name, self.folder = weight, scale, block, name, folder

    def get_shape(self) -> list[int]:
        return list(self.weight.get_shape())

    def get_dtype(self) -> str:
        return "F32"

    def __getitem__(self, index: Any):
        from ortpa.export.fp8 import dequantize_blocks

        try:
            return dequantize_blocks(self.weight[...], self.scale[...], self.block)[index]
        except ValueError as exc:
            raise InvalidModel(self.folder, f"{self.name}: {exc}") from None


def _fp8_state_dict(state_dict: Mapping[str, Any], spec: Any, folder: str) -> dict[str, Any]:
    """The loader's state dict of an FP8 folder: each FP8 weight as a :class:`_Dequantized`, scales dropped."""
    from ortpa.export.fp8 import DROPPED_SUFFIXES, SCALE_SUFFIX

    out: dict[str, Any] = {}
    for name, tensor in state_dict.items():
        if name.endswith(DROPPED_SUFFIXES):
            continue
        code = tensor.get_dtype()
        if code in ("I64", "I32", "I16", "I8", "U8", "BOOL"):  # no known FP8 checkpoint stores any
            raise InvalidModel(folder, f"integer tensors in an FP8 checkpoint are not supported: {name}")
        if code.startswith("F8_"):
            scale = state_dict.get(name + SCALE_SUFFIX)
            if scale is None:
                raise InvalidModel(folder, f"FP8 tensor {name} has no {name + SCALE_SUFFIX} beside it")
            tensor = _Dequantized(tensor, scale, spec.block, name, folder)
        out[name] = tensor
    return out


@contextlib.contextmanager
def _intercepted(
    on_param: Callable[[str, Any], Any], *, read: bool, fp8: Any = None, folder: str = ""
) -> Iterator[None]:
    """Inside the block, ``from_pretrained`` loads one parameter at a time (no thread pool), hands each parameter it
    built to ``on_param(name, tensor)`` and sets what that returns; ``read=False``: every checkpoint tensor it reads
    is a meta tensor of the stored shape and dtype (nothing is read)."""
    import torch
    import transformers.core_model_loading as loading
    import transformers.modeling_utils as modeling

    original_convert = modeling.convert_and_load_state_dict_in_model
    original_set = loading.set_param_for_module
    original_copy = loading._materialize_copy

    def convert(model, state_dict, load_config, disk_offload_index=None):
        if fp8 is not None:
            state_dict = _fp8_state_dict(state_dict, fp8, folder)
        return original_convert(
            model=model, state_dict=state_dict, load_config=load_config, disk_offload_index=disk_offload_index
        )

    def set_param(model, target_name, value, loading_info, hf_quantizer):
        return original_set(model, target_name, on_param(target_name, value), loading_info, hf_quantizer)

    def meta_copy(tensor, device=None, dtype=None):
        stored = getattr(torch, _ST_DTYPES[tensor.get_dtype()])
        return torch.empty(tensor.get_shape(), dtype=dtype or stored, device="meta")

    previous = os.environ.get("HF_DEACTIVATE_ASYNC_LOAD")
    os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = "1"  # a thread pool would read every tensor at once
    modeling.convert_and_load_state_dict_in_model = convert
    loading.set_param_for_module = set_param

    def blockwise_copy(tensor, device=None, dtype=None):
        # a stored tensor cast as it is read, a block of rows at a time: never the stored and the cast copies whole
        # at once (the loader's own reads it whole, then casts); an FP8 weight dequantizes whole (its own blocks)
        stored = getattr(torch, _ST_DTYPES.get(tensor.get_dtype(), ""), None) if hasattr(tensor, "get_dtype") else None
        shape = tensor.get_shape() if stored is not None else []
        elsewhere = device is not None and torch.device(device).type != "cpu"
        if isinstance(tensor, _Dequantized) or dtype in (None, stored) or not shape or elsewhere:
            return original_copy(tensor, device, dtype)
        out = torch.empty(shape, dtype=dtype)
        row = max(1, out[0].numel() * stored.itemsize) if shape[0] else 1
        step = max(1, _BLOCK_BYTES // row)
        for start in range(0, shape[0], step):
            out[start : start + step] = tensor[start : start + step]
        return out

    if not read:
        loading._materialize_copy = meta_copy
    else:
        loading._materialize_copy = blockwise_copy
    try:
        yield
    finally:
        modeling.convert_and_load_state_dict_in_model = original_convert
        loading.set_param_for_module = original_set
        loading._materialize_copy = original_copy
        if previous is None:
            os.environ.pop("HF_DEACTIVATE_ASYNC_LOAD", None)
        else:
            os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = previous


def _from_pretrained(folder: Path, config: Any, dtype: Any, attn_implementation: str, **extra: Any):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(folder), config=config, local_files_only=True, attn_implementation=attn_implementation, dtype=dtype, **extra
    )


def _config(folder: Path, dtype: str, fp8: Any):
    """The folder's config; an FP8 one without its ``quantization_config`` (ortpa dequantizes, not transformers)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    if fp8 is not None and hasattr(config, "quantization_config"):
        del config.quantization_config
        config.dtype = dtype
    return config


def skeleton(folder: Path, dtype: str, attn_implementation: str, fp8: Any) -> tuple[Any, Placeholders]:
    """The model ``from_pretrained`` builds from ``folder`` in ``dtype``, with no weight read: every parameter loaded
    from the checkpoint is a placeholder (see the module docstring); the rest (buffers computed from the config, any
    parameter the checkpoint lacks, initialised as ``from_pretrained`` does) is real."""
    import torch

    placeholders = Placeholders()
    with _intercepted(placeholders.make, read=False, fp8=fp8, folder=str(folder)):
        model = _from_pretrained(folder, _config(folder, dtype, fp8), getattr(torch, dtype), attn_implementation)
    return model.eval(), placeholders


def destinations(irm: Any, placeholders: Placeholders, data_path: Path, layout: Layout | None = None) -> StreamPlan:
    """Map every initializer of the traced ``irm`` to what it holds, in place, and lay out ``data_path``: each
    placeholder's initializer becomes an external tensor there (written later by :func:`stream`); a weight read
    only through ``Transpose`` nodes becomes one initializer per permutation, the nodes removed, written transposed.
    Any other initializer of :data:`_MIN_EXTERNAL_BYTES` or more is a tensor the tracer made from real data (a
    buffer computed from the config, a constant of the model's code, a parameter the checkpoint lacks): queued in
    ``plan.computed`` and written as it is. Raises :class:`~ortpa.errors.InvalidModel` for an initializer that
    reads a placeholder through a view. ``layout``: which data file each parameter's initializers go to
    (:data:`Layout`; default all in ``data_path``); the tracer's own tensors stay in ``data_path``."""
    import onnx_ir as ir
    import torch

    plan = StreamPlan(data_path=data_path)
    outputs = {id(v) for v in irm.graph.outputs}
    for value in list(irm.graph.initializers.values()):
        raw = getattr(value.const_value, "raw", None)
        if not isinstance(raw, torch.Tensor):
            continue
        name = placeholders.name_of(raw)
        if name is None:
            if value.const_value.nbytes >= _MIN_EXTERNAL_BYTES:
                plan.computed.append(
                    (value, plan.place(value.name, value.dtype, value.shape, value.const_value.nbytes))
                )
            continue
        consumers = value.consumers()
        transposes = [
            n for n in consumers if n.op_type == "Transpose" and n.domain == "" and id(n.outputs[0]) not in outputs
        ]
        by_perm: dict[tuple[int, ...], list[Any]] = {}
        for node in transposes:
            attr = node.attributes.get("perm")
            perm = tuple(attr.as_ints()) if attr is not None else tuple(reversed(range(raw.ndim)))
            by_perm.setdefault(perm, []).append(node)
        keep = len(transposes) < len(consumers) or id(value) in outputs
        targets = plan.targets.setdefault(name, [])
        nbytes = raw.numel() * raw.element_size()
        to_file = layout or (lambda _name, _transposed: None)
        for perm, nodes in by_perm.items():
            suffix = "" if len(by_perm) == 1 and not keep else "_" + "".join(map(str, perm))
            new_name = f"{value.name}.T{suffix}"
            shape = ir.Shape([raw.shape[p] for p in perm])
            transposed = ir.Value(name=new_name, shape=shape, type=ir.TensorType(value.dtype))
            transposed.const_value = plan.place(new_name, value.dtype, shape, nbytes, to_file(name, True))
            irm.graph.register_initializer(transposed)
            for node in nodes:
                ir.convenience.replace_all_uses_with(node.outputs[0], transposed)
                irm.graph.remove(node, safe=True)
            targets.append(Destination(transposed.const_value, perm))
        if keep:
            value.const_value = plan.place(value.name, value.dtype, value.shape, nbytes, to_file(name, False))
            targets.append(Destination(value.const_value))
        else:
            irm.graph.initializers.pop(value.name)
    return plan


_BLOCK_BYTES = 32 << 20  # a non-contiguous (transposed) weight is written in row blocks of about this size


def _row_blocks(tensor: Any) -> Iterator[Any]:
    """``tensor`` as consecutive blocks of its first dimension, each about :data:`_BLOCK_BYTES` once contiguous; a
    contiguous tensor (or a scalar) whole."""
    if tensor.is_contiguous() or tensor.ndim == 0 or tensor.shape[0] == 0:
        yield tensor
        return
    row = max(1, tensor[0].numel() * tensor.element_size())
    step = max(1, _BLOCK_BYTES // row)
    for start in range(0, tensor.shape[0], step):
        yield tensor[start : start + step]


def _finite(tensor: Any) -> bool:
    """Whether every element of ``tensor`` is finite. One min/max reduction (NaN propagates through it): no mask of
    the tensor, and ~30x faster than ``isfinite(...).all()`` on a float16 weight, which made this check a third of
    the time spent streaming a checkpoint."""
    import torch

    if tensor.numel() == 0:
        return True
    lo, hi = torch.aminmax(tensor)
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


def stream(
    folder: Path,
    plan: StreamPlan,
    *,
    dtype: str,
    attn_implementation: str,
    fp8: Any,
    float16_from: str | None,
    written: Callable[[int, int], None] | None = None,
) -> None:
    """Write the plan's data files: the tracer's own tensors, then every parameter as ``from_pretrained`` loads it
    from ``folder`` (one at a time, see the module docstring), each straight into the file the plan placed it in.
    ``float16_from``: the stored dtype when a float16 export
    casts wider weights, each of which must then fit float16 (refused by name otherwise)."""
    import torch

    from ortpa.export.checkpoint_dtype import WIDER

    total = plan.nbytes
    done = 0
    seen: set[str] = set()
    fds = {p: os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) for p in {plan.data_path, *plan.files}}

    def write(tensor: Any, external: Any) -> None:
        nonlocal done
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes != external.length:
            raise InvalidModel(str(folder), f"{external.name}: {nbytes} bytes loaded, {external.length} traced")
        fd = fds[Path(external.base_dir) / external.location]
        offset = external.offset
        # a transposed view is made contiguous a block of rows at a time: never a second whole copy of the weight
        for block in _row_blocks(tensor):
            data = block.contiguous().reshape(-1).view(torch.uint8).numpy()
            view = memoryview(data)
            while view:
                n = os.pwrite(fd, view, offset)
                view, offset = view[n:], offset + n
            del data, view
        done += nbytes
        if written is not None:
            written(done, total)

    def on_param(name: str, tensor: Any):
        targets = plan.targets.get(name)
        if targets is not None and name not in seen:  # None: a parameter the graph never reads (a tied copy)
            seen.add(name)
            if float16_from is not None and tensor.is_floating_point() and not _finite(tensor):
                raise InvalidModel(
                    str(folder), f"weight {name} does not fit float16 (its {float16_from} values pass 65504); {WIDER}"
                )
            for target in targets:
                write(tensor.permute(target.perm) if target.perm else tensor, target.external)
        meta = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
        del tensor
        release_freed()  # the loader's copies of this parameter are gone: their pages back (module docstring)
        return meta

    try:
        for value, external in plan.computed:
            write(value.const_value.raw, external)
            value.const_value = external
        with _intercepted(on_param, read=True, fp8=fp8, folder=str(folder)):
            # no forward runs on this model (its parameters stay meta): hub kernels, which need a device, are not asked
            config = _config(folder, dtype, fp8)
            _from_pretrained(folder, config, getattr(torch, dtype), attn_implementation, use_kernels=False)
    finally:
        for fd in fds.values():
            os.close(fd)
    unread = sorted(set(plan.targets) - seen)
    if unread:
        raise InvalidModel(str(folder), f"parameters traced but not loaded when streaming: {unread[:3]}")
