"""Convert a DeepSeek-V3 export to PagedAttention LATENT, validate it, and greedy-decode by hand.

Shows the low-level loop an engine automates: ``ortpa.convert_file`` writes the paged model, ``ortpa.validate``
checks it against the CUDA kernel's rules, then ``PagedKVCache`` plans each step's index tensors and
``PagedSession`` runs it (caches updated in place): one packed prefill of two prompts, then decode steps.

    python examples/convert_and_run_deepseek.py [DENSE_MODEL.onnx]
"""

import pathlib
import sys
import tempfile

import numpy as np

import ortpa

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT = ROOT / "tests" / "fixtures" / "dsv3_sdpa_op18.onnx"
NEW_TOKENS = 4


def main() -> int:
    dense = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT
    with tempfile.TemporaryDirectory() as tmp:
        paged_path = pathlib.Path(tmp) / "paged.onnx"
        ortpa.convert_file(dense, paged_path)
        report = ortpa.validate(str(paged_path), backend="cuda")
        print(f"converted {dense.name} -> {paged_path.name}; validation for cuda: {'ok' if report.ok else 'FAILED'}")
        if not report.ok:
            print(report.format())
            return 1

        session = ortpa.PagedSession(str(paged_path), num_blocks=16, block_size=16)
        kv = ortpa.PagedKVCache(num_blocks=16, block_size=16)
        prompts = {"a": [1, 2, 3, 4, 5], "b": [10, 11, 12]}
        generated: dict[str, list[int]] = {s: [] for s in prompts}
        for seq in prompts:
            kv.add_sequence(seq)

        # Step 0 prefills both prompts packed in one row; each later step feeds one new token per sequence.
        pending = dict(prompts)
        for step_no in range(NEW_TOKENS):
            step = kv.plan_step([(s, len(ids)) for s, ids in pending.items()])
            logits = session.run(
                {
                    "input_ids": np.array([t for ids in pending.values() for t in ids], dtype=np.int64),
                    "cumulative_sequence_lengths": step.cumulative_sequence_length,
                    "past_sequence_lengths": step.past_seqlens,
                    "block_table": step.block_table,
                    "attention_metadata": step.attention_metadata,
                }
            )["logits"]
            tokens = logits.argmax(axis=-1)  # one row per sequence: its last new token
            kind = "prefill" if step_no == 0 else "decode"
            print(f"step {step_no} ({kind}, {step.num_tokens} packed tokens): next tokens {tokens.tolist()}")
            pending = {}
            for seq, token in zip(prompts, tokens, strict=True):
                generated[seq].append(int(token))
                pending[seq] = [int(token)]

        for seq, ids in prompts.items():
            print(f"sequence {seq}: prompt {ids} -> generated {generated[seq]}")
        print(f"cache layout: {session.cache_names[0]} {session.cache(session.cache_names[0]).shape}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
