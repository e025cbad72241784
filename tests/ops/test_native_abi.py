"""ONNX Runtime's C API as ortpa declares it (ortpa/ops/native/ort_abi.h), checked entry by entry.

``ortpa.test::AbiEcho`` returns what each declared OrtApi entry gave it (the runtime's version string, a known
input's element type and shape, its bytes through GetTensorMutableData and KernelContext_ParallelFor, attributes
read back, the node's name, input and output counts), and fails through CreateStatus when asked: an entry at the
wrong index or with the wrong signature gives a wrong value, an error or a crash here.
"""

from __future__ import annotations

import ctypes

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from ortpa.dtypes import onnx_elem_type
from ortpa.ops.native import native_library
from ortpa.ops.validate import dtype_name

_OUTPUTS = (
    ("version", TensorProto.UINT8),
    ("ints", TensorProto.INT64),
    ("float_attr", TensorProto.FLOAT),
    ("string_attr", TensorProto.UINT8),
    ("node_name", TensorProto.UINT8),
    ("input_bytes", TensorProto.UINT8),
)


def _echo_session(x: np.ndarray, node_name: str = "echo_node", **attrs) -> ort.InferenceSession:
    node = helper.make_node("AbiEcho", ["x"], [n for n, _ in _OUTPUTS], name=node_name, domain="ortpa.test", **attrs)
    graph = helper.make_graph(
        [node],
        "abi_echo",
        [helper.make_tensor_value_info("x", onnx_elem_type(dtype_name(x.dtype)), list(x.shape))],
        [helper.make_tensor_value_info(n, t, None) for n, t in _OUTPUTS],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ortpa.test", 1)])
    model.ir_version = 10
    library = native_library()
    assert library is not None, "ortpa's native library is not built (python setup.py build_ext --inplace)"
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(library.path))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _text(array: np.ndarray) -> str:
    return bytes(array).decode()


@pytest.mark.parametrize(
    ("dtype", "shape"),
    [(np.float16, (2, 3)), (np.int32, (4,)), (np.float32, (1, 2, 5)), (np.int64, (3, 1)), (np.int8, (7,))],
)
def test_every_declared_entry_returns_what_onnx_runtime_knows(dtype, shape):
    rng = np.random.default_rng(len(shape))
    x = rng.integers(-100, 100, size=shape).astype(dtype)
    sess = _echo_session(x, int_attr=123456789012, float_attr=-2.75, string_attr="ortpa ABI")
    version, ints, float_attr, string_attr, node_name, input_bytes = sess.run(None, {"x": x})
    assert _text(version) == ort.__version__  # OrtApiBase::GetVersionString
    elem = onnx_elem_type(dtype_name(x.dtype))
    # GetTensorElementType, GetDimensionsCount, GetDimensions, the int64 attribute, the input and output counts
    assert ints.tolist() == [elem, len(shape), *shape, 123456789012, 1, len(_OUTPUTS)]
    assert float_attr.tolist() == [-2.75]
    assert _text(string_attr) == "ortpa ABI"
    assert _text(node_name) == "echo_node"  # KernelInfo_GetNodeName
    # GetTensorMutableData (the input's bytes) copied element by element through KernelContext_ParallelFor
    assert input_bytes.tobytes() == np.ascontiguousarray(x).tobytes()


def test_absent_attributes_are_told_apart_from_set_ones():
    sess = _echo_session(np.zeros((2,), np.float32), node_name="other")
    _, ints, float_attr, string_attr, node_name, _ = sess.run(None, {"x": np.arange(2, dtype=np.float32)})
    assert ints.tolist()[3] == -1 and float_attr.tolist() == [-1.0]
    assert _text(string_attr) == "<absent>" and _text(node_name) == "other"


def test_a_kernel_error_reaches_python_with_its_code_and_message():
    sess = _echo_session(np.zeros((1,), np.float32), fail=1)
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument, match="failing as asked"):
        sess.run(None, {"x": np.zeros((1,), np.float32)})


# RegisterCustomOps(OrtSessionOptions*, const OrtApiBase*) called directly with a stand-in OrtApiBase whose
# GetApi has no table of the version ortpa asks for: the call must return an error status, not crash.
_GET_API = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_uint32)
_GET_VERSION = ctypes.CFUNCTYPE(ctypes.c_void_p)
_CREATE_STATUS = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p)


class _ApiBase(ctypes.Structure):
    _fields_ = [("GetApi", _GET_API), ("GetVersionString", _GET_VERSION)]


def test_an_older_runtime_gets_a_clear_error_not_a_crash():
    library = native_library()
    assert library is not None
    made: list[tuple[int, str]] = []
    asked: list[int] = []
    sentinel = 0x5A17

    @_CREATE_STATUS
    def create_status(code, message):
        made.append((code, message.decode()))
        return sentinel

    version = ctypes.create_string_buffer(b"1.16.3")
    table = (ctypes.c_void_p * 1)(ctypes.cast(create_status, ctypes.c_void_p))  # entry 0: CreateStatus

    @_GET_API
    def get_api(requested):
        asked.append(requested)
        return ctypes.addressof(table) if requested == 1 else None

    @_GET_VERSION
    def get_version():
        return ctypes.addressof(version)

    base = _ApiBase(get_api, get_version)
    handle = ctypes.CDLL(str(library.path))
    handle.RegisterCustomOps.restype = ctypes.c_void_p
    handle.RegisterCustomOps.argtypes = [ctypes.c_void_p, ctypes.POINTER(_ApiBase)]
    status = handle.RegisterCustomOps(None, ctypes.byref(base))
    assert status == sentinel
    assert asked[0] == 17 and 1 in asked
    [(code, message)] = made
    assert code == 1  # ORT_FAIL
    assert "C API version 17" in message and "1.16.3" in message


def test_the_op_domain_registered_is_the_converted_models():
    """PagedAttention is registered in com.microsoft, so a converted file opens as written (no rewrite)."""
    from ortpa.ops.portable.single_node import paged_attention_model

    q = np.zeros((1, 32), np.float16)
    kv = np.zeros((1, 16), np.float16)
    cache = np.zeros((2, 16, 1, 16), np.float16)
    inputs = {
        "query": q,
        "key": kv,
        "value": kv,
        "key_cache": cache,
        "value_cache": cache.copy(),
        "cumulative_sequence_length": np.array([0, 1], np.int32),
        "past_seqlens": np.array([0], np.int32),
        "block_table": np.array([[0]], np.int32),
    }
    model = paged_attention_model(inputs, {"num_heads": 2, "kv_num_heads": 1})
    assert {n.domain for n in model.graph.node} == {"com.microsoft"}
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(native_library().path))
    sess = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    out, *_ = sess.run(None, inputs)
    assert out.shape == (1, 32)
    # without the library, ONNX Runtime's own CPU provider cannot run the op (it has no float16 kernel of it)
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidGraph, match="PagedAttention"):
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
