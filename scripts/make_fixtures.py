"""Regenerate the small dense ONNX fixtures under tests/fixtures/ from real torch.onnx (dynamo) exports.

Needs the ``export`` extra (torch 2.13.0 CPU, transformers 5.x); no network: random seeded weights.
Usage: ``python scripts/make_fixtures.py [--only NAME ...] [--out tests/fixtures]``.
Writes ``<name>.onnx`` and ``<name>.json`` (config, versions, I/O) and prints the versions used.

Dimensions are chosen for PagedAttention LATENT: head = kv_lora_rank + qk_rope = 64 + 16 = 80 (a multiple of 8)
or 64 + 32 = 96 (a multiple of 16, needed when RoPE moves into the op: ``do_rotary=1``).
The ``*_moe_*`` fixtures are the families as they ship (layer 0 dense, layer 1 MoE, transformers' default
experts implementation; DeepSeek-V2's complex RoPE exported as its real-valued equivalent): each takes ~40-120 s
on 2 cores and ~1.5 MB.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ortpa.export.hf import fixtures_main  # noqa: E402

_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
_DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}

# A tiny DeepSeek-V3: 2 dense layers (first_k_dense_replace=2 keeps MoE out of the graph).
_DSV3 = {
    "model_type": "deepseek_v3",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 48,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "first_k_dense_replace": 2,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "max_position_embeddings": 256,
    "num_mtp_layers": 0,
    "rope_interleave": True,
    "tie_word_embeddings": False,
    "rope_parameters": _YARN,
}


# DeepSeek-V2 (complex RoPE, interleaved pairs) with MoE on layer 1.
_DSV2 = {
    "model_type": "deepseek_v2",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 48,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "first_k_dense_replace": 1,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "topk_method": "greedy",
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "rope_parameters": _DEFAULT_ROPE,
}

_GLM4_MOE_LITE = {
    "model_type": "glm4_moe_lite",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 48,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 48,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 256,
    "rope_parameters": _DEFAULT_ROPE,
}


def _v(**over):
    cfg = dict(_DSV3)
    cfg.update(over)
    return cfg


_MOE3_DSV3 = _v(
    num_hidden_layers=3,
    first_k_dense_replace=1,
    n_routed_experts=8,
    n_group=4,
    topk_group=2,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
)

# name -> (config, export options). Order: the headline fixture first.
FIXTURES: dict[str, tuple[dict, dict]] = {
    "dsv3_sdpa_op18": (_DSV3, {"opset": 18, "attn_implementation": "sdpa"}),
    "dsv3_eager_op18": (_DSV3, {"opset": 18, "attn_implementation": "eager"}),
    "dsv3_sdpa_op23": (_DSV3, {"opset": 23, "attn_implementation": "sdpa"}),
    "dsv3_sdpa_op18_noil_noqlora": (
        _v(rope_interleave=False, q_lora_rank=None, rope_parameters=_DEFAULT_ROPE),
        {"opset": 18, "attn_implementation": "sdpa"},
    ),
    # qk_rope 32: head 96 is a multiple of 16, so RoPE can move into the op (do_rotary=1).
    "dsv3_sdpa_op18_rope32": (
        _v(qk_rope_head_dim=32, qk_nope_head_dim=16),
        {"opset": 18, "attn_implementation": "sdpa"},
    ),
    # Kimi-K2-style: a DeepSeek-V3 architecture with few heads and no q LoRA on some layers' configs.
    "kimi_sdpa_op18": (
        _v(num_attention_heads=2, num_key_value_heads=2, q_lora_rank=64, rope_parameters=_DEFAULT_ROPE),
        {"opset": 18, "attn_implementation": "sdpa"},
    ),
    # Another MLA family: GLM-4.7-Flash (GLM-4-MoE-Lite) with dense MLPs only.
    "glm4moelite_sdpa_op18": (
        {**_GLM4_MOE_LITE, "mlp_layer_types": ["dense", "dense"]},
        {"opset": 18, "attn_implementation": "sdpa"},
    ),
    # MiniCPM3: MLA with rotate_half RoPE, no q LoRA split, scaled embeddings/residuals, tied lm_head.
    "minicpm3_sdpa_op18": (
        {
            "model_type": "minicpm3",
            "vocab_size": 256,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "q_lora_rank": 48,
            "kv_lora_rank": 64,
            "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 16,
            "v_head_dim": 32,
            "max_position_embeddings": 256,
            "rope_parameters": _DEFAULT_ROPE,
        },
        {"opset": 18, "attn_implementation": "sdpa"},
    ),
    # MLA models as they ship, with MoE layers (layer 0 dense, layer 1 MoE) and the default experts
    # implementation (grouped_mm, exported through transformers' ONNX lowering: ortpa.export.patches).
    "dsv3_moe_sdpa_op18": (_v(first_k_dense_replace=1), {"opset": 18, "attn_implementation": "sdpa"}),
    # DeepSeek-V2: complex RoPE (exported as its real-valued equivalent), group-limited greedy routing.
    "dsv2_moe_sdpa_op18": (
        {**_DSV2, "topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1},
        {"opset": 18, "attn_implementation": "sdpa"},
    ),
    # DeepSeek-V2-Lite: no q LoRA, greedy routing, YaRN.
    "dsv2lite_moe_sdpa_op18": (
        {**_DSV2, "q_lora_rank": None, "rope_parameters": _YARN},
        {"opset": 18, "attn_implementation": "sdpa"},
    ),
    # Kimi-K2 / Moonlight: the DeepSeek-V3 architecture, few heads, one expert group, MoE.
    "kimi_moe_sdpa_op18": (
        _v(
            num_attention_heads=2,
            num_key_value_heads=2,
            first_k_dense_replace=1,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            rope_parameters=_DEFAULT_ROPE,
        ),
        {"opset": 18, "attn_implementation": "sdpa"},
    ),
    # MoE in every layer past the first (3 layers: two MoE layers, consecutive), so that a routed output feeds
    # another attention layer: DeepSeek-V3 with group-limited noaux_tc routing (n_group/topk_group), shared
    # experts and routed_scaling_factor, through both lowerings (sort-based grouped_mm, per-row batched_mm) ...
    "dsv3_moe3_sdpa_op18": (_MOE3_DSV3, {"opset": 18, "attn_implementation": "sdpa"}),
    "dsv3_moe3_batched_op18": (_MOE3_DSV3, {"opset": 18, "attn_implementation": "sdpa", "experts": "batched_mm"}),
    # ... DeepSeek-V2 with group_limited_greedy routing, and DeepSeek-V2-Lite (no q LoRA, greedy, YaRN).
    "dsv2_moe3_sdpa_op18": (
        {
            **_DSV2,
            "num_hidden_layers": 3,
            "n_routed_experts": 8,
            "topk_method": "group_limited_greedy",
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 2.0,
        },
        {"opset": 18, "attn_implementation": "sdpa"},
    ),
    "dsv2lite_moe3_sdpa_op18": (
        {**_DSV2, "num_hidden_layers": 3, "q_lora_rank": None, "rope_parameters": _YARN},
        {"opset": 18, "attn_implementation": "sdpa"},
    ),
    # GLM-4.7-Flash (GLM-4-MoE-Lite) as shipped: dense layer 0, MoE after.
    "glm4moelite_moe_sdpa_op18": (
        {**_GLM4_MOE_LITE, "mlp_layer_types": ["dense", "sparse"]},
        {"opset": 18, "attn_implementation": "sdpa"},
    ),
}


def main(argv: list[str] | None = None) -> int:
    return fixtures_main(FIXTURES, __doc__.splitlines()[0], ROOT / "tests" / "fixtures", argv)


if __name__ == "__main__":
    raise SystemExit(main())
