"""ortpa.InferenceSession and the aliased PagedSession on CPU, against the NumPy oracle."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from support.tolerances import assert_close

from ortpa.errors import InvalidArgument, InvalidParameter, NotImplementedByBackend
from ortpa.ops.oracle import paged_attention
from ortpa.ops.portable import paged_attention_model
from ortpa.runtime.kv import PagedKVCache
from ortpa.runtime.session import InferenceSession, PagedSession, find_cache_aliases

NH, KVH, H, BS, NB = 4, 2, 16, 16, 12
ATTRS = {"num_heads": NH, "kv_num_heads": KVH}


def _inputs(rng, dtype, q_lens, past, *, num_blocks=NB):
    t = sum(q_lens)
    b = len(q_lens)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    max_blocks = max(-(-(p + q) // BS) for p, q in zip(past, q_lens, strict=True))
    perm = rng.permutation(num_blocks)[: b * max_blocks].reshape(b, max_blocks).astype(np.int32)
    return {
        "query": rng.standard_normal((t, NH * H)).astype(dtype),
        "key": rng.standard_normal((t, KVH * H)).astype(dtype),
        "value": rng.standard_normal((t, KVH * H)).astype(dtype),
        "key_cache": rng.standard_normal((num_blocks, BS, KVH, H)).astype(dtype),
        "value_cache": rng.standard_normal((num_blocks, BS, KVH, H)).astype(dtype),
        "cumulative_sequence_length": cu,
        "past_seqlens": np.asarray(past, np.int32),
        "block_table": perm,
    }


def _oracle(x, attrs=ATTRS):
    return paged_attention(**x, **attrs)


@pytest.mark.parametrize("mode", ["portable", "auto"])
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["fp16", "bf16"])
def test_inference_session_single_node_matches_oracle(dtype, mode):
    rng = np.random.default_rng(0)
    x = _inputs(rng, dtype, q_lens=[5, 1, 3], past=[0, 17, 30])
    before = {k: v.copy() for k, v in x.items()}
    sess = InferenceSession(paged_attention_model(x, ATTRS), providers=["CPUExecutionProvider"], paged_attention=mode)
    # auto: ortpa's native CPU kernel (the package builds it); portable: the standard-op lowering
    expected = "portable" if mode == "portable" else "native-cpu"
    assert sess.implementations == {"PagedAttention_0": expected}
    assert (sess.portable_nodes, sess.native_nodes) == (
        (["PagedAttention_0"], []) if mode == "portable" else ([], ["PagedAttention_0"])
    )
    out, kc, vc = sess.run(None, x)
    ref_out, ref_kc, ref_vc = _oracle(x)
    assert_close(out, ref_out, dtype, what="output")
    np.testing.assert_array_equal(kc.view(np.uint8), ref_kc.view(np.uint8))
    np.testing.assert_array_equal(vc.view(np.uint8), ref_vc.view(np.uint8))
    for k, v in x.items():  # plain run returns new cache arrays; the caller's inputs are untouched
        np.testing.assert_array_equal(v.view(np.uint8), before[k].view(np.uint8), err_msg=k)
    assert [i.name for i in sess.get_inputs()][:3] == ["query", "key", "value"]
    assert [o.name for o in sess.get_outputs()] == ["output", "key_cache_out", "value_cache_out"]


def test_unsupported_mode_raises_before_any_session():
    rng = np.random.default_rng(1)
    x = _inputs(rng, np.float16, q_lens=[2], past=[0])
    x["key_cache"] = x["key_cache"].astype(ml_dtypes.float8_e4m3fn)
    x["value_cache"] = x["value_cache"].astype(ml_dtypes.float8_e4m3fn)
    x["k_scale"] = np.ones([1], np.float32)
    x["v_scale"] = np.ones([1], np.float32)
    attrs = {**ATTRS, "k_quant_type": "PER_TENSOR", "v_quant_type": "PER_TENSOR"}
    with pytest.raises(NotImplementedByBackend) as info:  # float8 caches: the portable lowering has none
        InferenceSession(
            paged_attention_model(x, attrs), providers=["CPUExecutionProvider"], paged_attention="portable"
        )
    assert info.value.backend == "portable"


def test_invalid_node_raises_invalid_argument():
    rng = np.random.default_rng(2)
    x = _inputs(rng, np.float16, q_lens=[2], past=[0])
    model = paged_attention_model(x, {"num_heads": NH, "kv_num_heads": 3})  # 4 % 3 != 0
    with pytest.raises(InvalidArgument):
        InferenceSession(model, providers=["CPUExecutionProvider"])


def _drive(dtype, steps, q_schedule, attrs=ATTRS, model=None, layers=1):
    """Prefill + decode steps through the aliased PagedSession and through the oracle; compare each step."""
    rng = np.random.default_rng(3)
    proto_inputs = _inputs(rng, dtype, q_lens=[1], past=[0])
    model = model or paged_attention_model(proto_inputs, attrs)
    sess = PagedSession(model, num_blocks=NB, block_size=BS, providers=["CPUExecutionProvider"])
    ptrs = sess.data_ptrs()
    kv = PagedKVCache(NB, BS)
    ref_caches = {name: sess.cache(name) for name in sess.cache_names}
    seq_ids = list(range(len(q_schedule[0])))
    for s in seq_ids:
        kv.add_sequence(s)
    for step in range(steps):
        q_lens = q_schedule[min(step, len(q_schedule) - 1)]
        plan = kv.plan_step(list(zip(seq_ids, q_lens, strict=True)))
        t = plan.num_tokens
        feeds = {
            "query": rng.standard_normal((t, NH * H)).astype(dtype),
            "key": rng.standard_normal((t, KVH * H)).astype(dtype),
            "value": rng.standard_normal((t, KVH * H)).astype(dtype),
            "cumulative_sequence_length": plan.cumulative_sequence_length,
            "past_seqlens": plan.past_seqlens,
            "block_table": plan.block_table,
        }
        got = sess.run(feeds)
        ref_out, ref_kc, ref_vc = _oracle(
            {**feeds, "key_cache": ref_caches["key_cache"], "value_cache": ref_caches["value_cache"]}, attrs
        )
        ref_caches = {"key_cache": ref_kc, "value_cache": ref_vc}
        assert_close(got["output"], ref_out, dtype, what=f"step {step} output")
        assert sess.data_ptrs() == ptrs, f"step {step}: a cache buffer moved (a copy was made)"
    return sess, ref_caches


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["fp16", "bf16"])
def test_paged_session_prefill_and_decode_steps_match_oracle_in_place(dtype):
    # prefill 3 sequences of different lengths, then 9 decode steps crossing block boundaries
    sess, ref = _drive(dtype, steps=10, q_schedule=[[7, 19, 3], [1, 1, 1]])
    for name in sess.cache_names:
        np.testing.assert_array_equal(sess.cache(name).view(np.uint8), ref[name].view(np.uint8), err_msg=name)


def test_cache_outputs_alias_cache_inputs():
    x = _inputs(np.random.default_rng(4), np.float16, q_lens=[1], past=[0])
    aliases = find_cache_aliases(paged_attention_model(x, ATTRS))
    assert [(a.input_name, a.output_name) for a in aliases] == [
        ("key_cache", "key_cache_out"),
        ("value_cache", "value_cache_out"),
    ]


def test_paged_session_copy_blocks_and_write_cache():
    x = _inputs(np.random.default_rng(5), np.float16, q_lens=[1], past=[0])
    sess = PagedSession(paged_attention_model(x, ATTRS), num_blocks=NB, block_size=BS)
    seed = np.random.default_rng(6).standard_normal((NB, BS, KVH, H)).astype(np.float16)
    sess.write_cache("key_cache", seed)
    sess.copy_blocks([(2, 7)])
    got = sess.cache("key_cache")
    np.testing.assert_array_equal(got[7], seed[2])
    np.testing.assert_array_equal(np.delete(got, 7, axis=0), np.delete(seed, 7, axis=0))
    with pytest.raises(ValueError, match="expected"):
        sess.write_cache("key_cache", seed[:2])


def _two_layer_model(dtype_proto=TensorProto.FLOAT16) -> onnx.ModelProto:
    """Two PagedAttention layers: layer 1's query is layer 0's output; each layer owns its caches."""
    nodes, inputs = [], []
    shared = [
        helper.make_tensor_value_info("cumulative_sequence_length", TensorProto.INT32, ["B1"]),
        helper.make_tensor_value_info("past_seqlens", TensorProto.INT32, ["B"]),
        helper.make_tensor_value_info("block_table", TensorProto.INT32, ["B", "MB"]),
    ]
    inputs.append(helper.make_tensor_value_info("query", dtype_proto, ["T", NH * H]))
    outputs = []
    query = "query"
    for i in range(2):
        for n in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"{n}.{i}", dtype_proto, ["T", KVH * H]))
        for n in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past.{i}.{n}", dtype_proto, ["NB", "BS", KVH, H]))
            outputs.append(helper.make_tensor_value_info(f"present.{i}.{n}", dtype_proto, ["NB", "BS", KVH, H]))
        out = f"attn.{i}"
        nodes.append(
            helper.make_node(
                "PagedAttention",
                [
                    query,
                    f"key.{i}",
                    f"value.{i}",
                    f"past.{i}.key",
                    f"past.{i}.value",
                    "cumulative_sequence_length",
                    "past_seqlens",
                    "block_table",
                ],
                [out, f"present.{i}.key", f"present.{i}.value"],
                name=f"layer{i}",
                domain="com.microsoft",
                **ATTRS,
            )
        )
        query = out
    outputs.insert(0, helper.make_tensor_value_info("attn.1", dtype_proto, ["T", NH * H]))
    graph = helper.make_graph(nodes, "two_layers", inputs + shared, outputs)
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)], ir_version=10
    )


def test_multi_layer_model_paged_session_matches_oracle():
    model = _two_layer_model()
    sess = PagedSession(model, num_blocks=NB, block_size=BS)
    assert sorted(sess.cache_names) == sorted(f"past.{i}.{n}" for i in range(2) for n in ("key", "value"))
    ptrs = sess.data_ptrs()
    rng = np.random.default_rng(7)
    kv = PagedKVCache(NB, BS)
    for s in range(2):
        kv.add_sequence(s)
    ref = {name: sess.cache(name) for name in sess.cache_names}
    for step, q_lens in enumerate([[4, 9], [1, 1], [1, 1], [1, 1]]):
        plan = kv.plan_step([(0, q_lens[0]), (1, q_lens[1])])
        t = plan.num_tokens
        index = {
            "cumulative_sequence_length": plan.cumulative_sequence_length,
            "past_seqlens": plan.past_seqlens,
            "block_table": plan.block_table,
        }
        feeds = {"query": rng.standard_normal((t, NH * H)).astype(np.float16), **index}
        for i in range(2):
            feeds[f"key.{i}"] = rng.standard_normal((t, KVH * H)).astype(np.float16)
            feeds[f"value.{i}"] = rng.standard_normal((t, KVH * H)).astype(np.float16)
        got = sess.run(feeds)
        query = feeds["query"]
        for i in range(2):
            query, ref[f"past.{i}.key"], ref[f"past.{i}.value"] = paged_attention(
                query,
                feeds[f"key.{i}"],
                feeds[f"value.{i}"],
                ref[f"past.{i}.key"],
                ref[f"past.{i}.value"],
                **index,
                **ATTRS,
            )
        assert_close(got["attn.1"], query, np.float16, what=f"step {step}")
        assert sess.data_ptrs() == ptrs
    for name in sess.cache_names:
        np.testing.assert_array_equal(sess.cache(name), ref[name], err_msg=name)


def test_paged_session_rejects_feeding_a_cache_and_bad_dims():
    x = _inputs(np.random.default_rng(8), np.float16, q_lens=[1], past=[0])
    model = paged_attention_model(x, ATTRS)
    sess = PagedSession(model, num_blocks=NB, block_size=BS)
    with pytest.raises(ValueError, match="owned by this PagedSession"):
        sess.run({"key_cache": x["key_cache"]})
    with pytest.raises(InvalidParameter, match="symbolic"):
        PagedSession(model, num_blocks=NB)  # block_size is symbolic in the model and not given


# ------------------------------------------------------------------------------------------------ bad models
def test_a_model_only_onnx_runtime_rejects_is_an_invalid_model_naming_the_file(tmp_path):
    """Weights whose dims no longer fit their MatMul pass ortpa's file checks; ORT's error is typed and named.

    On the portable path: ortpa's native custom op declares no shape inference (docs/native.md), so ONNX Runtime
    finds this mismatch behind it only when the graph runs."""
    from ortpa.errors import InvalidModel
    from ortpa.testing.toy_lm import build_toy_lm

    model = build_toy_lm()
    weight = next(t for t in model.graph.initializer if t.name == "lm_head")
    rows, cols = weight.dims
    del weight.dims[:]
    weight.dims.extend([rows * 2, cols // 2])
    path = tmp_path / "bad.onnx"
    onnx.save(model, path)
    portable = {"paged_attention": "portable"}
    for make in (lambda p: InferenceSession(p, **portable), lambda p: PagedSession(p, num_blocks=4, **portable)):
        with pytest.raises(InvalidModel, match="ONNX Runtime rejected it") as info:
            make(str(path))
        assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_a_pool_larger_than_the_device_is_refused_before_allocating(monkeypatch):
    from ortpa.errors import KVPoolTooLarge
    from ortpa.runtime import kv_memory
    from ortpa.testing.toy_lm import build_toy_lm

    total = kv_memory.device_memory_bytes("cpu")
    assert total is not None and total > 2**26
    model = build_toy_lm()
    with pytest.raises(KVPoolTooLarge, match="the KV caches need") as info:
        PagedSession(model, num_blocks=2**40, block_size=16)  # petabytes: np.zeros would not refuse this itself
    assert info.value.requested > total == info.value.available
    fits = PagedSession(model, num_blocks=8, block_size=16)
    need = sum(fits.cache(n).nbytes for n in fits.cache_names)
    monkeypatch.setattr(kv_memory, "device_memory_bytes", lambda device, device_id=0: need - 1)
    with pytest.raises(KVPoolTooLarge):
        PagedSession(model, num_blocks=8, block_size=16)
    monkeypatch.setattr(kv_memory, "device_memory_bytes", lambda device, device_id=0: need)
    PagedSession(model, num_blocks=8, block_size=16)  # exactly the device's size is not refused
