"""One run of a dense export (past/present KV) on CPU with seeded feeds: a 5-token prompt after a 3-token past,
batch 2. Tests that compare two exports of one model element for element feed both through it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

__all__ = ["dense_outputs"]


def dense_outputs(path: Path, *, vocab: int, seed: int = 0) -> list[np.ndarray]:
    """The model's outputs on prompt ids below ``vocab`` and random past caches of its input dtype."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(seed)
    feeds = {}
    for i in session.get_inputs():
        if i.name == "input_ids":
            feeds[i.name] = rng.integers(0, vocab, (2, 5)).astype(np.int64)
        elif i.name == "attention_mask":
            feeds[i.name] = np.ones((2, 8), np.int64)
        elif i.name == "position_ids":
            feeds[i.name] = np.tile(np.arange(3, 8), (2, 1)).astype(np.int64)
        else:
            shape = [2 if d == "batch" else 3 if d == "past" else d for d in i.shape]
            dtype = np.float16 if i.type == "tensor(float16)" else np.float32
            feeds[i.name] = rng.standard_normal(shape).astype(dtype)
    return session.run(None, feeds)
