"""Greedy generation over an ``ortpa convert --portable`` file in plain ONNX Runtime: no ortpa import.

    python examples/portable_greedy.py model.onnx --prompt-ids 1,2,3 --prompt-ids 7,8 --max-new-tokens 16

prints ``{"outputs": [[ids...], ...]}`` in prompt order, as ``ortpa generate --json`` does for the same
prompts. The part between the ``loop`` markers is the loop in ``docs/converted_model.md`` (a test keeps them
equal); it only needs ``numpy`` and ``onnxruntime`` (or ``onnxruntime-openvino`` with ``--provider
OpenVINOExecutionProvider``).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

# --- loop: begin
import numpy as np
import onnxruntime as ort


def open_portable(path, providers=("CPUExecutionProvider",), options=None):
    """Open the file; refuse a runtime older than the one its metadata names (never run into a known crash)."""
    session = ort.InferenceSession(str(path), options, providers=list(providers))
    meta = session.get_modelmeta().custom_metadata_map
    need = meta.get("ortpa.portable.min_onnxruntime")
    have = ort.__version__.split("+")[0]
    if need and tuple(map(int, have.split(".")[:2])) < tuple(map(int, need.split(".")[:2])):
        raise RuntimeError(f"{path} needs onnxruntime >= {need}, found {have}")
    return session


def greedy(session, prompts, max_new_tokens, block_size=16):
    """Each prompt's ``max_new_tokens`` greedy tokens; all prompts batched in every step (a prefill, then decodes)."""
    caches = [i for i in session.get_inputs() if i.name.startswith("past_key_values.")]
    dtypes = {"tensor(float16)": np.float16, "tensor(float)": np.float32, "tensor(int8)": np.int8}
    # each sequence owns the blocks of its whole generation, in a row of the block table (-1 = unmapped)
    per_seq = -(-max(len(p) + max_new_tokens for p in prompts) // block_size)
    block_table = np.arange(len(prompts) * per_seq, dtype=np.int32).reshape(len(prompts), per_seq)
    kv = {c.name: np.zeros((block_table.size, block_size, *c.shape[2:]), dtypes[c.type]) for c in caches}
    past = np.zeros(len(prompts), np.int32)  # tokens already in the cache, per sequence
    new = [list(p) for p in prompts]  # each sequence's tokens to feed this step
    out = [[] for _ in prompts]
    for _ in range(max_new_tokens):
        lengths = np.array([len(t) for t in new], np.int32)
        feeds = {
            "input_ids": np.array([t for seq in new for t in seq], np.int64),  # packed, no padding
            "cumulative_sequence_lengths": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
            "past_sequence_lengths": past,
            "block_table": block_table,
            # max query length, max KV length (past + new), and a lower bound on the longest KV length
            "attention_metadata": np.array([lengths.max(), (past + lengths).max(), (past + lengths).max()], np.int32),
            **kv,
        }
        feeds = {k: v for k, v in feeds.items() if k in {i.name for i in session.get_inputs()}}
        names = ["logits"] + [c.name.replace("past_key_values.", "present.") for c in caches]
        logits, *present = session.run(names, feeds)  # logits: [batch, vocab], one row per sequence's last token
        kv = {c.name: p for c, p in zip(caches, present, strict=True)}  # the written caches are the next step's input
        past = past + lengths
        for s, token in enumerate(logits.argmax(axis=-1).tolist()):
            out[s].append(token)
            new[s] = [token]
    return out


# --- loop: end


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--prompt-ids", action="append", required=True, help="comma-separated ids; repeat for more")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--provider", action="append", help="execution provider (repeatable; default: CPU)")
    ap.add_argument("--placement", action="store_true", help="also report which provider ran which kernels")
    args = ap.parse_args(argv)
    prompts = [[int(t) for t in p.split(",")] for p in args.prompt_ids]
    options = ort.SessionOptions()
    options.enable_profiling = args.placement
    if args.placement:
        options.profile_file_prefix = str(Path(tempfile.mkdtemp()) / "profile")
    session = open_portable(args.model, args.provider or ["CPUExecutionProvider"], options)
    result = {"outputs": greedy(session, prompts, args.max_new_tokens, args.block_size)}
    if args.placement:
        result["placement"] = placement(session.end_profiling())
    print(json.dumps(result))


def placement(profile: str) -> dict:
    """Kernels each provider ran in the first step (ONNX Runtime's profile): a compiling provider (OpenVINO) runs
    its subgraphs as one kernel each, the CPU EP what was left to it, op by op."""
    events = [e for e in json.loads(Path(profile).read_text()) if e.get("cat") == "Node" and "provider" in e["args"]]
    first = {}
    for e in events:  # every step runs the same kernels: count one step's
        first.setdefault(e["name"], e["args"])
    counts: dict[str, dict[str, int]] = {}
    for a in first.values():
        per = counts.setdefault(a["provider"], {})
        per[a["op_name"]] = per.get(a["op_name"], 0) + 1
    return counts


if __name__ == "__main__":
    main()
