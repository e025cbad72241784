"""onnxscript's optimizer as the rewrite's pre-optimisation, in time linear in the graph.

``onnxscript.optimizer.optimize`` applies its default rewrite rules with a matcher that, for a pattern of several
output nodes (``SlicesSplit``: two ``Slice`` nodes of one tensor -> one ``Split``), tries every node of the graph
with the right op type as the second output, for every candidate first node: quadratic in the graph (a 30-layer
Llama export: ~470k match attempts, most of the conversion's time). Such a pattern whose every output node reads a
value that the first one reads too can only match nodes that share an input with the first; :class:`_SiblingMatcher`
tries exactly those, so the rules find the matches they found before (where two would fit, as with two identical
``Slice`` nodes, possibly the other one: the same computation). Every such rule also turns a node away by its op
type before anything else (the simple matcher's own first check, ~250k times on a 30-layer model): in its matcher,
and in ``try_rewrite`` before a match is set up around the matcher.

:func:`optimize` is ``onnxscript.optimizer.optimize`` (same passes, same order, same limits) with those rules'
matchers swapped. The weights are never read: constant folding skips inputs past its size limit, and the export of
a checkpoint writes its weights already in the layout the graph reads them (no ``Transpose`` left to fold).
"""

from __future__ import annotations

import copy
import itertools

import onnx_ir as ir
import onnx_ir.passes.common as common_passes
from onnxscript import rewriter
from onnxscript.optimizer import _constant_folding
from onnxscript.rewriter import _matcher

__all__ = ["optimize"]


class _SiblingMatcher(_matcher.SimplePatternMatcher):
    """The simple matcher, with the candidates for a multi-output pattern's other output nodes restricted to the
    nodes that read one of the first node's inputs (see the module docstring)."""

    def match(self, model, graph_or_function, node, *, verbose=0, remove_nodes=True, tracer=None):
        if not self.pattern.output_nodes[0].op.matches(node.op_type):
            # the first check the simple matcher makes, before it sets up a match: most (rule, node) pairs fail it
            return _matcher._basics.MatchResult().fail("OpType mismatch.")
        if self.pattern.has_single_output_node:
            return super().match(
                model, graph_or_function, node, verbose=verbose, remove_nodes=remove_nodes, tracer=tracer
            )
        self._tracer = tracer
        self._graph = graph_or_function if isinstance(graph_or_function, ir.Graph) else graph_or_function.graph
        siblings: dict[int, ir.Node] = {}
        for value in node.inputs:
            if value is not None:
                for consumer in value.consumers():
                    siblings.setdefault(id(consumer), consumer)
        ordered = list(siblings.values())
        candidates = [[node]] + [
            [n for n in ordered if n.op_identifier() == pn.op_identifier()] for pn in self.pattern.output_nodes[1:]
        ]
        match = None
        for combination in itertools.product(*candidates):
            self._init_match(verbose)
            match = self._multi_match(combination, check_removable=remove_nodes)
            if match:
                return match
        return match if match is not None else _matcher._basics.MatchResult().fail("No match found.")


class _FoldConstants(_constant_folding.FoldConstantsPass):
    """onnxscript's constant folding, its per-node shape inference skipped where every output already has a type
    and a shape whose every dimension is known or named: inference (a protobuf round trip per node, ~40% of
    the pass) merges into such a shape without changing it (on a 30-layer export: the same graph, the same shape
    on every value, 1.2 s less). Nodes the rewrite rules made, and models exported without value shapes, are
    inferred as before."""

    def _do_inference(self, node: ir.Node) -> None:
        if node.outputs and all(_known(v) for v in node.outputs):
            return
        super()._do_inference(node)


def _known(value: ir.Value) -> bool:
    shape = value.shape
    return (
        value.type is not None and shape is not None and all(isinstance(d, int) or d.value is not None for d in shape)
    )


def _shares_first_inputs(pattern) -> bool:
    """Whether every output node of ``pattern`` past the first reads a value the first one reads."""
    first = {id(v) for v in pattern.output_nodes[0].inputs if v is not None}
    return all(any(id(v) in first for v in pn.inputs if v is not None) for pn in pattern.output_nodes[1:])


def _op_gated(rule):
    """``rule.try_rewrite`` that returns at once for a node of another op type than the pattern's (first) output
    node: what its matcher finds first, without the match set up around it (~250k calls on a 30-layer model)."""
    first = rule._target_pattern.output_nodes[0].op
    inner = rule.try_rewrite

    def try_rewrite(model, graph_or_function, node, *, verbose=None, tracer=None):
        if tracer is None and not first.matches(node.op_type):
            return None
        return inner(model, graph_or_function, node, verbose=verbose, tracer=tracer)

    return try_rewrite


def _linear_rules() -> list:
    rules = []
    for rule in rewriter._DEFAULT_REWRITE_RULES:
        pattern = rule._target_pattern
        simple = type(rule._matcher) is _matcher.SimplePatternMatcher
        if simple and (pattern.has_single_output_node or _shares_first_inputs(pattern)):
            rule = copy.copy(rule)
            rule._matcher = _SiblingMatcher(pattern)
            rule.try_rewrite = _op_gated(rule)
        rules.append(rule)
    return rules


def optimize(model: ir.Model, num_iterations: int = 2) -> None:
    """``onnxscript.optimizer.optimize(model)`` in place, its multi-output rules matched in linear time."""
    passes = [
        common_passes.InlinePass(),
        ir.passes.PassManager(
            [
                _FoldConstants(
                    shape_inference=True,
                    input_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT,
                    output_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT,
                    should_fold=lambda node: None,
                ),
                rewriter.RewritePass(_linear_rules()),
                common_passes.RemoveUnusedNodesPass(),
                common_passes.RemoveUnusedFunctionsPass(),
                common_passes.RemoveUnusedOpsetsPass(),
            ],
            steps=num_iterations,
            early_stop=True,
        ),
        common_passes.RemoveUnusedNodesPass(),
        common_passes.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
        common_passes.LiftSubgraphInitializersToMainGraphPass(),
        common_passes.DeduplicateInitializersPass(),
        common_passes.CommonSubexpressionEliminationPass(),
        common_passes.OutputFixPass(),
        common_passes.NameFixPass(),
    ]
    result = ir.passes.Sequential(*passes)(model)
    assert result.model is model
