"""What the plan and the layer tracers share: the functions' domain and the onnxscript tracing helpers.

A leaf: both :mod:`ortpa.ops.portable.plan` and :mod:`ortpa.ops.portable.layer` build on it, neither on the other.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

__all__ = ["FUNCTION_DOMAIN", "GraphTracer"]

FUNCTION_DOMAIN = "ortpa.portable"

_F32 = ir.DataType.FLOAT
_I64 = ir.DataType.INT64


class GraphTracer:
    """Helpers shared by the plan and the layer tracers."""

    op: object

    def i64(self, v):
        return self.op.Cast(v, to=_I64)

    def f32(self, v):
        return self.op.Cast(v, to=_F32)

    def dim(self, v, axis: int):
        out = self.op.Shape(v, start=axis, end=axis + 1)  # 1-D [1] int64
        if out.type is None:  # ``v`` untyped (the plan's query and cache): say what Shape gives, so no CastLike
            out.type, out.shape = ir.TensorType(_I64), ir.Shape([1])
        return out

    def scalar(self, v):
        """A ``[1]`` tensor as a scalar. Squeeze with its axes as a Constant of the current (sub)graph: without
        axes, or with axes a compiler cannot see as constant (a value of the enclosing graph read inside an If
        branch), OpenVINO cannot tell the result's rank and refuses the graph."""
        return self.op.Squeeze(v, self.ints([0]))

    def ints(self, values: list[int]):
        return self.op.Constant(value_ints=values)

    def pads(self, values: list[int]):
        """Pad's ``pads`` as a ``value`` tensor: the shape inference of older ONNX Runtime releases (1.24) reads a
        ``value_ints`` Constant as a tensor without dims and refuses it as ``pads`` ("must be a 1D tensor")."""
        return self.constant(np.array(values, np.int64))

    def branch(self, condition, name: str, then_trace, else_trace, count: int = 1, shapes=None) -> list:
        """``If(condition)`` over two traced branches (each returns a list of ``count`` values); the branches
        read the body's values from the enclosing scope.

        Every output (the branches' and the If's) is declared with its element type and rank, static dimensions
        where known: compilers such as OpenVINO refuse a value of unknown rank. ``shapes`` gives each output's
        dimensions (``None``: dynamic); by default they are read off the else branch's constants, whose 0-sized
        dimensions are the dynamic ones (an empty group)."""
        outer = self.op

        def traced(trace):
            def fn(sub):
                self.op = sub
                try:
                    return trace()
                finally:
                    self.op = outer

            return fn

        branches = {
            key: outer.builder.subgraph(
                traced(fn), [], [ir.Value(name=f"{name}_{key}_{k}") for k in range(count)], name=f"{name}_{key}"
            )
            for key, fn in (("then", then_trace), ("else", else_trace))
        }
        for key, graph in branches.items():
            # the sub-builders number their values from 0 again: rename, or they would shadow the body's names
            declared = {id(v) for v in graph.outputs}
            for node in graph:
                node.name = f"{name}_{key}/{node.name}"
                for v in node.outputs:
                    if id(v) not in declared:
                        v.name = f"{name}_{key}/{v.name}"
        outs = outer.If(condition, then_branch=branches["then"], else_branch=branches["else"], _outputs=count)
        outs = list(outs) if count > 1 else [outs]
        for k, out in enumerate(outs):
            then_v, else_v = branches["then"].outputs[k], branches["else"].outputs[k]
            if shapes is not None:
                dtype, dims = shapes[k]
            else:
                if else_v.const_value is None and else_v.producer() is not None:
                    const = else_v.producer().attributes["value"].as_tensor()
                else:
                    const = else_v.const_value
                dtype, dims = const.dtype, [d or None for d in const.shape]
            for v in (then_v, else_v, out):
                v.type = ir.TensorType(dtype)
                v.shape = ir.Shape(dims)
        return outs

    def constant(self, array: np.ndarray):
        return self.op.Constant(value=ir.tensor(array))
