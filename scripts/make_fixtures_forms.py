"""Build the fixtures of attention forms that one exporter writes and no other fixture covers (issue 24).

* ``onnxexporter_neox``: GPT-NeoX through transformers 5.x ``OnnxExporter`` (as ``make_fixtures_formats.py``'s
  ``onnxexporter_llama``): one fused QKV projection whose output is viewed per head ``[B, S, H, 3*D]`` and split
  along its last axis (each head's q, k, v adjacent), partial rotary (``rotary_pct`` 0.25).
* ``onnxexporter_falcon_mqa``: Falcon with ``multi_query``: one fused projection ``[(H + 2) * D]``, a single K/V head
  read by the attention broadcast over the query heads (no repeat_kv).

Each is written as one self-contained file (< 1 MB) in ``tests/fixtures/forms/`` with a JSON description.
Usage: ``python scripts/make_fixtures_forms.py`` (transformers 5.x, torch CPU; about a minute).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import onnx

sys.path.insert(0, str(Path(__file__).parent))
import make_fixtures_formats as formats

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "forms"

_COMMON = {"vocab_size": formats.VOCAB, "num_hidden_layers": 2, "max_position_embeddings": 256,
           "bos_token_id": formats.BOS, "eos_token_id": formats.EOS, "pad_token_id": formats.PAD,
           "tie_word_embeddings": False}  # fmt: skip
CONFIGS = {
    "onnxexporter_neox": {**_COMMON, "model_type": "gpt_neox", "hidden_size": 64, "num_attention_heads": 4,
                          "intermediate_size": 128, "rotary_pct": 0.25, "use_parallel_residual": True},
    "onnxexporter_falcon_mqa": {**_COMMON, "model_type": "falcon", "hidden_size": 64, "num_attention_heads": 4,
                                "multi_query": True, "new_decoder_architecture": False, "parallel_attn": True,
                                "bias": False, "alibi": False},
}  # fmt: skip


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, cfg in CONFIGS.items():
        with tempfile.TemporaryDirectory(prefix=f"fx_{name}_") as tmp:
            work = Path(tmp)
            formats.build_hf_dir(cfg, work / "hf")
            path, cmd, _ = formats._export_onnx_exporter(work / "hf", work, {})
            dst = OUT / f"{name}.onnx"
            onnx.save_model(onnx.load(str(path)), str(dst), save_as_external_data=False)
        info = {"name": name, "tool": "onnx_exporter", "command": cmd, "seed": formats.SEED, "config": cfg,
                "versions": formats._versions(["transformers", "torch", "onnxscript", "onnx"])}  # fmt: skip
        (OUT / f"{name}.json").write_text(json.dumps(info, indent=1) + "\n")
        print(f"ok {name}: {dst.stat().st_size / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
