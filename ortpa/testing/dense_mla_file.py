"""The dense MLA test model written straight to a file with external data, for models of any size.

:func:`write_dense_mla` builds the same graph as :func:`ortpa.testing.dense_mla.build_dense_mla`, but each
weight is generated, appended to ``<model>.data`` and dropped before the next one: neither the weights nor a
protobuf holding them is ever in memory at once (a 3 GB model is built in a few hundred MB). The weights are
seeded per tensor (not the in-memory builder's single stream), so they differ from ``build_dense_mla``'s.
``draw="uniform"`` draws them uniform (same variance) in float32, ~4x faster than the normal float64 draws: the
multi-GB tests spend most of their time making weights otherwise.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, Literal

import numpy as np
import onnx

from ortpa.testing.dense_mla import DenseMlaConfig, DenseMlaLayerWeights, _Graph, _graph_model

__all__ = ["write_dense_mla"]

_INLINE_BYTES = 1024  # smaller tensors (norm weights of tiny models, shape constants) stay in the protobuf


class _FileGraph(_Graph):
    """A builder graph whose weights go to an open data file as they are added."""

    def __init__(self, data: BinaryIO, location: str) -> None:
        super().__init__()
        self._data = data
        self._location = location

    def init(self, name: str, array: np.ndarray) -> str:
        array = np.ascontiguousarray(array)
        if array.nbytes < _INLINE_BYTES:
            return super().init(name, array)
        offset = self._data.tell()
        array.tofile(self._data)
        tensor = onnx.TensorProto(name=name, data_type=onnx.helper.np_dtype_to_tensor_dtype(array.dtype))
        tensor.dims.extend(array.shape)
        tensor.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", self._location), ("offset", str(offset)), ("length", str(array.nbytes))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        self.initializers.append(tensor)
        return name


class _LazyWeights:
    """DenseMlaWeights whose arrays are generated when the builder reaches them (one layer at a time)."""

    def __init__(self, c: DenseMlaConfig, draw: Literal["normal", "uniform"]) -> None:
        self.c = c
        self.draw = draw

    def _rng(self, *key: int) -> np.random.Generator:
        return np.random.default_rng([self.c.seed, *key])

    def _lin(self, rng: np.random.Generator, d_in: int, d_out: int, gain: float = 1.0) -> np.ndarray:
        if self.draw == "uniform":  # unit variance: uniform on [-sqrt(3), sqrt(3)]
            out = rng.random((d_in, d_out), dtype=np.float32)
            out -= 0.5
            out *= math.sqrt(12.0) * gain / math.sqrt(d_in)
            return out
        out = np.empty((d_in, d_out), np.float32)
        for r in range(0, d_in, 256):  # float64 draws in row chunks: no full-size float64 temporary
            rows = min(256, d_in - r)
            out[r : r + rows] = rng.standard_normal((rows, d_out)) * (gain / math.sqrt(d_in))
        return out

    def _norm(self, rng: np.random.Generator, d: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32)

    @property
    def embed(self) -> np.ndarray:
        rng = self._rng(1_000_001)
        return self._lin(rng, self.c.vocab, self.c.hidden, math.sqrt(self.c.vocab))  # unit variance

    @property
    def norm(self) -> np.ndarray:
        return self._norm(self._rng(1_000_002), self.c.hidden)

    @property
    def lm_head(self) -> np.ndarray:
        return self._lin(self._rng(1_000_003), self.c.hidden, self.c.vocab, self.c.logit_gain)

    @property
    def layers(self) -> Iterator[DenseMlaLayerWeights]:
        c = self.c
        H, P, R, V, L, D = c.heads, c.qk_nope, c.qk_rope, c.v_head, c.kv_lora_rank, c.hidden
        for i in range(c.layers):
            rng = self._rng(i)
            q_in = c.q_lora_rank or D
            yield DenseMlaLayerWeights(
                input_norm=self._norm(rng, D),
                q_a=self._lin(rng, D, c.q_lora_rank) if c.q_lora_rank else None,
                q_a_norm=self._norm(rng, c.q_lora_rank) if c.q_lora_rank else None,
                q_b=self._lin(rng, q_in, H * (P + R)),
                kv_a=self._lin(rng, D, L + R),
                kv_a_norm=self._norm(rng, L),
                kv_b=self._lin(rng, L, H * (P + V)),
                o=self._lin(rng, H * V, D, 0.5),
                post_norm=self._norm(rng, D),
                gate=self._lin(rng, D, c.intermediate),
                up=self._lin(rng, D, c.intermediate),
                down=self._lin(rng, c.intermediate, D, 0.5),
            )


def write_dense_mla(
    config: DenseMlaConfig, path: str | os.PathLike, draw: Literal["normal", "uniform"] = "normal"
) -> Path:
    """Write the dense model to ``path`` with its weights in ``<path>.data``; returns ``path``. ``draw``: the
    weights' distribution (module docstring).

    Memory: one layer's weights at most (the arrays are written and dropped as the graph is built); the
    protobuf holds only the graph, so any size that fits on disk can be built.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    location = path.name + ".data"
    with open(path.parent / location, "wb") as data:
        model = _graph_model(config, _LazyWeights(config, draw), _FileGraph(data, location))  # type: ignore[arg-type]
    # exports carry value_info for every intermediate; inference reads dims only, never the external bytes
    model = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)
    onnx.save_model(model, str(path))
    onnx.checker.check_model(str(path))
    return path
