"""``ortpa bench --only mla_vs_dense`` (``ortpa/bench/mla_vs_dense.py``) in its quick mode: the rows are there for
every path, and every path's timed output agrees with the dense original's (the bench checks what it times)."""

from __future__ import annotations

import numpy as np
import pytest

from ortpa.bench import run_benchmarks
from ortpa.bench.mla_vs_dense import PATHS, MlaBenchMismatch, check_outputs
from ortpa.tolerances import precision_logit_bound


@pytest.fixture(scope="module")
def rows() -> dict[str, dict]:
    got = run_benchmarks(None, names=["mla_vs_dense"], quick=True)  # prefill 64, decode at context 128
    return {r["name"]: r for r in got}


def test_rows_for_every_path_prefill_and_decode(rows):
    assert {r["benchmark"] for r in rows.values()} == {"mla_vs_dense"}
    for kind, tag in (("prefill", "64"), ("decode", "ctx128")):
        for path in ("dense", *PATHS):
            timed = rows[f"{kind}_ms/{path}/{tag}"]
            assert timed["unit"] == "ms" and timed["value"] > 0
        for path in PATHS:
            ratio = rows[f"{kind}_ratio/{path}/{tag}"]["value"]
            expected = rows[f"{kind}_ms/{path}/{tag}"]["value"] / rows[f"{kind}_ms/dense/{tag}"]["value"]
            assert ratio == pytest.approx(expected, rel=1e-3)  # measured in the same run
            assert f"max_abs_err/{path}/{kind}/{tag}" in rows
    assert set(PATHS) == {"absorbed_native", "absorbed_portable", "expanded_native"}


def test_every_path_agrees_with_the_dense_original(rows):
    bound = precision_logit_bound("float16")  # the conversion's cache dtype
    errors = {name: r["value"] for name, r in rows.items() if name.startswith("max_abs_err/")}
    assert len(errors) == 2 * len(PATHS)
    for name, err in errors.items():
        assert 0.0 <= err <= bound, name
    # the check the bench runs on every timed output refuses a path off by more than the bound
    dense = np.linspace(-3.0, 3.0, 64, dtype=np.float32)
    within = check_outputs("t", {"dense": dense, "p": dense + bound / 2}, np.float16)
    assert within == pytest.approx({"p": bound / 2}, rel=1e-3)
    with pytest.raises(MlaBenchMismatch, match="path p"):
        check_outputs("t", {"dense": dense, "p": dense + 2 * bound}, np.float16)
    with pytest.raises(MlaBenchMismatch):
        check_outputs("t", {"dense": dense, "p": np.full_like(dense, np.nan)}, np.float16)
