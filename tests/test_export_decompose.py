"""The export's decomposition step without torch's retrace (``ortpa.export.decompose``): taken where the graph needs
no decomposition but one-for-one renames, refused where it needs more, and computing what the retrace computes.

Small modules check each rename against PyTorch itself; the family cases export one model both ways (the lean path
by default, ``ORTPA_EXPORT_DECOMPOSITION=retrace`` for torch's own) and compare ONNX Runtime's outputs element for
element: the same arithmetic, whatever differs in how sizes are read.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from support.dense_run import dense_outputs

from ortpa.export.decompose import ENV, lean_decomposition
from ortpa.export.hf import export_hf
from ortpa.testing.sweep.space import draw
from ortpa.tolerances import tol_for

pytestmark = pytest.mark.export


class _Renamed(torch.nn.Module):
    """Every op the lean path renames or drops: ``&``, ``|``, ``.to(dtype)`` (changing and not), ``detach``."""

    def forward(self, x, y):
        both = (x > 0) & (y > 0)
        either = (x < -1) | (y < -1)
        half = x.to(torch.float16).to(torch.float32)  # a real cast: rounding PyTorch and ONNX Runtime share
        same = y.to(torch.float32).detach()
        return torch.where(both, half, same) + either.to(x.dtype)


class _Filled(torch.nn.Module):
    """MLA's key assembly in transformers: slices of a fresh tensor filled in place, then the tensor read."""

    def forward(self, a, b):
        out = a.new_empty(*a.shape[:-1], a.shape[-1] + b.shape[-1])
        out[..., : a.shape[-1]].copy_(a)
        out[..., a.shape[-1] :].copy_(b.expand(*a.shape[:-1], -1))
        return out * 2


class _ReadBetween(torch.nn.Module):
    """A fresh tensor read between its fills: the read sees half of it, which only the retrace keeps."""

    def forward(self, a):
        out = torch.zeros(a.shape[0], 2 * a.shape[1])
        out[:, : a.shape[1]].copy_(a)
        first = out.sum(-1, keepdim=True)
        out[:, a.shape[1] :].copy_(a * 3)
        return out + first


class _InPlace(torch.nn.Module):
    """An op writing a tensor a view of it still reads afterwards: only the retrace keeps the view's sight of it."""

    def forward(self, x):
        y = x * 2
        row = y[0]
        y.add_(1)
        return y * x + row


class _Router(torch.nn.Module):
    """DeepSeek's MoE router and dispatch: in-place ops on fresh tensors, read before them only by plain ops and
    after them only through their results (written as the functional ops)."""

    def forward(self, scores, idx, values):
        mask = torch.zeros_like(scores)
        mask.scatter_(1, idx, 1.0)
        weights = scores.gather(1, idx)
        total = weights.sum(-1, keepdim=True)
        weights /= total
        out = torch.empty_like(values)
        out[idx[:, 0]] = values * 2
        return mask * scores, weights, out


class _Plain(torch.nn.Module):
    """One dtype throughout: nothing to promote."""

    def forward(self, x, y):
        return x * y + x.softmax(-1)


class _Mixed(torch.nn.Module):
    """Ops whose operands torch promotes: half times float, integer true division."""

    def forward(self, x, n):
        return x.to(torch.float16) * x + n / (n + 1)


def _export(module: torch.nn.Module, args: tuple, path: Path, what: str = "decomposition") -> str:
    with lean_decomposition() as record:
        torch.onnx.export(module.eval(), args, str(path), dynamo=True, optimize=False, verbose=False)
    return record[what]


def _run(path: Path, args: tuple) -> list[np.ndarray]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    return session.run(None, {n: a.numpy() for n, a in zip(names, args, strict=True)})


def test_renamed_ops_compute_what_pytorch_computes(tmp_path):
    gen = torch.Generator().manual_seed(0)
    args = (torch.randn(4, 8, generator=gen) * 3, torch.randn(4, 8, generator=gen) * 3)
    path = tmp_path / "renamed.onnx"
    assert _export(_Renamed(), args, path) == "lean"
    (got,) = _run(path, args)
    np.testing.assert_array_equal(got, _Renamed()(*args).numpy())


def test_lazy_signatures_write_the_same_graph_byte_for_byte(tmp_path):
    import onnx

    args = (torch.randn(4, 8), torch.randn(4, 8))
    protos = []
    for lazy in (True, False):
        path = tmp_path / f"lazy_{lazy}.onnx"
        with lean_decomposition(lazy_signatures=lazy):
            torch.onnx.export(_Renamed().eval(), args, str(path), dynamo=True, optimize=False, verbose=False)
        proto = onnx.load(str(path))
        for node in proto.graph.node:
            del node.metadata_props[:]  # stack traces name this test's lines
        protos.append(proto.SerializeToString())
    assert protos[0] == protos[1]


def test_type_promotion_runs_where_operands_need_it_and_only_there(tmp_path):
    args = (torch.linspace(-2, 2, 12).reshape(3, 4), torch.arange(12).reshape(3, 4))
    mixed = tmp_path / "mixed.onnx"
    assert _export(_Mixed(), args, mixed, "type_promotion") == "run"
    (got,) = _run(mixed, args)
    np.testing.assert_array_equal(got, _Mixed()(*args).numpy())
    same = (torch.ones(2, 3), torch.ones(2, 3))
    assert _export(_Plain(), same, tmp_path / "same.onnx", "type_promotion") == "not needed"
    # a comparison with a Python int: the pass makes the scalar a float tensor, so it runs
    assert _export(_Renamed(), same, tmp_path / "scalar.onnx", "type_promotion") == "run"


def test_slice_fills_of_a_fresh_tensor_are_written_as_scatters(tmp_path):
    gen = torch.Generator().manual_seed(1)
    args = (torch.randn(2, 3, 4, 5, generator=gen), torch.randn(2, 1, 4, 3, generator=gen))
    path = tmp_path / "filled.onnx"
    assert _export(_Filled(), args, path) == "lean"
    (got,) = _run(path, args)
    np.testing.assert_array_equal(got, _Filled()(*args).numpy())
    between = (torch.randn(3, 4, generator=gen),)
    with lean_decomposition() as record:
        torch.onnx.export(_ReadBetween().eval(), between, str(tmp_path / "b.onnx"), dynamo=True, optimize=False)
    assert record["decomposition"] == "retraced"
    assert record["retraced_because"] == "aten.copy_.default writes its input (the tensor read between its fills)"
    (got,) = _run(tmp_path / "b.onnx", between)
    rtol, atol = tol_for(np.float32)
    np.testing.assert_allclose(got, _ReadBetween()(*between).numpy(), rtol=rtol, atol=atol)


def test_an_in_place_op_a_view_sees_takes_the_retrace(tmp_path):
    args = (torch.arange(6, dtype=torch.float32).reshape(2, 3),)
    path = tmp_path / "inplace.onnx"
    with lean_decomposition() as record:
        torch.onnx.export(_InPlace().eval(), args, str(path), dynamo=True, optimize=False, verbose=False)
    assert record["decomposition"] == "retraced"
    assert (
        record["retraced_because"] == "aten.add_.Tensor writes its input (the tensor read after it, viewed or written)"
    )
    (got,) = _run(path, args)
    np.testing.assert_array_equal(got, _InPlace()(*args).numpy())


def test_in_place_ops_on_fresh_tensors_are_written_as_functional_ops(tmp_path):
    gen = torch.Generator().manual_seed(2)
    scores = torch.rand(5, 8, generator=gen) + 0.1
    # three distinct columns of 8 per row, each below 5: also row ids of `values` (written by index)
    idx = torch.stack([torch.randperm(5, generator=gen)[:3] for _ in range(5)])
    values = torch.randn(5, 4, generator=gen)
    args = (scores, idx, values)
    path = tmp_path / "router.onnx"
    assert _export(_Router(), args, path) == "lean"
    got = _run(path, args)
    want = _Router()(*args)
    np.testing.assert_array_equal(got[0], want[0].numpy())
    np.testing.assert_array_equal(got[1], want[1].numpy())
    written = np.unique(args[1][:, 0].numpy())  # empty_like's other rows hold whatever memory held
    np.testing.assert_array_equal(got[2][written], want[2].numpy()[written])


def test_the_environment_forces_the_retrace_and_rejects_other_values(tmp_path, monkeypatch):
    args = (torch.ones(2, 3), torch.ones(2, 3))
    monkeypatch.setenv(ENV, "retrace")
    assert _export(_Renamed(), args, tmp_path / "forced.onnx") == "retraced"
    monkeypatch.setenv(ENV, "sometimes")
    with pytest.raises(ValueError, match="ORTPA_EXPORT_DECOMPOSITION must be 'lean' or 'retrace', found 'sometimes'"):
        _export(_Renamed(), args, tmp_path / "bad.onnx")


_DEFAULT = ["llama", "deepseek_v3"]  # plain attention; MLA with MoE (its router's in-place ops made functional)
_MORE = ["qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3", "deepseek_v2", "minicpm3"]


@pytest.mark.parametrize(
    "family", [*_DEFAULT, *(pytest.param(f, marks=pytest.mark.slow) for f in _MORE)]
)  # fmt: skip
def test_lean_export_computes_what_the_retraced_export_computes(family, tmp_path, monkeypatch):
    d = draw(family, 0)
    config = {k: v for k, v in d.config.items() if k != "layer_types"}
    config["num_hidden_layers"] = 2
    kw = dict(random_weights=True, optimize=False, attn_implementation=d.attn_implementation, repeat_layers=False)
    lean, full = tmp_path / "lean" / "model.onnx", tmp_path / "full" / "model.onnx"
    info = export_hf(config, lean, **kw)
    assert (info["decomposition"], info["retraced_because"]) == ("lean", "")
    monkeypatch.setenv(ENV, "retrace")
    forced = export_hf(config, full, **kw)
    assert (forced["decomposition"], forced["type_promotion"]) == ("retraced", "run")
    for x, y in zip(dense_outputs(lean, vocab=200), dense_outputs(full, vocab=200), strict=True):
        np.testing.assert_array_equal(x, y)
