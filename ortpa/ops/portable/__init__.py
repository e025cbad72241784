"""``com.microsoft::PagedAttention`` in standard ONNX ops, so that any execution provider runs it.

``lower`` replaces PagedAttention nodes by calls of model-local functions (one loop, used in memory by the
runtime and on a written file by ``convert --portable``); ``layer`` traces one layer's function, ``plan`` the
index work a step's layers share, both on ``tracer``'s helpers and ``config``'s types; ``calls`` finds the caches
of a file whose nodes were lowered already; ``single_node`` builds one-node models for tests and benchmarks.
"""

from ortpa.ops.portable.calls import LoweredCachePort, lowered_cache_ports, lowered_rotary_tables
from ortpa.ops.portable.config import DEFAULT_OPSET, PlanConfig, PortableConfig
from ortpa.ops.portable.lower import (
    BACKEND,
    PORTABLE_FEATURES,
    LayerCall,
    layer_call,
    lower_nodes,
    lower_to_portable,
    node_attributes,
    portable_config,
    value_types,
)
from ortpa.ops.portable.single_node import paged_attention_model, portable_single_node_model
from ortpa.ops.portable.tracer import FUNCTION_DOMAIN

__all__ = [
    "BACKEND",
    "DEFAULT_OPSET",
    "FUNCTION_DOMAIN",
    "PORTABLE_FEATURES",
    "LayerCall",
    "LoweredCachePort",
    "PlanConfig",
    "PortableConfig",
    "layer_call",
    "lower_nodes",
    "lower_to_portable",
    "lowered_cache_ports",
    "lowered_rotary_tables",
    "node_attributes",
    "paged_attention_model",
    "portable_config",
    "portable_single_node_model",
    "value_types",
]
