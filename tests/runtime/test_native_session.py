"""ortpa's native CPU PagedAttention through the runtime: the default on CPU, against the dense NumPy model, the
oracle and the portable path; the in-place cache update; forcing a path; running without the library."""

from __future__ import annotations

import ctypes
import logging

import ml_dtypes
import numpy as np
import onnxruntime as ort
import pytest
from support.parity import FIXTURES, run_parity
from support.tolerances import assert_close

from ortpa.errors import InvalidParameter
from ortpa.ops.native import ENV_LIBRARY, ENV_MODE, native_library, reset_native_library
from ortpa.ops.oracle import paged_attention
from ortpa.ops.portable import paged_attention_model
from ortpa.runtime.engine import Engine
from ortpa.runtime.kv import PagedKVCache
from ortpa.runtime.ortvalues import to_ortvalue
from ortpa.runtime.sampling import SamplingParams
from ortpa.runtime.session import InferenceSession, PagedSession
from ortpa.testing.toy_lm import ToyLMConfig, build_toy_lm, toy_lm_reference, toy_lm_weights

CPU = ["CPUExecutionProvider"]
BS = 16  # the op's smallest block size (rule 1.5.2), which the native kernel checks as ONNX Runtime's kernels do
NH, KVH, H, NB = 4, 2, 16, 8
ATTRS = {"num_heads": NH, "kv_num_heads": KVH}


@pytest.fixture(autouse=True)
def _default_mode(monkeypatch):
    monkeypatch.delenv(ENV_MODE, raising=False)


def _copies() -> int:
    library = native_library()
    assert library is not None, "ortpa's native library is not built (python setup.py build_ext --inplace)"
    fn = ctypes.CDLL(str(library.path)).ortpa_native_cache_copies
    fn.restype = ctypes.c_uint64
    return int(fn())


# -- converted models run natively by default -----------------------------------------------------------------
def test_toy_gqa_model_runs_native_by_default_and_matches_the_dense_model():
    cfg = ToyLMConfig()
    weights = toy_lm_weights(cfg)
    sess = PagedSession(build_toy_lm(cfg, weights), num_blocks=16, block_size=BS, providers=CPU)
    assert set(sess.session.implementations.values()) == {"native-cpu"}
    assert len(sess.session.implementations) == cfg.num_layers
    kv = PagedKVCache(16, BS)
    seqs = [[5, 9, 2, 33, 7, 1, 60, 4, 4, 8, 1, 2, 3, 9, 10, 11, 12], [11, 3, 8]]  # batched: different lengths
    for s in range(2):
        kv.add_sequence(s)
    new = [list(s) for s in seqs]
    for step in range(4):  # prefill both, then decodes (the first sequence's second crosses a block boundary)
        plan = kv.plan_step([(s, len(new[s])) for s in range(2)])
        feeds = {
            "input_ids": np.array(new[0] + new[1], np.int64),
            "cumulative_sequence_lengths": plan.cumulative_sequence_length,
            "past_sequence_lengths": plan.past_seqlens,
            "block_table": plan.block_table,
            "attention_metadata": plan.attention_metadata,
        }
        logits = sess.run(feeds)["logits"]
        for s in range(2):
            ref = toy_lm_reference(cfg, weights, seqs[s])[-1]
            assert_close(logits[s], ref, np.float16, what=f"step {step}, sequence {s}")
            seqs[s].append(int(np.argmax(ref)))
            new[s] = [seqs[s][-1]]


def test_engine_greedy_tokens_equal_the_portable_paths():
    model = build_toy_lm(ToyLMConfig(seed=3))
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9] * 7, [3], list(range(10, 40))]
    params = SamplingParams(max_new_tokens=12)
    tokens = {}
    for mode in ("auto", "portable"):
        engine = Engine(model, num_blocks=64, block_size=BS, providers=CPU, paged_attention=mode)
        expected = "native-cpu" if mode == "auto" else "portable"
        assert set(engine.session.session.implementations.values()) == {expected}
        tokens[mode] = engine.generate(prompts, params)
    assert tokens["auto"] == tokens["portable"]
    assert all(len(t) == 12 for t in tokens["auto"])


def test_converted_mla_model_runs_native_within_the_dense_models_precision(tmp_path):
    """A DeepSeek-V3-style dense MLA export, converted (LATENT), then the parity driver's continuous
    batching on the default CPU path against the dense original."""
    import onnx

    from ortpa.conversion import convert_file

    dense = FIXTURES / "dsv3_sdpa_op18.onnx"
    out = tmp_path / "paged.onnx"
    convert_file(dense, out, verify=False)  # the parity run below is the check, on the native path
    sess = InferenceSession(str(out), providers=CPU)
    assert set(sess.implementations.values()) == {"native-cpu"}
    result = run_parity(onnx.load(str(out)), dense, steps=6)
    assert result.tokens_checked > 0


# -- the caches are updated in place -------------------------------------------------------------------------
def _single_node_inputs(rng, cache_dtype):
    q_lens, past = [3, 1], [0, 20]
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    x = {
        "query": rng.standard_normal((sum(q_lens), NH * H)).astype(np.float16),
        "key": rng.standard_normal((sum(q_lens), KVH * H)).astype(np.float16),
        "value": rng.standard_normal((sum(q_lens), KVH * H)).astype(np.float16),
        "key_cache": rng.standard_normal((NB, BS, KVH, H)).astype(cache_dtype),
        "value_cache": rng.standard_normal((NB, BS, KVH, H)).astype(cache_dtype),
        "cumulative_sequence_length": cu,
        "past_seqlens": np.asarray(past, np.int32),
        "block_table": np.array([[5, 2], [0, 7]], np.int32),
    }
    attrs = dict(ATTRS)
    if cache_dtype != np.float16:
        x["k_scale"] = np.array([0.5], np.float32)
        x["v_scale"] = np.array([0.25], np.float32)
        attrs.update(k_quant_type="PER_TENSOR", v_quant_type="PER_TENSOR")
    return x, attrs


@pytest.mark.parametrize("cache_dtype", [np.float16, ml_dtypes.float8_e4m3fn], ids=["fp16", "fp8"])
def test_distinct_output_buffers_get_one_copy_and_match_the_oracle(cache_dtype):
    x, attrs = _single_node_inputs(np.random.default_rng(0), cache_dtype)
    before = {k: v.copy() for k, v in x.items()}
    model = paged_attention_model(x, attrs)
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(native_library().path))
    sess = ort.InferenceSession(model.SerializeToString(), options, providers=CPU)
    io = sess.io_binding()
    values = {name: to_ortvalue(value, "cpu") for name, value in x.items()}
    for name, value in values.items():
        io.bind_ortvalue_input(name, value)
    for name in ("output", "key_cache_out", "value_cache_out"):
        io.bind_output(name, "cpu")  # ONNX Runtime allocates each output: distinct from the inputs
    copies = _copies()
    sess.run_with_iobinding(io)
    assert _copies() - copies == 2  # key and value cache, once each
    out, kc, vc = (v.numpy() for v in io.get_outputs())
    ref_out, ref_kc, ref_vc = paged_attention(**x, **attrs)
    assert_close(out, ref_out, np.float16, what="output")
    np.testing.assert_array_equal(kc.view(np.uint8), np.asarray(ref_kc).view(np.uint8))
    np.testing.assert_array_equal(vc.view(np.uint8), np.asarray(ref_vc).view(np.uint8))
    for k, v in x.items():  # the inputs stay as they were
        np.testing.assert_array_equal(v.view(np.uint8), before[k].view(np.uint8), err_msg=k)


def test_a_cache_bound_to_one_buffer_is_updated_in_place_without_a_copy():
    x, attrs = _single_node_inputs(np.random.default_rng(1), np.float16)
    model = paged_attention_model(x, attrs)  # cache dims 0 and 1 symbolic: PagedSession allocates the pool
    sess = PagedSession(model, num_blocks=NB, block_size=BS, providers=CPU)
    assert sess.session.implementations == {"PagedAttention_0": "native-cpu"}
    sess.write_cache("key_cache", x["key_cache"])
    sess.write_cache("value_cache", x["value_cache"])
    pointers = sess.data_ptrs()
    copies = _copies()
    out = sess.run({k: v for k, v in x.items() if "cache" not in k})["output"]
    assert _copies() == copies  # the kernel wrote the bound buffer itself
    assert sess.data_ptrs() == pointers
    ref_out, ref_kc, ref_vc = paged_attention(**x, **attrs)
    assert_close(out, ref_out, np.float16, what="output")
    np.testing.assert_array_equal(sess.cache("key_cache"), ref_kc)
    np.testing.assert_array_equal(sess.cache("value_cache"), ref_vc)
    assert not np.array_equal(sess.cache("key_cache"), x["key_cache"])  # the new rows are there


# -- forcing a path -------------------------------------------------------------------------------------------
def test_the_option_and_the_environment_force_a_path(monkeypatch):
    x, attrs = _single_node_inputs(np.random.default_rng(2), np.float16)
    model = paged_attention_model(x, attrs)
    assert InferenceSession(model, providers=CPU).implementations == {"PagedAttention_0": "native-cpu"}
    forced = InferenceSession(model, providers=CPU, paged_attention="portable")
    assert forced.implementations == {"PagedAttention_0": "portable"}
    monkeypatch.setenv(ENV_MODE, "portable")
    assert InferenceSession(model, providers=CPU).implementations == {"PagedAttention_0": "portable"}
    # the option wins over the environment
    assert InferenceSession(model, providers=CPU, paged_attention="native").implementations == {
        "PagedAttention_0": "native-cpu"
    }
    monkeypatch.setenv(ENV_MODE, "fast")
    with pytest.raises(InvalidParameter, match="ORTPA_PAGED_ATTENTION"):
        InferenceSession(model, providers=CPU)


def test_a_block_size_the_native_kernel_refuses_runs_portable_unless_native_is_forced():
    model = build_toy_lm(ToyLMConfig())
    small = PagedSession(model, num_blocks=8, block_size=4, providers=CPU)
    assert set(small.session.implementations.values()) == {"portable"}
    with pytest.raises(InvalidParameter, match=r"rule 1\.5\.2"):
        PagedSession(model, num_blocks=8, block_size=4, providers=CPU, paged_attention="native")


# -- without the library ------------------------------------------------------------------------------------
@pytest.fixture
def no_library(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV_LIBRARY, str(tmp_path / "missing.so"))
    reset_native_library()
    yield
    monkeypatch.undo()
    reset_native_library()


def test_without_the_library_sessions_run_portable_and_say_so_once(no_library, caplog):
    assert native_library() is None
    model = build_toy_lm(ToyLMConfig())
    with caplog.at_level(logging.WARNING, logger="ortpa.native"):
        engines = [Engine(model, num_blocks=32, block_size=BS, providers=CPU) for _ in range(2)]
    notices = [r for r in caplog.records if r.name == "ortpa.native"]
    assert len(notices) == 1
    assert "portable lowering" in notices[0].getMessage() and "missing.so" in notices[0].getMessage()
    assert set(engines[0].session.session.implementations.values()) == {"portable"}
    tokens = engines[0].generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))
    assert len(tokens[0]) == 4
    with pytest.raises(InvalidParameter, match="native library"):
        InferenceSession(model, providers=CPU, paged_attention="native")
