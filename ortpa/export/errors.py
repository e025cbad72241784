"""A failed ``torch.onnx.export`` said in one line: which op or module could not be exported, and what to try.

torch.onnx raises a ~60-line chained exception; the cause a user can act on is a line or two inside it (the op
torchlib has no translation for, the modeling function that produced it). :func:`summarize` finds those; the
full traceback stays available with ``--verbose`` (the original exception is chained as ``__cause__``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ortpa.errors import OrtpaError

__all__ = ["ExportError", "ExportFailure", "summarize"]


@dataclass(frozen=True)
class ExportFailure:
    """What failed (``op``: an aten/custom op, or ``None``), where (``module``: a modeling file:line in function),
    the exception's first line (``detail``) and what to try (``hint``)."""

    op: str | None
    module: str | None
    detail: str
    hint: str

    def line(self) -> str:
        what = f"no ONNX translation for {self.op}" if self.op else self.detail
        where = f" (in {self.module})" if self.module else ""
        return f"export failed: {what}{where}; {self.hint}"


class ExportError(OrtpaError, RuntimeError):
    """``torch.onnx.export`` failed; ``failure`` says on what and what to try."""

    def __init__(self, model: str, failure: ExportFailure) -> None:
        self.model = model
        self.failure = failure
        super().__init__(f"{model}: {failure.line()}")


_OP = re.compile(r"No ONNX function found for (?:<?OpOverload\(op=')?([\w.:]+)")
_FRAME = re.compile(r'File "[^"]*/(modeling_\w+\.py)", line (\d+), in (\w+)')
_COMPLEX = re.compile(r"complex", re.IGNORECASE)
_DATA_DEPENDENT = re.compile(r"data.dependent|GuardOnDataDependentSymNode|Could not guard on", re.IGNORECASE)


def _chain_text(exc: BaseException) -> str:
    parts, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        parts.append(f"{type(exc).__name__}: {exc}")
        exc = exc.__cause__ or exc.__context__
    return "\n".join(parts)


def _hint(op: str | None, text: str) -> str:
    if op and "grouped_mm" in op:
        return "try --experts batched_mm (or a transformers with transformers.exporters)"
    if _COMPLEX.search(text):
        return (
            "a complex-valued op (RoPE written with complex numbers?): ortpa rewrites DeepSeek-V2's; "
            "for another model, report it with --verbose output"
        )
    if _DATA_DEPENDENT.search(text):
        return "a data-dependent branch or loop (MoE 'eager' experts?): try --experts grouped_mm or batched_mm"
    if op:
        return "try --opset 23 or --attn-implementation eager; --verbose shows the traceback"
    return "--verbose shows the traceback; try --attn-implementation eager or --opset 23"


def _failing_node(exc: BaseException):
    """The ``torch.fx.Node`` torch.onnx was translating when it raised (a local of its frames), if any."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        tb = exc.__traceback__
        while tb is not None:
            node = tb.tb_frame.f_locals.get("node")
            if hasattr(node, "meta") and hasattr(node, "target"):
                return node
            tb = tb.tb_next
        exc = exc.__cause__ or exc.__context__
    return None


def _node_module(node) -> str | None:
    """``model.layers.1.mlp.experts (DeepseekV3NaiveMoe)``, and the modeling line, from the node's metadata."""
    parts = []
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        path, cls = list(stack.values())[-1]
        path = re.sub(r"^L\['self'\]\.?", "", str(path)).removeprefix("inner.")
        path = re.sub(r"\[(\d+)\]", r".\1", path)
        name = getattr(cls, "__name__", None) or str(cls).rsplit(".", 1)[-1].strip("'>")
        parts.append(f"{path} ({name})")
    frames = _FRAME.findall(str(node.meta.get("stack_trace") or ""))
    if frames:
        parts.append(f"{frames[-1][0]}:{frames[-1][1]} in {frames[-1][2]}")
    return ", ".join(parts) or None


def summarize(exc: BaseException) -> ExportFailure:
    """The op and modeling frame an export failure names, and a hint; never raises."""
    text = _chain_text(exc)
    match = _OP.search(text)
    op = match.group(1) if match else None
    module = None
    try:
        node = _failing_node(exc)
        module = _node_module(node) if node is not None else None
    except Exception:  # metadata is best effort: the op and the hint still stand
        module = None
    if module is None:
        frames = _FRAME.findall(text)
        module = f"{frames[-1][0]}:{frames[-1][1]} in {frames[-1][2]}" if frames else None
    first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
    first = re.sub(r"\x1b\[[0-9;]*m", "", first)[:200]
    return ExportFailure(op=op, module=module, detail=f"{type(exc).__name__}: {first}", hint=_hint(op, text))
