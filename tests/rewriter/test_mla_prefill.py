"""MLA prefill in the expanded form (``ortpa.rewriter.mla_expanded``): structure, parity, batched = alone, cache.

The schedule below puts every kind of row in its first two steps: step 0 prefills fresh prompts of 1, 17 and 300+
tokens and the first chunk of a chunked prompt (all expanded); step 1 decodes those sequences (absorbed), runs the
chunked prompt's second chunk over its cached prefix (absorbed) and a new fresh prompt (expanded), all in one
step; steps 2 and 3 decode every sequence (each decode reads the rows the decodes before it wrote). Each
sequence's logits are held to the dense model run alone, and to the all-absorbed conversion.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from support.parity import DenseModel
from support.tolerances import assert_close

from ortpa.errors import ConversionError
from ortpa.rewriter.mla_expanded import Composite, attention_flops_per_token
from ortpa.rewriter.options import RewriteOptions
from ortpa.rewriter.per_sequence.flow import Kind, analyse
from ortpa.rewriter.pipeline import convert
from ortpa.runtime.kv import PagedKVCache
from ortpa.runtime.session import PagedSession
from ortpa.testing.dense_mla import DenseMlaConfig
from ortpa.testing.dense_mla_file import write_dense_mla
from ortpa.testing.sweep.space import draw

BLOCK_SIZE, NUM_BLOCKS = 16, 48
CONFIG = DenseMlaConfig(max_position_embeddings=512, seed=3)
# step 0: fresh prompts (and the first chunk of E); step 1: decodes, E's second chunk over its prefix, fresh D
STEP0 = {"A": 1, "B": 17, "C": 310, "E": 24}
STEP1 = {"A": 1, "B": 1, "C": 1, "E": 16, "D": 9}
DECODES = 2  # decode steps after step 1, every sequence one token each


@pytest.fixture(scope="module")
def dense_path(tmp_path_factory):
    return write_dense_mla(CONFIG, tmp_path_factory.mktemp("mla_prefill") / "dense.onnx")


@pytest.fixture(scope="module")
def models(dense_path):
    return {form: convert(str(dense_path), mla_prefill=form) for form in ("expanded", "absorbed")}


def _tokens(seed: int) -> dict[str, list[int]]:
    rng = np.random.default_rng(seed)
    total = {n: STEP0.get(n, 0) + STEP1[n] + DECODES for n in STEP1}
    return {n: [int(t) for t in rng.integers(0, CONFIG.vocab, total[n])] for n in total}


class _Runner:
    """One converted model through PagedSession with its own block pool; returns each sequence's last logits."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.sess = PagedSession(
            model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, providers=["CPUExecutionProvider"]
        )
        self.kv = PagedKVCache(NUM_BLOCKS, BLOCK_SIZE)
        self.wanted = {i.name for i in self.sess.session.get_inputs()}
        self.done: dict[str, int] = {}

    def step(self, chunks: dict[str, list[int]]) -> dict[str, np.ndarray]:
        for name in chunks:
            if name not in self.done:
                self.kv.add_sequence(name)
                self.done[name] = 0
        plan = self.kv.plan_step([(n, len(ids)) for n, ids in chunks.items()])
        feed = {
            "input_ids": np.array([t for ids in chunks.values() for t in ids], np.int64),
            "cumulative_sequence_lengths": plan.cumulative_sequence_length,
            "past_sequence_lengths": plan.past_seqlens,
            "block_table": plan.block_table,
            "attention_metadata": plan.attention_metadata,
            "position_ids": plan.positions,
        }
        logits = self.sess.run({k: v for k, v in feed.items() if k in self.wanted})["logits"]
        for n, ids in chunks.items():
            self.done[n] += len(ids)
        return {n: np.asarray(logits[j], np.float32) for j, n in enumerate(chunks)}


def _schedule(tokens: dict[str, list[int]]) -> list[dict[str, list[int]]]:
    s0 = {n: tokens[n][:k] for n, k in STEP0.items()}
    s1 = {n: tokens[n][STEP0.get(n, 0) : STEP0.get(n, 0) + k] for n, k in STEP1.items()}
    decodes = [{n: [tokens[n][STEP0.get(n, 0) + STEP1[n] + d]] for n in STEP1} for d in range(DECODES)]
    return [s0, s1, *decodes]


def test_structure_and_default(models):
    """Expanded is the default; it keeps one LATENT node per layer (for the absorbed rows) whose cache output gets
    the fresh rows by one ScatterND before it becomes the graph output; the absorbed conversion has none."""
    exp, absd = models["expanded"], models["absorbed"]
    meta = lambda m: {p.key: p.value for p in m.metadata_props}  # noqa: E731
    assert meta(exp)["ortpa.mla_prefill"] == "expanded"
    assert meta(absd)["ortpa.mla_prefill"] == "absorbed"
    assert RewriteOptions().mla_prefill == "expanded"
    for model, writes in ((exp, 2), (absd, 0)):
        paged = [n for n in model.graph.node if n.op_type == "PagedAttention"]
        assert len(paged) == 2
        outputs = {o.name for o in model.graph.output}
        scatters = [n for n in model.graph.node if n.op_type == "ScatterND" and n.output[0] in outputs]
        assert len(scatters) == writes
        assert {s.input[0] for s in scatters} == ({p.output[1] for p in paged} if writes else set())
        assert sorted(s.output[0] for s in scatters) == (["present.0.key", "present.1.key"] if writes else [])


def test_default_conversion_is_expanded_and_portable_write_is_folded(models):
    from ortpa.ops.portable import lower_to_portable

    lowered = lower_to_portable(models["expanded"])
    outputs = {o.name for o in lowered.graph.output}
    assert not [n for n in lowered.graph.node if n.op_type == "ScatterND" and n.output[0] in outputs]
    calls = [n for n in lowered.graph.node if "present.0.key" in n.output]
    assert len(calls) == 1 and calls[0].domain == "ortpa.portable"  # the layer call writes the cache itself


def test_parity_fresh_prefix_and_mixed(dense_path, models):
    """1 / 17 / 310-token fresh prompts, a prefix-cached chunk, decodes and a fresh prompt in one step, then two
    decode steps: each sequence's logits against the dense model alone and against the all-absorbed conversion."""
    tokens = _tokens(0)
    dense = DenseModel(dense_path)
    states = {n: dense.new() for n in STEP1}
    runners = {form: _Runner(m) for form, m in models.items()}
    for k, chunks in enumerate(_schedule(tokens)):
        got = {form: r.step(chunks) for form, r in runners.items()}
        for name, ids in chunks.items():
            ref = dense.step(states[name], ids)
            what = f"step {k}, sequence {name} ({len(ids)} new tokens)"
            assert_close(got["expanded"][name], ref, np.float16, what=f"{what}: expanded vs dense")
            assert_close(got["expanded"][name], got["absorbed"][name], np.float16, what=f"{what}: vs absorbed")
            assert int(got["expanded"][name].argmax()) == int(ref.argmax()), what


def test_batched_equals_alone(models):
    """Every sequence of the mixed step, run with the others and run alone after the same history: the same
    logits (within float16) and the same greedy token."""
    tokens = _tokens(1)
    s0, s1 = _schedule(tokens)[:2]
    batched = _Runner(models["expanded"])
    batched.step(s0)
    together = batched.step(s1)
    alone = _Runner(models["expanded"])  # one sequence per step: its blocks are its own, as in a pool of its own
    for name in s1:
        if name in s0:
            alone.step({name: s0[name]})
        row = alone.step({name: s1[name]})[name]
        assert_close(together[name], row, np.float16, what=f"sequence {name}: batched vs alone")
        assert int(together[name].argmax()) == int(row.argmax()), name


def _assert_same_cache_rows(exp: _Runner, absd: _Runner, what: str) -> None:
    """Every row either runner has written so far (each sequence's positions through its block table, the same
    allocation order in both pools) equal within float16, and written (not zero)."""
    slots = []
    for name, length in exp.done.items():
        table = exp.kv.block_ids(name)
        assert table == absd.kv.block_ids(name)
        slots += [(table[p // BLOCK_SIZE], p % BLOCK_SIZE) for p in range(length)]
    for cache in exp.sess.cache_names:
        a, b = exp.sess.cache(cache), absd.sess.cache(cache)
        rows_a = np.stack([a[blk, off] for blk, off in slots]).astype(np.float32)
        rows_b = np.stack([b[blk, off] for blk, off in slots]).astype(np.float32)
        assert (np.abs(rows_a).max(axis=-1) > 0).all(), f"{what}, {cache}: a row the expanded model never wrote"
        assert_close(rows_a, rows_b, np.float16, what=f"{what}, {cache}: expanded vs absorbed rows")


def test_cache_written_by_expanded_prefill_equals_absorbed(models):
    s0 = _schedule(_tokens(2))[0]
    runners = {form: _Runner(m) for form, m in models.items()}
    for r in runners.values():
        r.step(s0)
    _assert_same_cache_rows(runners["expanded"], runners["absorbed"], "prefill")


# MLA attentions of the sweep's deepseek space (ortpa.testing.sweep.space): deepseek_v3 seed 1 is the draw whose
# report this test answers (8 heads, no q LoRA, nope 64 / rope 32 / v 16, interleaved rope); minicpm3 seed 3 eight
# heads with a q LoRA, latent 32, v wider than nope, NeoX rope; deepseek_v3 seed 3 (slow tier) two wide heads
SAMPLED = [("deepseek_v3", 1), ("minicpm3", 3), pytest.param("deepseek_v3", 3, marks=pytest.mark.slow)]


def _sampled(family: str, seed: int) -> DenseMlaConfig:
    """The draw's attention (heads, q LoRA, latent, nope / rope / v widths, rope layout, hidden size) as a 2-layer
    dense fixture: no MoE (a float16 router's near-ties would flip experts, which is not what is tested here)."""
    c = draw(family, seed).config
    return DenseMlaConfig(
        hidden=c["hidden_size"],
        heads=c["num_attention_heads"],
        q_lora_rank=c["q_lora_rank"],
        kv_lora_rank=c["kv_lora_rank"],
        qk_nope=c["qk_nope_head_dim"],
        qk_rope=c["qk_rope_head_dim"],
        v_head=c["v_head_dim"],
        rope_interleave=c.get("rope_interleave", family != "minicpm3"),
        seed=seed,
    )


@pytest.mark.parametrize(("family", "seed"), SAMPLED)
def test_decodes_after_a_prefill_past_one_block(family, seed, tmp_path):
    """A 19-token prompt (past one 16-row block) prefilled expanded, batched with a 3-token one, then four decode
    steps: each step's logits against the dense model alone and against the absorbed conversion, and every cache
    row written so far against the absorbed conversion's (a decode's own write lost or overwritten, or a slot
    past the first block, shows at the step it happens)."""
    config = _sampled(family, seed)
    dense_path = write_dense_mla(config, tmp_path / "dense.onnx")
    runners = {form: _Runner(convert(str(dense_path), mla_prefill=form)) for form in ("expanded", "absorbed")}
    dense = DenseModel(dense_path)
    lengths, decodes = {"long": 19, "short": 3}, 4
    rng = np.random.default_rng(seed)
    tokens = {n: [int(t) for t in rng.integers(0, config.vocab, k + decodes)] for n, k in lengths.items()}
    steps = [{n: tokens[n][:k] for n, k in lengths.items()}]
    steps += [{n: [tokens[n][k + d]] for n, k in lengths.items()} for d in range(decodes)]
    states = {n: dense.new() for n in lengths}
    for k, chunks in enumerate(steps):
        got = {form: r.step(chunks) for form, r in runners.items()}
        what = f"{family} seed {seed}, step {k}"
        for name, ids in chunks.items():
            ref = dense.step(states[name], ids)
            assert_close(got["expanded"][name], ref, np.float16, what=f"{what}, {name}: expanded vs dense")
            assert_close(got["expanded"][name], got["absorbed"][name], np.float16, what=f"{what}, {name}: vs absorbed")
        _assert_same_cache_rows(runners["expanded"], runners["absorbed"], what)


def test_expanded_not_applied_says_why(dense_path):
    model = convert(str(dense_path), rope_in_op=True, mla_prefill="expanded")
    reason = {p.key: p.value for p in model.metadata_props}["ortpa.mla_prefill"]
    assert reason.startswith("absorbed: ") and "rope_in_op" in reason
    with pytest.raises(ConversionError, match="mla_prefill"):
        convert(str(dense_path), mla_prefill="latent")


def test_flow_composite_follows_its_inputs():
    """A composite is per token when its data inputs are, and step-wide (refused) when one of them mixes the
    step's tokens; its inner nodes are its own."""
    x = ir.val("x", ir.DataType.FLOAT, ir.Shape(["num_tokens", 4]))
    mixed = ir.node("ReduceSum", [x], attributes={"keepdims": 1}, num_outputs=1)
    inner = ir.node("Relu", [x])
    for data, want in ((x, "token"), (mixed.outputs[0], "step")):
        out = ir.node("Add", [inner.outputs[0], data])
        composite = Composite(out.outputs[0], 2, 0, (data,), frozenset({inner}))
        flow = analyse([mixed, inner, out], {x: Kind("token", 2, 0)}, set(), composites=[composite])
        assert flow.of(out.outputs[0]).tag == want


def test_attention_flops_per_token():
    """Counted by hand for one head (L=4, P=2, R=1, V=2) and a 3-token prompt (2 keys per query on average):
    absorbed 2*2*((4+1)+4) scores+values + 2*(2*4 + 4*2) for q@W_UK and o@W_UV = 68; expanded 2*2*((2+1)+2) +
    2*4*(2+2) for the up-projection = 52. At V2-Lite dims the long-prompt ratio nears (576+512)/(192+128)."""
    tiny = attention_flops_per_token(3, num_heads=1, kv_lora_rank=4, qk_nope=2, qk_rope=1, v_head=2)
    assert (tiny["absorbed"], tiny["expanded"]) == (68, 52)
    dims = dict(num_heads=16, kv_lora_rank=512, qk_nope=128, qk_rope=64, v_head=128)
    assert 3.1 < attention_flops_per_token(8192, **dims)["ratio"] < (576 + 512) / (192 + 128)


def test_portable_file_with_split_latent_matches(dense_path, models, tmp_path):
    """``convert --portable``: the fresh rows' write folded into each layer call, split over the key and value
    halves of the row as genai allocates them; same logits as the native file through the session."""
    import ortpa

    out = tmp_path / "model.onnx"
    ortpa.convert_file(dense_path, out, portable=True, verify=False)
    lowered = onnx.load(str(out))
    assert not [n for n in lowered.graph.node if n.op_type in ("PagedAttention", "ScatterND")]
    tokens = _tokens(4)
    runners = {"native": _Runner(models["expanded"]), "lowered": _Runner(lowered)}
    for chunks in _schedule(tokens):
        got = {k: r.step(chunks) for k, r in runners.items()}
        for name in chunks:
            assert_close(got["lowered"][name], got["native"][name], np.float16, what=name)


def test_native_order_writes_fresh_rows_first(models):
    """For a natively run node (CUDA: key_cache_out must be its input's buffer) the fresh rows' ScatterND moves
    before the node: it reads the cache input and writes the graph output, which the node then reads as its
    key_cache with no key_cache_out; the reordered graph is still valid for the CUDA kernel's rules."""
    from ortpa.ops.trailing_write import write_before_native
    from ortpa.ops.validate import validate_model

    model = models["expanded"]
    names = [n.name for n in model.graph.node if n.op_type == "PagedAttention"]
    native = write_before_native(model, names)
    order = [n.op_type for n in native.graph.node]
    for i in range(2):
        (sc,) = [n for n in native.graph.node if n.op_type == "ScatterND" and n.output[0] == f"present.{i}.key"]
        (pa,) = [n for n in native.graph.node if n.op_type == "PagedAttention" and n.input[3] == f"present.{i}.key"]
        assert sc.input[0] == f"past_key_values.{i}.key" and len(pa.output) == 1
        assert list(native.graph.node).index(sc) < list(native.graph.node).index(pa)
    assert order.count("ScatterND") == order.count("PagedAttention") == 2
    assert validate_model(native, backend="cuda").ok
    assert write_before_native(model, []) == model  # portable nodes keep the fold-friendly order


@pytest.mark.cuda
def test_expanded_native_cuda_matches_absorbed(models):
    """On CUDA: the expanded model (native LATENT node, fresh rows written first) against the absorbed one."""
    runners = {}
    for form, model in models.items():
        r = _Runner.__new__(_Runner)
        r.sess = PagedSession(model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, providers=["CUDAExecutionProvider"])
        r.kv, r.done = PagedKVCache(NUM_BLOCKS, BLOCK_SIZE), {}
        r.wanted = {i.name for i in r.sess.session.get_inputs()}
        runners[form] = r
    for chunks in _schedule(_tokens(5)):
        got = {form: r.step(chunks) for form, r in runners.items()}
        for name in chunks:
            assert_close(got["expanded"][name], got["absorbed"][name], np.float16, what=f"cuda, {name}")
