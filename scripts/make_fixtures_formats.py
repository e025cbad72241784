"""Regenerate the source-format fixtures under tests/fixtures/formats/ with the exporters people actually use.

Each fixture is a tiny random-weight LLM (hidden 64, 2 layers, vocab 256, seeded) exported by a real tool, saved as
one self-contained ``<name>.onnx`` (external data folded in, < 3 MB) plus ``<name>.json``: the source format, the
tool and library versions that made it, the Hugging Face config, the numbers a test needs (vocab size, layers,
heads, head size, dtype) and the thresholds a long prompt must cross (LongRoPE's
``original_max_position_embeddings``). genai builder fixtures also keep ``<name>.genai_config.json``.

The tools cannot share one environment, so each runs in its own venv (no network: weights are random, the
tokenizer is built offline with ``tokenizers``); ``scripts/make_tool_venvs.sh`` builds the genai and optimum
venvs. The folder build and each tool's call live in ``ortpa/testing/export_tools.py``, shared with the sweep's
tool axis (``python -m ortpa.testing.sweep --tool T``). Pass the tool as the first argument:

* ``genai``: onnxruntime-genai 0.18.0 model builder (``python -m onnxruntime_genai.models.builder``), in a venv
  with onnxruntime-genai 0.18.0 (it pulls the ``onnxruntime`` 1.32 CPU wheel), onnx-ir (the builder imports it
  but does not declare it), torch 2.13.0 CPU, transformers 5.24 (the 0.18 builder does not import with 4.x),
  onnx 1.23. Llama and Qwen3 at ``-p fp32`` (GroupQueryAttention), ``fp16`` (RotaryEmbedding +
  MultiHeadAttention), ``int4`` (MatMulNBits + GroupQueryAttention), and Phi-3.5-style LongRoPE at fp32, fp16
  and int4. ``genai_llama_paged_fp16``: the builder's own paged model (``-p fp16 -e cuda --extra_options
  use_paged_attention=true``, which builds without a GPU), written to ``tests/fixtures/genai_paged/``.
* ``optimum``: optimum-onnx 0.1.0 (``optimum-cli export onnx --task text-generation-with-past``), in a venv with
  optimum-onnx (it pins transformers < 4.58), torch 2.13.0 CPU, onnx 1.23. One that reuses ortpa's torch and onnx:
  ``python -m venv V``, a ``.pth`` file in V's site-packages naming ortpa's site-packages (it comes after V's own,
  so V's transformers 4.57 wins), ``V/bin/pip install optimum-onnx "transformers<4.58"``, then run this script
  with ``V/bin/python``. Llama, Qwen3, Falcon (multi-query; ALiBi), StableLM (and with q/k LayerNorm, whose folder
  ``--host-python``, ortpa's interpreter, saves), GPT-NeoX, Phi, Gemma, Mistral (sliding window 8), Qwen2,
  Gemma-2 (alternating windows).
* ``onnx_exporter``: transformers 5.x ``OnnxExporter.export_for_generation`` (the decode model), in ortpa's own
  environment (the ``export`` extra: torch 2.13.0 CPU, transformers 5.24, onnxscript 0.7). Llama, MiniCPM3 (dense
  MLA) and DeepSeek-V3 (MLA, MoE in two consecutive layers).
* ``ortpa``: ``ortpa.export.export_hf`` (``torch.onnx.export(dynamo=True)``), ortpa's environment, for the
  Phi-3.5-style LongRoPE model.

Usage: ``python scripts/make_fixtures_formats.py TOOL [--only NAME ...] [--out tests/fixtures/formats]``.
A fixture whose tool fails is reported with the tool's own error and the others still run (exit status 1).
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's ortpa, also from a tool's venv

from ortpa.testing import export_tools  # noqa: E402  (stdlib-only at import: runs in every tool's venv)

FORMATS_DIR = ROOT / "tests" / "fixtures" / "formats"
PAGED_DIR = ROOT / "tests" / "fixtures" / "genai_paged"  # paged models: not sources of tests/test_formats.py
SEED = 0
GENAI_NEW_TOKENS = 6  # greedy tokens recorded from onnxruntime-genai's own run of each genai fixture
VOCAB = 256
BOS, EOS, PAD, UNK = export_tools.BOS, export_tools.EOS, export_tools.PAD, export_tools.UNK

# Tiny configs in the legacy (transformers 4.x) spelling, which transformers 5.x also reads: each venv builds
# the Hugging Face folder with its own transformers, from these dicts, with the same seeded weights.
_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": BOS,
    "eos_token_id": EOS,
    "pad_token_id": PAD,
}
LLAMA = {**_COMMON, "model_type": "llama", "head_dim": 16}
# Qwen3: per-head q/k RMSNorm, head_dim 32 decoupled from hidden / heads (4 x 32 = 128 != 64).
QWEN3 = {**_COMMON, "model_type": "qwen3", "head_dim": 32}
# Phi-3.5-style LongRoPE: a prompt longer than original_max_position_embeddings (32) switches to long factors.
_HALF = 8  # head_dim 16 / 2 rotary frequencies
PHI3_LONGROPE = {
    **_COMMON,
    "model_type": "phi3",
    "original_max_position_embeddings": 32,
    "rope_scaling": {
        "type": "longrope",
        "short_factor": [1.0 + 0.05 * i for i in range(_HALF)],
        "long_factor": [1.5 + 0.5 * i for i in range(_HALF)],
    },
}

# Gemma-2: attention logit softcapping (GroupQueryAttention's softcap), query_pre_attn_scalar, alternating
# sliding / full layers (local_window_size on layer 0 only). A Mistral with sliding_window 8 was tried too: the
# 0.18 builder writes local_window_size=-1 for it (no window in the graph), so it adds nothing over Llama.
GEMMA2 = {
    **_COMMON,
    "model_type": "gemma2",
    "head_dim": 16,
    "sliding_window": 8,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "query_pre_attn_scalar": 16,
}

# gpt-oss: attention sinks (GroupQueryAttention head_sink), alternating sliding / full layers, MoE (4 experts, top 2).
GPT_OSS = {
    **_COMMON,
    "model_type": "gpt_oss",
    "head_dim": 16,
    "intermediate_size": 64,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention"],
    "rope_scaling": None,
}

# optimum's other decoder families (issue 28): Falcon (fused query_key_value, multi-query, parallel attention),
# StableLM (partial rotary, its scale computed from a Shape at run time), GPT-NeoX, Phi, Gemma, Mistral, Qwen2.
_SMALL = {k: v for k, v in _COMMON.items() if k not in ("num_key_value_heads", "intermediate_size")}
FALCON = {
    **_SMALL,
    "model_type": "falcon",
    "num_kv_heads": 1,
    "num_key_value_heads": 1,  # for _numbers; Falcon reads num_kv_heads (and multi_query)
    "multi_query": True,
    "parallel_attn": True,
    "new_decoder_architecture": False,
    "alibi": False,
    "bias": False,
}
# falcon-rw's layout: classic MHA (QKV fused per head), sequential attention, bias, ALiBi instead of RoPE: refused
# by name (PagedAttention takes no bias on the scores)
FALCON_ALIBI = {**FALCON, "num_kv_heads": 4, "num_key_value_heads": 4, "multi_query": False, "parallel_attn": False}
FALCON_ALIBI.update(alibi=True, bias=True, num_hidden_layers=1)
STABLELM = {**_COMMON, "model_type": "stablelm", "partial_rotary_factor": 0.25}
# StableLM-2 12B's per-head q/k LayerNorm: transformers 4.57 cannot build it from a config (its _init_weights zeroes
# the absent bias), so ortpa's transformers 5 saves the folder (--host-python) and optimum exports it
STABLELM_QK = {**STABLELM, "qk_layernorm": True}
GPT_NEOX = {
    **_SMALL,
    "model_type": "gpt_neox",
    "num_key_value_heads": 4,
    "intermediate_size": 128,
    "rotary_pct": 0.25,
    "use_parallel_residual": True,
}
PHI = {**_COMMON, "model_type": "phi", "num_key_value_heads": 4, "partial_rotary_factor": 0.5}
GEMMA = {**_COMMON, "model_type": "gemma", "head_dim": 16}
MISTRAL = {**_COMMON, "model_type": "mistral", "head_dim": 16, "sliding_window": 8}
QWEN2 = {**_COMMON, "model_type": "qwen2"}
# Dense MLA without MoE (MiniCPM3), for transformers 5's OnnxExporter: it caches the normalised latent as
# ``keys`` and the roped key part as ``values``, and zeroes fully masked rows after each attention.
MINICPM3 = {
    **{k: v for k, v in _COMMON.items() if k not in ("num_key_value_heads",)},
    "model_type": "minicpm3",
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 16,
    "v_head_dim": 16,
}
# DeepSeek-V3 through the OnnxExporter: MLA, then MoE in two consecutive layers; its dispatch counts rows per
# expert with a ScatterElements add (histc) over the rows sorted by expert.
DEEPSEEK_V3 = {
    **MINICPM3,
    "model_type": "deepseek_v3",
    "num_hidden_layers": 3,
    "q_lora_rank": None,
    "moe_intermediate_size": 32,
    "first_k_dense_replace": 1,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "rope_interleave": True,
}
# optimum-onnx 0.1.0 exports no Mixtral ("Trying to export a mixtral model, that is a custom or unsupported
# architecture", 2026-12-01), but it does export DeepSeek-V3 (transformers 4.57): its caches hold the expanded
# per-head keys and values, and its MoE is the eager per-expert loop (one_hot, NonZero, index_add) traced.

# name -> (tool, config, tool options)
FIXTURES: dict[str, tuple[str, dict, dict]] = {
    "genai_llama_fp32": ("genai", LLAMA, {"precision": "fp32"}),
    "genai_llama_fp16": ("genai", LLAMA, {"precision": "fp16"}),
    "genai_llama_int4": ("genai", LLAMA, {"precision": "int4"}),
    "genai_qwen3_fp32": ("genai", QWEN3, {"precision": "fp32"}),
    "genai_qwen3_fp16": ("genai", QWEN3, {"precision": "fp16"}),
    "genai_qwen3_int4": ("genai", QWEN3, {"precision": "int4"}),
    "genai_phi3_longrope_fp32": ("genai", PHI3_LONGROPE, {"precision": "fp32"}),
    # one layer: with the builder's LM-head pick (NOTES of genai_phi3_longrope_fp32) a second layer's attention is
    # dead code at fp16; genai_phi3_deadlayer_fp16 keeps it
    "genai_phi3_longrope_fp16": ("genai", {**PHI3_LONGROPE, "num_hidden_layers": 1}, {"precision": "fp16"}),
    # two layers at fp16: layer 1's MultiHeadAttention reaches no output, its cache Concat still does (the sweep's
    # genai phi3 seed 0, refused before ortpa.rewriter.dead_attention)
    "genai_phi3_deadlayer_fp16": ("genai", PHI3_LONGROPE, {"precision": "fp16"}),
    "genai_phi3_longrope_int4": ("genai", PHI3_LONGROPE, {"precision": "int4"}),
    "genai_gptoss_fp32": ("genai", GPT_OSS, {"precision": "fp32"}),
    # no genai_gptoss_int4: the 0.18 builder's gpt-oss int4 path reads the original checkpoint's MXFP4 expert blocks
    # ("Original GPT-OSS MXFP4 tensor 'model.layers.0.mlp.experts.gate_up_proj_blocks' was not found"), which a
    # float random-weight checkpoint does not have
    "genai_gemma2_fp32": ("genai", GEMMA2, {"precision": "fp32"}),
    # Phi (partial rotary 0.5) at fp16: MultiHeadAttention takes the caches as its own past_key / past_value
    "genai_phi_fp16": ("genai", PHI, {"precision": "fp16"}),
    # genai's own paged model (PagedAttention, packed QKV, RoPE in the op): fp16 for CUDA, the only paged build
    # the builder makes besides WebGPU; it builds on a machine without a GPU. Same weights as genai_llama_fp16.
    "genai_llama_paged_fp16": ("genai", LLAMA, {"precision": "fp16", "ep": "cuda", "paged": True}),
    "optimum_llama": ("optimum", LLAMA, {}),
    "optimum_qwen3": ("optimum", QWEN3, {}),
    "optimum_falcon": ("optimum", FALCON, {}),
    "optimum_falcon_alibi": ("optimum", FALCON_ALIBI, {}),
    "optimum_stablelm": ("optimum", STABLELM, {}),
    "optimum_stablelm_qknorm": ("optimum", STABLELM_QK, {}),
    "optimum_gptneox": ("optimum", GPT_NEOX, {}),
    "optimum_phi": ("optimum", PHI, {}),
    "optimum_gemma": ("optimum", GEMMA, {}),
    "optimum_mistral": ("optimum", MISTRAL, {}),
    "optimum_qwen2": ("optimum", QWEN2, {}),
    # Gemma-2's alternating windows (layer 0 sliding, layer 1 full) through optimum: the full layer's mask takes its
    # width from Shape(key), whose ancestors reach layer 0's window comparison (docs/sweep.md)
    "optimum_gemma2": ("optimum", GEMMA2, {}),
    # DeepSeek-V3 through optimum (transformers 4.57): expanded-cache MLA, MoE in layers 1 and 2 (docs/sweep.md)
    "optimum_deepseek_v3": ("optimum", DEEPSEEK_V3, {}),
    "onnxexporter_llama": ("onnx_exporter", LLAMA, {}),
    "onnxexporter_minicpm3": ("onnx_exporter", MINICPM3, {}),
    # sliding window 8: each layer's cache round-trips a scalar input.cache.layers.N._sliding_window_tensor that
    # the graph never reads (the mask takes the window from constants)
    "onnxexporter_mistral": ("onnx_exporter", MISTRAL, {}),
    "onnxexporter_deepseek_v3": ("onnx_exporter", DEEPSEEK_V3, {}),
    "ortpa_phi3_longrope": ("ortpa", PHI3_LONGROPE, {}),
}

# What a test or a reader must know about a fixture beyond its config (measured when the fixture was made).
NOTES: dict[str, str] = {
    "optimum_deepseek_v3": "expanded-cache MLA: present.{i}.key = Concat(past, Concat(k_nope, "
    "Expand(rope(k_pe)))) [B,4,S,32], .value [B,4,S,16]; MoE in layers 1 and 2 as transformers 4.57's eager loop "
    "traced (OneHot, per expert NonZero, Gather, ScatterElements into zeros). The trace drops an expert no token of "
    "optimum's dummy input reached (if token_indices.numel() > 0): all 4 experts of both MoE layers are present here",
    "genai_gptoss_fp32": "attention sinks: GroupQueryAttention input 11 (head_sink) = model.layers.{i}.attn.sinks "
    "[num_heads]; layer 0 local_window_size=8 (sliding_window_cache=1), layer 1 full; MLP = one com.microsoft::MoE "
    "(4 experts, k=2, swiglu)",
    "genai_phi3_longrope_int4": "as genai_phi3_longrope_fp32, with MatMulNBits projections",
    "genai_phi3_longrope_fp16": "one layer (the builder's LM-head pick of genai_phi3_longrope_fp32 leaves a second "
    "layer's attention dead at fp16: genai_phi3_deadlayer_fp16); RotaryEmbedding + MultiHeadAttention, cos/sin "
    "from If(Greater(mask width, 32))",
    "genai_llama_fp16": "the builder declares the repeated K/V after the cache Concat with sequence_length where it "
    "holds total_sequence_length: ONNX Runtime 1.31/1.32 CPU (and onnxruntime-genai itself) fail the first decode "
    "step with 'Shape mismatch attempting to re-use buffer' unless memory reuse is off (ortpa.parity.greedy."
    "open_dense turns it off)",
    "genai_qwen3_fp16": "same value_info defect as genai_llama_fp16 (memory reuse must be off to decode)",
    "genai_llama_int4": "MatMulNBits accuracy_level 4 quantizes activations to int8: incremental and one-shot runs "
    "differ by up to ~0.06 in logits where a rounding flips",
    "genai_qwen3_int4": "as genai_llama_int4",
    "genai_llama_paged_fp16": "a paged model, not a dense one (kept in tests/fixtures/genai_paged/): inputs "
    "input_ids [num_tokens], past_key_values.{i}.key/.value [num_blocks, block_size, 2, 16], block_table, "
    "cumulative_sequence_lengths, past_sequence_lengths, attention_metadata; provider cuda. onnxruntime-genai "
    "cannot run it on CPU (no PagedAttention CPU kernel); ortpa runs it through the portable op",
    "genai_phi3_longrope_fp32": "builder defect (0.18.0): its has_lm_head takes any nn.Linear with vocab_size "
    "outputs for the LM head, and Phi-3's fused gate_up_proj has 2 * intermediate_size = 256 = vocab_size, so the "
    "/lm_head/MatMul node (the first one made; the real lm_head's weight replaces its initializer) reads "
    "/model/layers.0/post_attention_layernorm/output_0 instead of the final norm: layer 0's MLP, layer 1 and the "
    "final norm are dead code (present.1.* are still computed) and the logits differ from Phi3ForCausalLM on the "
    "same weights (~3.3); layer 0 itself matches torch to 1e-6. LongRoPE: If(Greater(attention_mask width, 32), "
    "long caches, short caches) -> cos_cache/sin_cache of every GroupQueryAttention",
    "genai_phi3_deadlayer_fp16": "the LM-head defect of genai_phi3_longrope_fp32 at fp16: layer 1's "
    "MultiHeadAttention output reaches no graph output, while its cache Concat (present.1.*) does; the caches' head "
    "size is the symbol kv_cache_dim",
    "genai_gemma2_fp32": "layer 0 is sliding: GroupQueryAttention local_window_size 8 with sliding_window_cache=1, "
    "its past/present a ring buffer of 8 rows (past_sliding_length / total_sliding_length) fed as zeros from the "
    "first step and returned at the same size; softcap 50 on both layers; final logit softcap as Div, Tanh, Mul; "
    "matches Gemma2ForCausalLM on the same weights to 2e-5",
    "ortpa_phi3_longrope": "LongRoPE: Where(Greater(ReduceMax(position_ids) + 1, 32), long_inv_freq, "
    "original_inv_freq): a max over the whole batch",
    "onnxexporter_llama": "batch is fixed at 1 (the sample had one prompt); caches input.cache.layers.{i}.keys/"
    ".values -> output.cache.layers.{i}.*, dims as digit strings, no attention_mask",
}

# Ops that carry attention, per source form (counted per layer into the fixture's JSON).
_ATTENTION_OPS = {
    "GroupQueryAttention",
    "MultiHeadAttention",
    "RotaryEmbedding",
    "Attention",
    "Softmax",
    "MatMulNBits",
    "SimplifiedLayerNormalization",
    "SkipSimplifiedLayerNormalization",
}


# ---------------------------------------------------------------------------------------------- the tools
# The folder build and each tool's export are shared with the sweep's tool axis (ortpa/testing/export_tools.py).
def build_hf_dir(cfg: dict, out: Path, *, attn_implementation: str | None = None) -> None:
    """Save a seeded random-weight causal LM (float32 safetensors) and a tokenizer to ``out``."""
    export_tools.build_hf_dir(cfg, out, seed=SEED, attn_implementation=attn_implementation)


def reference_prompts(cfg: dict) -> list[list[int]]:
    """A short prompt and one longer than every threshold of the config (as tests/test_formats.py builds them)."""
    thresholds = [cfg[k] for k in ("original_max_position_embeddings", "sliding_window") if cfg.get(k)]
    length = max([40, *(t + 8 for t in thresholds)])
    return [[5, 6, 7, 8, 9], [4 + (7 * i) % (cfg["vocab_size"] - 4) for i in range(length)]]


def _genai_runtime_greedy(model_dir: Path, prompts: list[list[int]], new_tokens: int) -> dict:
    """Greedy tokens of onnxruntime-genai itself on the built model (each prompt alone), or the error it gave."""
    import onnxruntime_genai as og

    try:
        model = og.Model(str(model_dir))
        tokens = []
        for prompt in prompts:
            params = og.GeneratorParams(model)
            length = len(prompt) + new_tokens  # min_length too: an EOS pick must not end the run early
            params.set_search_options(max_length=length, min_length=length, do_sample=False)
            gen = og.Generator(model, params)
            gen.append_tokens([prompt])
            while not gen.is_done():
                gen.generate_next_token()
            tokens.append([int(t) for t in gen.get_sequence(0)][len(prompt) :])
        return {"prompts": prompts, "new_tokens": tokens}
    except Exception as exc:  # recorded: the fp16 builds do not decode in onnxruntime-genai 0.18 on CPU
        return {"prompts": prompts, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:400]}"}


def _export(tool: str, hf: Path, work: Path, opts: dict) -> tuple[Path, list[str], dict[str, Path]]:
    made = export_tools.export(tool, hf, work, opts)
    if tool == "genai" and opts.get("ep", "cpu") == "cpu":  # genai's CPU wheel cannot open a CUDA build
        runtime = _genai_runtime_greedy(made.folder, reference_prompts(opts["config"]), GENAI_NEW_TOKENS)
        (work / "genai_runtime.json").write_text(json.dumps(runtime))
    return made.model, made.command, made.extras


# ------------------------------------------------------------------------------------------- description
def _dims(value) -> list:
    out = []
    for d in value.type.tensor_type.shape.dim:
        out.append(d.dim_param if d.dim_param else (d.dim_value if d.HasField("dim_value") else None))
    return out


def _layer_of(name: str) -> str:
    """The layer a node belongs to, from the exporters' node names (``/model/layers.0/...``, ``layers.0.``)."""
    import re

    m = re.search(r"layers[./_](\d+)", name)
    return m.group(1) if m else "-"


def describe(path: Path) -> dict:
    """Graph facts the recognisers are written against: opsets, I/O with shapes, attention ops per layer."""
    import onnx

    model = onnx.load(str(path))
    ops = collections.Counter(f"{n.domain or 'ai.onnx'}::{n.op_type}" for n in model.graph.node)
    per_layer: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for n in model.graph.node:
        if n.op_type in _ATTENTION_OPS:
            per_layer[_layer_of(n.name)][f"{n.domain or 'ai.onnx'}::{n.op_type}"] += 1
    attention_nodes = []
    for n in model.graph.node:
        if n.op_type in ("GroupQueryAttention", "MultiHeadAttention", "RotaryEmbedding", "Attention"):
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
            attention_nodes.append(
                {
                    "name": n.name,
                    "op": f"{n.domain or 'ai.onnx'}::{n.op_type}",
                    "inputs": list(n.input),
                    "outputs": list(n.output),
                    "attributes": {k: (v.decode() if isinstance(v, bytes) else v) for k, v in attrs.items()},
                }
            )
    elem = onnx.TensorProto.DataType.Name
    return {
        "opsets": {o.domain or "ai.onnx": o.version for o in model.opset_import},
        "ir_version": model.ir_version,
        "producer": f"{model.producer_name} {model.producer_version}".strip(),
        "inputs": [
            {"name": v.name, "dtype": elem(v.type.tensor_type.elem_type), "shape": _dims(v)} for v in model.graph.input
        ],
        "outputs": [
            {"name": v.name, "dtype": elem(v.type.tensor_type.elem_type), "shape": _dims(v)} for v in model.graph.output
        ],
        "op_counts": dict(sorted(ops.items())),
        "attention_ops_per_layer": {k: dict(sorted(v.items())) for k, v in sorted(per_layer.items())},
        "attention_nodes": attention_nodes[:8],
    }


def _numbers(cfg: dict, tool: str) -> dict:
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head = cfg.get("head_dim") or cfg["hidden_size"] // heads
    thresholds = {}
    if "original_max_position_embeddings" in cfg:
        thresholds["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
    if cfg.get("sliding_window"):
        thresholds["sliding_window"] = cfg["sliding_window"]
    cache = {"num_kv_heads": kv, "head_size": head}
    if "kv_lora_rank" in cfg and tool == "optimum":  # transformers 4.x MLA: expanded per-head keys and values
        key = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
        cache = {"num_kv_heads": heads, "head_size": key, "value_head_size": cfg["v_head_dim"]}
    elif "kv_lora_rank" in cfg:  # dense MLA: one latent head in the key cache, the roped key part in the value cache
        cache = {"num_kv_heads": 1, "head_size": cfg["kv_lora_rank"], "value_head_size": cfg["qk_rope_head_dim"]}
    return {
        "model_type": cfg["model_type"],
        "vocab_size": cfg["vocab_size"],
        "num_layers": cfg["num_hidden_layers"],
        "num_heads": heads,
        **cache,
        "max_position_embeddings": cfg["max_position_embeddings"],
        "thresholds": thresholds,
    }


def _source_format(tool: str, opts: dict) -> str:
    """The format a reader should detect (``ortpa.formats.SourceFormat``), from how the file was made."""
    if tool == "genai" and opts.get("paged"):
        return "genai_paged"
    if tool == "genai":  # on CPU the builder writes GroupQueryAttention, except at fp16: RotaryEmbedding + MHA
        return "genai_mha" if opts["precision"] == "fp16" else "genai_gqa"
    return {"optimum": "optimum", "onnx_exporter": "onnx_exporter", "ortpa": "ortpa_dynamo"}[tool]


def _build_on_host(cfg: dict, work: Path, host_python: str | None) -> None:
    """Save ``work/hf`` with ``host_python``'s transformers 5 in 4.x's spelling (``export_tools.host_built``)."""
    if not host_python:
        raise RuntimeError(f"{export_tools.host_built('optimum', cfg)}: pass --host-python (ortpa's interpreter)")
    (work / "config.json").write_text(json.dumps(cfg))
    cmd = [host_python, "-m", "ortpa.testing.export_tools", "optimum", str(work / "config.json"), str(work)]
    subprocess.run([*cmd, "--seed", str(SEED), "--build-only"], check=True, cwd=ROOT)


def make(name: str, out_dir: Path, keep: Path | None = None, host_python: str | None = None) -> Path:
    import onnx

    tool, cfg, opts = FIXTURES[name]
    with tempfile.TemporaryDirectory(prefix=f"fx_{name}_") as tmp:
        work = Path(tmp)
        hf = work / "hf"
        if export_tools.host_built(tool, cfg):
            _build_on_host(cfg, work, host_python)
        else:
            build_hf_dir(cfg, hf)
        model_path, cmd, extras = _export(tool, hf, work, {**opts, "config": cfg})
        runtime = work / "genai_runtime.json"
        genai_runtime = json.loads(runtime.read_text()) if runtime.exists() else None
        model = onnx.load(str(model_path))  # folds external data in: one self-contained file
        dst = out_dir / f"{name}.onnx"
        onnx.save_model(model, str(dst), save_as_external_data=False)
        for suffix, src in extras.items():
            shutil.copyfile(src, out_dir / f"{name}.{suffix}")
        if keep is not None:
            shutil.copytree(work, keep / name, dirs_exist_ok=True)
    info = {
        "name": name,
        "source_format": _source_format(tool, opts),
        "tool": tool,
        "command": cmd,
        "options": opts,
        "seed": SEED,
        "versions": export_tools.versions(export_tools.PACKAGES[tool]),
        "config": cfg,
        **_numbers(cfg, tool),
        "dtype": "float16" if opts.get("precision") == "fp16" else "float32",
        "weights": {"fp16": "float16", "int4": "int4 (MatMulNBits)"}.get(opts.get("precision", ""), "float32"),
        "notes": NOTES.get(name, ""),
        **({"genai_runtime_greedy": genai_runtime} if genai_runtime is not None else {}),
        "graph": describe(dst),
    }
    (out_dir / f"{name}.json").write_text(json.dumps(info, indent=1) + "\n")
    return dst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tool", choices=sorted(export_tools.TOOLS))
    ap.add_argument("--only", nargs="*", default=None, help="fixture names (default: every fixture of the tool)")
    ap.add_argument(
        "--out",
        default=None,
        help="output folder (default: tests/fixtures/formats, paged builds in tests/fixtures/genai_paged)",
    )
    ap.add_argument("--keep", default=None, help="also copy each tool's raw output and logs to this folder")
    ap.add_argument(
        "--host-python",
        default=None,
        help="ortpa's interpreter (transformers 5): saves the folders the tool's transformers cannot build "
        "(optimum_stablelm_qknorm)",
    )
    args = ap.parse_args(argv)
    keep = Path(args.keep) if args.keep else None
    names = [n for n, (tool, _, _) in FIXTURES.items() if tool == args.tool and (not args.only or n in args.only)]
    print(json.dumps(export_tools.versions(export_tools.PACKAGES[args.tool])))
    failed = []
    for name in names:
        t = time.time()
        out = Path(args.out) if args.out else FORMATS_DIR if not FIXTURES[name][2].get("paged") else PAGED_DIR
        out.mkdir(parents=True, exist_ok=True)
        try:
            dst = make(name, out, keep, args.host_python)
        except Exception as exc:  # report every fixture, keep going
            failed.append(name)
            print(f"FAIL {name}: {type(exc).__name__}: {str(exc)[-2000:]}")
            continue
        print(f"ok   {name}: {dst.stat().st_size / 1e6:.2f} MB, {time.time() - t:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
