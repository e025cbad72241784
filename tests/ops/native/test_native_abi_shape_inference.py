"""The native PagedAttention's output shape inference (OrtCustomOp::InferOutputShapeFn, OrtApi entries 267-272).

ONNX Runtime asks the custom op for its output shapes when the session opens. The op answers through the entries
``ort_abi.h`` declares (the context's inputs and their symbolic dimensions, the node's int and string attributes
through ReadOpAttr, a new shape info with symbolic dimensions set as the output's), so these tests check those
entries end to end: the declared shape must be exactly the op's rule (``[tokens, num_heads * v_head_size]``, the
tokens dimension's symbol carried over, the width from the attributes), and a node downstream must see it when the
session opens. An entry at the wrong index gives a wrong or missing shape, an error or a crash here.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from ortpa.ops.native import native_library
from ortpa.ops.portable import paged_attention_model

T, H, KVH, D, NB, BS = 5, 4, 2, 16, 8, 16
LATENT_ROW, V_HEAD = 24, 16
_F16 = np.float16


def _inputs(kind: str) -> tuple[dict, dict]:
    """Stand-in inputs and attributes of a one-node model: ``separate`` K/V, ``packed`` QKV or ``latent``."""
    x = {
        "cumulative_sequence_length": np.array([0, T], np.int32),
        "past_seqlens": np.array([0], np.int32),
        "block_table": np.zeros((1, 1), np.int32),
    }
    cache = np.zeros((NB, BS, KVH, D), _F16)
    if kind == "latent":
        x.update(
            query=np.zeros((T, H * LATENT_ROW), _F16),
            key=np.zeros((T, LATENT_ROW), _F16),
            key_cache=np.zeros((NB, BS, 1, LATENT_ROW), _F16),
        )
        attrs = {"num_heads": H, "kv_num_heads": 1, "kv_cache_layout": "LATENT", "v_head_size": V_HEAD, "scale": 0.25}
        return x, attrs
    if kind == "packed":  # key and value absent: the query holds Q, K and V
        x.update(query=np.zeros((T, (H + 2 * KVH) * D), _F16), key_cache=cache, value_cache=cache)
    else:
        kv = np.zeros((T, KVH * D), _F16)
        x.update(query=np.zeros((T, H * D), _F16), key=kv, value=kv, key_cache=cache, value_cache=cache)
    return x, {"num_heads": H, "kv_num_heads": KVH}


def _session(model) -> ort.InferenceSession:
    library = native_library()
    assert library is not None, "ortpa's native library is not built (python setup.py build_ext --inplace)"
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.register_custom_ops_library(str(library.path))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize(("kind", "width"), [("separate", H * D), ("packed", H * D), ("latent", H * V_HEAD)])
def test_the_output_shape_is_known_when_the_session_opens(kind, width):
    x, attrs = _inputs(kind)
    model = paged_attention_model(x, attrs)  # query [T, width]: T a symbol
    # the graph output declares no shape: what the session reports is what inference gave the node's output
    model.graph.output[0].CopyFrom(helper.make_tensor_value_info("output", TensorProto.FLOAT16, None))
    sess = _session(model)
    assert sess.get_outputs()[0].shape == ["T", width]
    assert sess.get_outputs()[0].type == "tensor(float16)"
    # and it is the shape the kernel gives when it runs
    out = sess.run(["output"], x)[0]
    assert out.shape == (T, width)


@pytest.mark.parametrize("kind", ["separate", "packed", "latent"])
def test_a_downstream_node_sees_the_shape_when_the_session_opens(kind):
    """``Add`` with a ``[1, width + 1]`` constant: with the shape inferred, ONNX Runtime refuses the model when it
    opens (without it the mistake would show only at the first run)."""
    x, attrs = _inputs(kind)
    width = H * V_HEAD if kind == "latent" else H * D
    model = paged_attention_model(x, attrs)
    graph = model.graph
    graph.node[0].output[0] = "attention"
    for name, w in (("fits", width), ("off_by_one", width + 1)):
        graph.initializer.append(numpy_helper.from_array(np.zeros((1, w), _F16), name))
    graph.node.append(helper.make_node("Add", ["attention", "fits"], ["output"]))
    sess = _session(model)  # the right width opens and runs
    assert sess.run(["output"], x)[0].shape == (T, width)
    graph.node[-1].input[1] = "off_by_one"
    with pytest.raises(Exception, match="Incompatible dimensions"):
        _session(model)


def test_an_unknown_tokens_dimension_leaves_the_shape_undeclared():
    """A dimension that is neither a value nor a symbol cannot be declared (ONNX Runtime would write it as -1):
    the output's shape then stays unknown until the kernel runs, as without inference."""
    x, attrs = _inputs("separate")
    model = paged_attention_model(x, attrs)
    model.graph.input[0].type.tensor_type.shape.dim[0].Clear()  # query [?, 64]
    model.graph.output[0].CopyFrom(helper.make_tensor_value_info("output", TensorProto.FLOAT16, None))
    sess = _session(model)
    assert sess.get_outputs()[0].shape == []
    assert sess.run(["output"], x)[0].shape == (T, H * D)
