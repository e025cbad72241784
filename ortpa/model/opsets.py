"""Opset and ONNX Runtime checks of :func:`ortpa.model.file.read_model` (its steps 4 and 5, strings aside).

Nodes only use domains the model imports (a ``PagedAttention`` without a ``com.microsoft`` import fails),
default-domain ops exist in the model's opset with that many inputs / outputs, and the installed ONNX Runtime
can load a model of this ``ir_version`` and these opset versions (asked of ORT itself on an empty graph with the
same header, so the answer follows the installed ORT, not a table here). :func:`ort_message_line` turns ORT's
exception text into one line without its C++ source location.
"""

from __future__ import annotations

import functools
import re

import onnx

from ortpa.errors import InvalidModel
from ortpa.model.ort_schemas import ort_schema, register_ort_default_domain_schemas
from ortpa.providers import CPU

__all__ = ["check_domains", "check_ort_version_support", "ort_message_line"]


def check_domains(proto: onnx.ModelProto, label: str) -> None:
    """Every node (graph, subgraphs, functions) uses an imported domain; default-domain and ``com.microsoft``
    ops exist (for onnx or ONNX Runtime) and fit the opset. Registers ONNX Runtime's default-domain ops with onnx
    so that the checker and shape inference accept what ONNX Runtime loads."""
    register_ort_default_domain_schemas()
    versions = {op.domain or "ai.onnx": op.version for op in proto.opset_import}
    imported = set(versions)
    functions = {(fn.domain, fn.name) for fn in proto.functions}

    def check(nodes, where: str) -> None:
        for node in nodes:
            domain = node.domain or "ai.onnx"
            if domain not in imported and (node.domain, node.op_type) not in functions:
                raise InvalidModel(
                    label,
                    f"{where}node {node.name or node.op_type!r} ({domain}::{node.op_type}) uses domain {domain!r}, "
                    f"which the model does not import (opset_import: {sorted(imported)})",
                )
            if domain in ("ai.onnx", "com.microsoft") and (node.domain, node.op_type) not in functions:
                _check_schema(node, domain, versions[domain], where, label)
            for attr in node.attribute:
                for g in [attr.g] if attr.HasField("g") else []:
                    check(g.node, where)
                for g in attr.graphs:
                    check(g.node, where)

    check(proto.graph.node, "")
    for fn in proto.functions:
        fn_imported = imported | {op.domain or "ai.onnx" for op in fn.opset_import}
        saved, imported = imported, fn_imported
        check(fn.node, f"function {fn.name!r}: ")
        imported = saved


def _check_schema(node: onnx.NodeProto, domain: str, opset: int, where: str, label: str) -> None:
    """The node's op exists in the model's opset of its domain with this many inputs and outputs (a model
    stamped with the wrong opset, or a corrupted op_type, fails here instead of deep in ORT or the optimizer).

    The authority is what ONNX Runtime loads: onnx's registry for ONNX ops, then ONNX Runtime's own registry for
    its contrib ops (``com.microsoft``) and the ops it registers in the default domain
    (``SimplifiedLayerNormalization``).
    """
    name = f"{where}node {node.name or node.op_type!r}"
    schema = None
    if domain == "ai.onnx":
        try:
            schema = onnx.defs.get_schema(node.op_type, opset, "")
        except onnx.defs.SchemaError:
            schema = None
    if schema is None:
        schema = ort_schema(domain, node.op_type, opset)
    if schema is None:
        raise InvalidModel(
            label,
            f"{name}: op {node.op_type!r} does not exist in {domain} opset {opset} "
            "(neither onnx nor ONNX Runtime registers it)",
        )
    if domain != "ai.onnx":  # contrib ops: existence only; their signatures are the validator's to judge
        return
    n_in = len(node.input)
    while n_in and not node.input[n_in - 1]:  # trailing empty names are omitted optional inputs
        n_in -= 1
    if (
        not schema.min_input <= n_in <= schema.max_input
        or not schema.min_output <= len(node.output) <= schema.max_output
    ):
        raise InvalidModel(
            label,
            f"{name}: {node.op_type} in {domain} opset {opset} (since version {schema.since_version}) takes "
            f"{schema.min_input}..{schema.max_input} inputs and {schema.min_output}..{schema.max_output} outputs, "
            f"the node has {n_in} and {len(node.output)} (is the model stamped with the wrong opset?)",
        )


def check_ort_version_support(proto: onnx.ModelProto, label: str) -> None:
    """:class:`InvalidModel` when the installed ONNX Runtime cannot load this ``ir_version`` / these opsets."""
    opsets = tuple(sorted((op.domain, op.version) for op in proto.opset_import))
    reason = _ort_refusal(proto.ir_version, opsets)
    if reason:
        shown = ", ".join(f"{d or 'ai.onnx'} {v}" for d, v in opsets)
        raise InvalidModel(label, f"ir_version {proto.ir_version}, opsets [{shown}]: {reason}")


@functools.lru_cache(maxsize=64)
def _ort_refusal(ir_version: int, opsets: tuple[tuple[str, int], ...]) -> str:
    """ORT's reason for refusing a model header ('' if it loads): an empty graph with the same header."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    graph = helper.make_graph([], "ortpa_version_probe", [x], [x])
    probe = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])
    probe.ir_version = ir_version
    options = ort.SessionOptions()
    options.log_severity_level = 3  # the probe's warnings (old opsets) are not the user's business
    try:
        ort.InferenceSession(probe.SerializeToString(), options, providers=[CPU])
    except Exception as exc:  # ORT's own exception types; the text is the reason
        return f"ONNX Runtime {ort.__version__} cannot load it: {ort_message_line(str(exc))}"
    return ""


def ort_message_line(message: str) -> str:
    """ORT's text without its C++ source location and signature, on one line."""
    text = " ".join(message.split())
    text = re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", text)
    # "/onnxruntime_src/.../model.cc:256 onnxruntime::Model::Model(...) Unsupported model IR version: 14, ..."
    match = re.search(r"\.(?:cc|h):\d+ .*?\)\s+(?=[A-Z])", text)
    if match:
        text = text[match.end() :]
    newer = re.search(
        r"Opset (\d+) is under development.*Current official support for domain (\S+) is till opset (\d+)", text
    )
    if newer:
        version, domain, top = newer.groups()
        return f"opset {version} of domain {domain} is newer than it supports (up to {top})"
    return text if len(text) <= 400 else text[:400] + "..."
