"""Each family's config space, drawn from a seed: transformers 5 configs small enough to export in seconds.

A draw is deterministic in ``(family, seed)``: the same seed gives the same config, checkpoint dtype and export
options on any machine (``random.Random`` seeded from a string, which Python hashes with SHA-512). What varies is
what real checkpoints vary: depth 2-6 (MoE families: MoE in every layer past the first, so in consecutive layers),
hidden 64-1024, head dims 32-128, query/KV head ratios 1-8, vocabularies 256-32k, windows, softcaps, RoPE
scalings, and the dtype the checkpoint is stored in (float32, float16, bfloat16, FP8 block-quantized for the
DeepSeek-V3 layout). Large widths come with few layers and a moderate vocabulary, so every draw stays small.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FAMILIES", "GENAI_PRECISIONS", "TOOLS", "TOOL_FAMILIES", "Draw", "draw"]

_HIDDEN = (64, 128, 256, 512, 1024)
_VOCAB = (256, 1000, 4096, 32000)
_DTYPES = ("float32", "float16", "bfloat16")
_MAX_POSITIONS = 256
# weights of the embedding and lm_head together stay under this many elements (export time and file size)
_MAX_EMBED = 1 << 21


@dataclass(frozen=True)
class Draw:
    """One sampled model: its transformers config, how its checkpoint is stored, how it is exported."""

    family: str
    seed: int
    config: dict[str, Any]
    source_dtype: str  # float32 | float16 | bfloat16 | fp8 (DeepSeek-V3's block-quantized layout)
    attn_implementation: str = "sdpa"
    notes: tuple[str, ...] = field(default_factory=tuple)  # what the draw exercises, for the table
    tool: str = "dynamo"  # which exporter makes the dense model (TOOLS)
    tool_options: dict[str, Any] = field(default_factory=dict)  # genai: {"precision": fp32 | fp16 | int4}

    def summary(self) -> str:
        """One line: the dimensions and features that vary, for the report's table."""
        c = self.config
        heads = f"{c.get('num_attention_heads')}q/{c.get('num_key_value_heads', c.get('num_attention_heads'))}kv"
        head_dim = c.get("head_dim") or (_mla_head(c) if "kv_lora_rank" in c else _head_dim(c))
        parts = [
            f"L{c['num_hidden_layers']}",
            f"h{c['hidden_size']}",
            heads,
            f"d{head_dim}",
            f"V{c['vocab_size']}",
            self.source_dtype,
        ]
        precision = [f"-p {self.tool_options['precision']}"] if "precision" in self.tool_options else []
        return " ".join(parts + list(self.notes) + precision)


def _head_dim(c: dict) -> int:
    return c["hidden_size"] // c["num_attention_heads"]


def _mla_head(c: dict) -> str:
    return f"{c.get('qk_nope_head_dim')}+{c.get('qk_rope_head_dim')}/{c.get('v_head_dim')}"


def _width(rng: random.Random) -> tuple[int, int, int]:
    """(hidden, layers, vocab): wide models get few layers and a vocabulary that keeps embeddings small."""
    hidden = rng.choice(_HIDDEN)
    layers = rng.randint(2, 6) if hidden <= 256 else rng.randint(2, 3)
    vocab = rng.choice([v for v in _VOCAB if v * hidden <= _MAX_EMBED] or [256])
    return hidden, layers, vocab


def _heads(rng: random.Random, *, max_ratio: int = 8, kv: tuple[int, ...] = (1, 2, 4)) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) with a query/KV ratio in 1..max_ratio and at most 2048 query columns."""
    head_dim = rng.choice((32, 64, 128))
    while True:
        kv_heads = rng.choice(kv)
        ratio = rng.choice([r for r in (1, 2, 4, 8) if r <= max_ratio])
        if kv_heads * ratio * head_dim <= 2048:
            return kv_heads * ratio, kv_heads, head_dim


def _rope(rng: random.Random, kinds: tuple[str, ...], head_dim: int, seed: int, window: int = 32) -> tuple[dict, str]:
    """A ``rope_parameters`` dict of one of ``kinds``, each within the first few seeds (crossed with the
    checkpoint dtypes); scalings that switch at a length switch at ``window`` positions, which the sweep's long
    prompt crosses."""
    kind = kinds[(seed + seed // len(_DTYPES)) % len(kinds)]
    theta = rng.choice((10000.0, 500000.0))
    if kind == "default":
        return {"rope_type": "default", "rope_theta": theta}, "rope"
    if kind == "linear":
        return {"rope_type": "linear", "rope_theta": theta, "factor": rng.choice((2.0, 4.0))}, "rope:linear"
    if kind == "dynamic":
        params = {"rope_type": "dynamic", "rope_theta": theta, "factor": 2.0}
        return {**params, "original_max_position_embeddings": window}, "rope:dynamic"
    if kind == "yarn":  # static frequencies: the original length is the factor's (transformers checks it)
        factor = rng.choice((2.0, 4.0))
        params = {"rope_type": "yarn", "rope_theta": theta, "factor": factor, "beta_fast": 32, "beta_slow": 1}
        return {**params, "original_max_position_embeddings": int(_MAX_POSITIONS / factor)}, "rope:yarn"
    if kind == "llama3":
        params = {"rope_type": "llama3", "rope_theta": theta, "factor": 8.0, "low_freq_factor": 1.0}
        return {**params, "high_freq_factor": 4.0, "original_max_position_embeddings": 32}, "rope:llama3"
    if kind == "longrope":
        half = head_dim // 2
        short = [1.0 + 0.05 * rng.random() * i for i in range(half)]
        long = [1.0 + 0.5 * rng.random() * i for i in range(half)]
        params = {"rope_type": "longrope", "rope_theta": theta}
        return {**params, "short_factor": short, "long_factor": long}, "rope:longrope"
    raise ValueError(f"unknown RoPE kind {kind!r}")


def _dense(rng: random.Random, model_type: str, *, max_ratio: int = 8, kv: tuple[int, ...] = (1, 2, 4)) -> dict:
    hidden, layers, vocab = _width(rng)
    heads, kv_heads, head_dim = _heads(rng, max_ratio=max_ratio, kv=kv)
    return {
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": rng.choice((64, 128, 256)),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": _MAX_POSITIONS,
        "tie_word_embeddings": rng.random() < 0.3,
    }


def _llama(rng: random.Random, seed: int) -> tuple[dict, tuple[str, ...], str]:
    cfg = _dense(rng, "llama")
    cfg["rope_parameters"], note = _rope(rng, ("default", "linear", "dynamic", "yarn", "llama3"), cfg["head_dim"], seed)
    return cfg, (note,), "sdpa"


def _qwen3(rng: random.Random, seed: int) -> tuple[dict, tuple[str, ...], str]:
    cfg = _dense(rng, "qwen3")
    cfg["rope_parameters"], note = _rope(rng, ("default", "linear", "yarn"), cfg["head_dim"], seed)
    return cfg, ("q/k-norm", note), "sdpa"


def _mistral(rng: random.Random, seed: int) -> tuple[dict, tuple[str, ...], str]:
    cfg = _dense(rng, "mistral", kv=(1,))  # MQA
    window = rng.choice((4, 8, 16))
    cfg["sliding_window"] = window
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": rng.choice((10000.0, 1000000.0))}
    return cfg, ("MQA", f"window {window}"), "sdpa"


def _qwen2(rng: random.Random, seed: int) -> tuple[dict, tuple[str, ...], str]:
    cfg = _dense(rng, "qwen2")
    window = rng.choice((4, 8, 16))
    full = rng.randint(1, cfg["num_hidden_layers"] - 1)
    cfg.update(use_sliding_window=True, sliding_window=window, max_window_layers=full)
    cfg["rope_parameters"], note = _rope(rng, ("default", "yarn"), cfg["head_dim"], seed)
    return cfg, (f"window {window} past layer {full}", note), "sdpa"


def _phi3(rng: random.Random, seed: int) -> tuple[dict, tuple[str, ...], str]:
    cfg = _dense(rng, "phi3", kv=(2, 4))
    # Phi-3 has no head_dim of its own: hidden / heads
    cfg["num_attention_heads"] = max(cfg["hidden_size"] // cfg.pop("head_dim"), cfg["num_key_value_heads"])
    cfg["num_key_value_heads"] = min(cfg["num_key_value_heads"], cfg["num_attention_heads"])
    cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    cfg.update(original_max_position_embeddings=32, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg["rope_parameters"], note = _rope(rng, ("default", "longrope"), cfg["head_dim"], seed)
    if note == "rope":  # no LongRoPE: one length, as Phi-3 ships (the genai builder reads a shorter one as LongRoPE)
        cfg["original_max_position_embeddings"] = _MAX_POSITIONS
    return cfg, (note,), "sdpa"


def _gemma2(rng: random.Random, seed: int) -> tuple[dict, tuple[str, ...], str]:
    cfg = _dense(rng, "gemma2")
    cfg["num_hidden_layers"] = max(cfg["num_hidden_layers"], 3)  # alternating windows: at least two of a kind
    window = rng.choice((4, 8, 16))
    attn_cap, final_cap = rng.choice((20.0, 50.0)), rng.choice((None, 30.0))
    cfg.update(
        sliding_window=window,
        attn_logit_softcapping=attn_cap,
        final_logit_softcapping=final_cap,
        query_pre_attn_scalar=rng.choice((cfg["head_dim"], 2 * cfg["head_dim"])),
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    return cfg, (f"window {window} alternating", f"softcap {attn_cap:g}/{final_cap}"), "eager"


def _gemma3(rng: random.Random, seed: int) -> tuple[dict, tuple[str, ...], str]:
    cfg = _dense(rng, "gemma3_text")
    cfg["num_hidden_layers"] = max(cfg["num_hidden_layers"], 3)
    window = rng.choice((4, 8, 16))
    pattern = rng.choice((2, 3))
    full, note = _rope(rng, ("default", "linear", "yarn"), cfg["head_dim"], seed)
    cfg.update(
        sliding_window=window,
        layer_types=[
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(cfg["num_hidden_layers"])
        ],
        query_pre_attn_scalar=cfg["head_dim"],
        rope_parameters={"full_attention": full, "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
    )
    return cfg, (f"window {window} every {pattern}", f"full {note}", "q/k-norm"), "eager"


def _mla_dims(rng: random.Random) -> dict:
    """MLA dimensions: the LATENT row (kv_lora_rank + qk_rope) a multiple of 16."""
    hidden, layers, vocab = _width(rng)
    heads = rng.choice((1, 2, 4, 8))
    rope = rng.choice((16, 32, 64))
    nope = rng.choice((16, 32, 64))
    return {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": rng.choice((64, 128)),
        "moe_intermediate_size": rng.choice((16, 32)),
        "num_hidden_layers": max(layers, 3),
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "kv_lora_rank": rng.choice((32, 64, 128)),
        "q_lora_rank": rng.choice((None, 32, 64)),
        "qk_nope_head_dim": nope,
        "qk_rope_head_dim": rope,
        "v_head_dim": rng.choice((16, 32, 64)),
        "max_position_embeddings": _MAX_POSITIONS,
        "tie_word_embeddings": False,
    }


def _moe(rng: random.Random, cfg: dict) -> list[str]:
    """MoE in every layer past the first: group-limited routing, a scaling factor, shared experts or not."""
    experts = rng.choice((4, 8))
    groups = rng.choice((1, 2, 4)) if experts == 8 else rng.choice((1, 2))
    cfg.update(
        first_k_dense_replace=1,
        n_routed_experts=experts,
        num_experts_per_tok=2,
        n_group=groups,
        topk_group=max(1, groups // 2),
        n_shared_experts=rng.choice((1, 2)),
        routed_scaling_factor=rng.choice((1.0, 2.5)),
    )
    return [f"MoE x{cfg['num_hidden_layers'] - 1} ({experts} experts, {groups} groups)"]


def _deepseek_v3(rng: random.Random, seed: int) -> tuple[dict, tuple[str, ...], str]:
    cfg = {"model_type": "deepseek_v3", **_mla_dims(rng), "num_mtp_layers": 0}
    notes = _moe(rng, cfg)
    cfg["rope_interleave"] = rng.random() < 0.7
    cfg["rope_parameters"], note = _rope(rng, ("default", "yarn"), cfg["qk_rope_head_dim"], seed)
    if note == "rope:yarn":
        cfg["rope_parameters"].update(mscale=1.0, mscale_all_dim=1.0)
    return cfg, (*notes, note), "sdpa"


def _deepseek_v2(rng: random.Random, seed: int) -> tuple[dict, tuple[str, ...], str]:
    cfg = {"model_type": "deepseek_v2", **_mla_dims(rng)}
    notes = _moe(rng, cfg)
    grouped = cfg.pop("n_group") > 1
    cfg.pop("topk_group")
    cfg["topk_method"] = "group_limited_greedy" if grouped else "greedy"
    if grouped:
        cfg.update(n_group=2, topk_group=1)
    cfg["rope_parameters"], note = _rope(rng, ("default", "yarn"), cfg["qk_rope_head_dim"], seed)
    return cfg, (*notes, cfg["topk_method"], note), "sdpa"


def _minicpm3(rng: random.Random, seed: int) -> tuple[dict, tuple[str, ...], str]:
    cfg = {"model_type": "minicpm3", **_mla_dims(rng)}
    cfg.pop("moe_intermediate_size")
    cfg["q_lora_rank"] = cfg["q_lora_rank"] or 32
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    return cfg, ("MLA",), "sdpa"


def _mha_heads(rng: random.Random, hidden: int) -> tuple[int, int]:
    """(query heads, head dim) for families whose head dim is hidden / heads."""
    head_dim = rng.choice([d for d in (32, 64, 128) if d <= hidden] or [hidden])
    return hidden // head_dim, head_dim


def _rope_theta(rng: random.Random) -> dict:
    return {"rope_type": "default", "rope_theta": rng.choice((10000.0, 500000.0))}


# Falcon's attention layouts, one per seed in turn: falcon-7b (one KV head), falcon-rw's classic MHA (QKV fused
# per head, interleaved) with and without ALiBi, falcon-40b's new decoder architecture (grouped KV heads)
_FALCON_KINDS = ("multi-query", "classic MHA", "alibi", "new decoder")


def _falcon(rng: random.Random, seed: int) -> tuple[dict, tuple[str, ...], str]:
    """Falcon's fused QKV in each of its layouts (:data:`_FALCON_KINDS`), parallel attention and bias on or off."""
    hidden, layers, vocab = _width(rng)
    heads, _ = _mha_heads(rng, hidden)
    kind = _FALCON_KINDS[seed % len(_FALCON_KINDS)]
    new_arch, multi_query = kind == "new decoder", kind == "multi-query"
    kv = rng.choice([k for k in (1, 2, 4) if heads % k == 0]) if new_arch else 1 if multi_query else heads
    # the new decoder architecture is parallel (falcon-40b/180b; 4.57 fails on it sequential: no ln_attn)
    parallel, bias = rng.random() < 0.5 or new_arch, rng.random() < 0.5
    cfg = {
        "model_type": "falcon",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_kv_heads": kv,
        "num_key_value_heads": kv,  # for the table; Falcon reads num_kv_heads (and multi_query)
        "multi_query": multi_query,
        "new_decoder_architecture": new_arch,
        "parallel_attn": parallel,
        "alibi": kind == "alibi",
        "bias": bias,
        "max_position_embeddings": _MAX_POSITIONS,
        "rope_parameters": _rope_theta(rng),
        "tie_word_embeddings": rng.random() < 0.5,
    }
    notes = (kind, "parallel attn" if parallel else "sequential") + (("bias",) if bias else ())
    return cfg, notes, "sdpa"


def _stablelm(rng: random.Random, seed: int) -> tuple[dict, tuple[str, ...], str]:
    """StableLM: partial rotary, optional QKV bias and per-head q/k LayerNorm (StableLM-2 12B)."""
    hidden, layers, vocab = _width(rng)
    heads, _ = _mha_heads(rng, hidden)
    kv = rng.choice([k for k in (1, 2, 4) if heads % k == 0])
    rotary, bias, qk_norm = rng.choice((0.25, 0.5, 1.0)), rng.random() < 0.5, rng.random() < 0.3
    cfg = {
        "model_type": "stablelm",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": rng.choice((64, 128, 256)),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "partial_rotary_factor": rotary,
        "use_qkv_bias": bias,
        "qk_layernorm": qk_norm,
        "use_parallel_residual": rng.random() < 0.3,
        "max_position_embeddings": _MAX_POSITIONS,
        "rope_parameters": _rope_theta(rng),
        "tie_word_embeddings": False,
    }
    notes = [f"rotary {rotary:g}"] + (["qkv bias"] if bias else []) + (["q/k-norm"] if qk_norm else [])
    return cfg, tuple(notes), "sdpa"


def _gpt_neox(rng: random.Random, seed: int) -> tuple[dict, tuple[str, ...], str]:
    """GPT-NeoX (Pythia): fused per-head QKV, partial rotary, parallel residual or not."""
    hidden, layers, vocab = _width(rng)
    heads, _ = _mha_heads(rng, hidden)
    rotary, parallel = rng.choice((0.25, 0.5, 1.0)), rng.random() < 0.7
    cfg = {
        "model_type": "gpt_neox",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": rng.choice((64, 128, 256)),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "rotary_pct": rotary,
        "use_parallel_residual": parallel,
        "max_position_embeddings": _MAX_POSITIONS,
        "rope_parameters": _rope_theta(rng),
        "tie_word_embeddings": False,
    }
    return cfg, (f"rotary {rotary:g}", "parallel residual" if parallel else "sequential"), "sdpa"


def _phi(rng: random.Random, seed: int) -> tuple[dict, tuple[str, ...], str]:
    """Phi-1/2: partial rotary, dense layer with bias, parallel attention and MLP, GQA or not."""
    hidden, layers, vocab = _width(rng)
    heads, _ = _mha_heads(rng, hidden)
    kv = rng.choice([k for k in (1, 2, 4, heads) if heads % k == 0])
    # an even rotary width for every head dim (rotate_half): phi-2's 0.4 of 80 is 32, but 0.4 of 64 is 25.6 -> 25
    rotary = rng.choice((0.375, 0.5, 1.0))
    cfg = {
        "model_type": "phi",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": rng.choice((64, 128, 256)),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "partial_rotary_factor": rotary,
        "max_position_embeddings": _MAX_POSITIONS,
        "rope_parameters": _rope_theta(rng),
        "tie_word_embeddings": False,
    }
    return cfg, (f"rotary {rotary:g}",), "sdpa"


# family -> the sampler; DeepSeek-V3 also draws FP8 checkpoints (its shipped layout)
FAMILIES: dict[str, Callable[[random.Random, int], tuple[dict, tuple[str, ...], str]]] = {
    "llama": _llama,
    "qwen3": _qwen3,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "phi3": _phi3,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "deepseek_v2": _deepseek_v2,
    "deepseek_v3": _deepseek_v3,
    "minicpm3": _minicpm3,
    # the families optimum brings (issue 28): configs for the tool axis
    "falcon": _falcon,
    "stablelm": _stablelm,
    "gpt_neox": _gpt_neox,
    "phi": _phi,
}
_FP8 = ("deepseek_v3",)
_CORE = ("llama", "qwen3", "mistral", "qwen2", "phi3", "gemma2", "gemma3", "deepseek_v2", "deepseek_v3", "minicpm3")
# tool -> the families it exports (each tool's own list of architectures, intersected with the space):
# onnxruntime-genai 0.18's builder has no MLA; optimum-onnx 0.1.0 (transformers 4.57) has DeepSeek-V3 but not
# DeepSeek-V2 or MiniCPM3, and brings Falcon, StableLM, GPT-NeoX and Phi
TOOL_FAMILIES: dict[str, tuple[str, ...]] = {
    "dynamo": _CORE,
    # no gemma3: the 0.18 builder reads rope_parameters["rope_type"], which transformers 5 nests per layer type
    # for Gemma-3 (KeyError: 'rope_type', docs/sweep.md)
    "genai": ("llama", "qwen3", "mistral", "qwen2", "phi3", "gemma2", "phi"),
    "optimum": (*_CORE[:7], "deepseek_v3", "falcon", "stablelm", "gpt_neox", "phi"),
    "onnx_exporter": _CORE,
}
TOOLS = tuple(TOOL_FAMILIES)
GENAI_PRECISIONS = ("fp32", "fp16", "int4")


def draw(family: str, seed: int, tool: str = "dynamo") -> Draw:
    """The config ``seed`` draws from ``family``'s space (:data:`FAMILIES`), exported by ``tool``.

    The config does not depend on the tool (the same seed is the same model under every tool); FP8 checkpoints
    are ortpa's own export's (``ortpa convert HF_DIR`` dequantizes them), other tools get bfloat16 instead. genai
    draws its builder's precision, every one within the first few seeds of a family."""
    if family not in FAMILIES:
        raise KeyError(f"unknown family {family!r}; expected one of {sorted(FAMILIES)}")
    if tool not in TOOL_FAMILIES:
        raise KeyError(f"unknown tool {tool!r}; expected one of {TOOLS}")
    rng = random.Random(f"{family}:{seed}")
    config, notes, attn = FAMILIES[family](rng, seed)
    dtypes = _DTYPES + (("fp8",) if family in _FP8 else ())
    source = dtypes[seed % len(dtypes)]  # every dtype within the first few seeds
    options: dict[str, Any] = {}
    if tool != "dynamo":
        source = "bfloat16" if source == "fp8" else source
    if tool == "genai":
        options["precision"] = GENAI_PRECISIONS[(seed + sorted(FAMILIES).index(family)) % len(GENAI_PRECISIONS)]
    return Draw(family, seed, config, source, attn, notes, tool, options)
