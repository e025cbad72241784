"""The PyTorch model itself as the parity reference (needs the `export` extra): one sequence at a time, its own
``DynamicCache``, with :class:`support.parity.DenseModel`'s interface so :func:`support.parity.run_parity` can
drive it."""

from __future__ import annotations

import numpy as np
import torch

from support.parity import DenseModel
from support.tolerances import EXPORT_ATOL

__all__ = ["TorchModel", "export_matches_torch"]


class TorchModel:
    """``model`` run by transformers, one sequence at a time, feeding its cache back."""

    def __init__(self, model) -> None:
        self.model = model.eval()

    def new(self) -> dict:
        from transformers import DynamicCache

        return {"len": 0, "cache": DynamicCache(config=self.model.config)}

    def step(self, state: dict, ids: list[int]) -> np.ndarray:
        past, n = state["len"], len(ids)
        with torch.no_grad():
            out = self.model(
                input_ids=torch.tensor([ids]),
                position_ids=torch.arange(past, past + n)[None],
                cache=state["cache"],
                use_cache=True,
            )
        state["cache"], state["len"] = out.cache, past + n
        return out.logits[0, -1].float().numpy()


def export_matches_torch(dense_path, model, *, steps: int = 3, seed: int = 0) -> float:
    """Prefill 7 tokens then ``steps`` single-token decodes on the ONNX export and on ``model`` (feeding the
    export's present KV back); every logits row within ``EXPORT_ATOL`` (fp32 export). Returns the max abs error."""
    onnx_model, ref = DenseModel(dense_path), TorchModel(model)
    a, b = onnx_model.new(), ref.new()
    rng = np.random.default_rng(seed)
    ids = [int(t) for t in rng.integers(0, model.config.vocab_size, 7)]
    worst = 0.0
    for _ in range(steps + 1):
        got, want = onnx_model.step(a, ids), ref.step(b, ids)
        np.testing.assert_allclose(got, want, rtol=0, atol=EXPORT_ATOL, err_msg="ONNX export vs PyTorch")
        worst = max(worst, float(np.abs(got - want).max()))
        ids = [int(want.argmax())]
    return worst
