"""Regenerate the small dense MHA / GQA ONNX fixtures under tests/fixtures/ (torch.onnx dynamo exports).

Sibling of ``scripts/make_fixtures.py`` (the MLA fixtures); same output format: ``<name>.onnx`` plus
``<name>.json`` (config, versions, I/O). Needs the ``export`` extra (torch 2.13.0 CPU, transformers 5.x);
no network: random seeded weights. Usage: ``python scripts/make_fixtures_mha.py [--only NAME ...]``.

Dimensions are chosen for PagedAttention SEPARATE: head_size 16 or 32 (multiples of 16, so RoPE can also move
into the op with ``do_rotary=1``), GQA 4 query heads over 2 KV heads unless the fixture is about MHA.
The sliding-window fixtures use a window of 4 tokens, smaller than the parity tests' contexts (up to ~17), and
mix full and sliding layers so that ``local_window_size`` must be read per layer. The LongRoPE fixture's original
length (32 positions) is crossed by the long prompts of ``tests/rewriter/test_per_sequence.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ortpa.export.hf import fixtures_main  # noqa: E402

_BASE = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}


def _cfg(model_type: str, **over) -> dict:
    return {**_BASE, "model_type": model_type, **over}


# name -> (config, export options). Order: the headline fixture first.
FIXTURES: dict[str, tuple[dict, dict]] = {
    "llama_sdpa_op18": (_cfg("llama"), {"opset": 18, "attn_implementation": "sdpa"}),
    # eager attention, and MHA (as many KV heads as query heads: no repeat_kv in the graph)
    "llama_mha_eager_op18": (_cfg("llama", num_key_value_heads=4), {"opset": 18, "attn_implementation": "eager"}),
    # opset 23: the attention is one ONNX Attention node (with the GQA head repeat outside it)
    "llama_sdpa_op23": (_cfg("llama"), {"opset": 23, "attn_implementation": "sdpa"}),
    # Qwen3: per-head RMSNorm of q and k before RoPE, head_dim 32 (decoupled from hidden / heads)
    "qwen3_sdpa_op18": (_cfg("qwen3", head_dim=32), {"opset": 18, "attn_implementation": "sdpa"}),
    # Qwen2 with a sliding window on layer 1 only (max_window_layers=1); q/k/v projections have biases
    "qwen2_sliding_sdpa_op18": (
        _cfg("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1),
        {"opset": 18, "attn_implementation": "sdpa"},
    ),
    # Gemma-2: attention logit softcapping, a non-default query scale, alternating sliding / full layers
    "gemma2_eager_op18": (
        _cfg(
            "gemma2",
            sliding_window=4,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            query_pre_attn_scalar=32,
        ),
        {"opset": 18, "attn_implementation": "eager"},
    ),
    # Phi-3.5 LongRoPE (packed qkv_proj, MHA): the export picks long or short factors with
    # Where(ReduceMax(position_ids) + 1 > original_max_position_embeddings, long, short); 32 is short enough for
    # the parity tests to cross it with one prompt and stay under it with another.
    "phi3_longrope_sdpa_op18": (
        _cfg(
            "phi3",
            num_key_value_heads=4,
            original_max_position_embeddings=32,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0 + 0.25 * i for i in range(8)],  # head_dim / 2 values each, all distinct
                "long_factor": [2.0 + 1.5 * i for i in range(8)],
            },
        ),
        {"opset": 18, "attn_implementation": "sdpa"},
    ),
}


def main(argv: list[str] | None = None) -> int:
    return fixtures_main(FIXTURES, __doc__.splitlines()[0], ROOT / "tests" / "fixtures", argv)


if __name__ == "__main__":
    raise SystemExit(main())
