"""ortpa.runtime.sampling: greedy, seeded temperature / top-k / top-p, parameter checks."""

from __future__ import annotations

import numpy as np
import pytest

from ortpa.runtime.logits_processing import RowContext
from ortpa.runtime.sampling import InvalidSamplingParams, Sampler, SamplingParams, sample_rows, sample_token

LOGITS = np.array([0.5, 3.0, 2.9, -1.0, 3.0, 0.0])


def _draws(params: SamplingParams, n: int = 400) -> list[int]:
    sampler = Sampler(params)
    return [sampler(LOGITS) for _ in range(n)]


def test_greedy_takes_the_lowest_id_among_ties():
    assert sample_token(LOGITS, SamplingParams(), None) == 1
    assert _draws(SamplingParams(temperature=5.0, top_k=1, seed=0), 20) == [1] * 20


def test_seeded_draws_repeat_and_seeds_differ():
    hot = SamplingParams(temperature=2.0, seed=11)
    assert _draws(hot) == _draws(hot)
    assert _draws(hot) != _draws(SamplingParams(temperature=2.0, seed=12))


def test_top_k_and_top_p_restrict_the_candidates():
    assert set(_draws(SamplingParams(temperature=10.0, top_k=3, seed=1))) == {1, 2, 4}
    # at temperature 1, tokens 1, 4, 2 carry ~0.33, 0.33, 0.30 of the mass: top_p 0.5 keeps two of them
    assert set(_draws(SamplingParams(temperature=1.0, top_p=0.5, seed=2))) == {1, 4}
    # high temperature without filters reaches every token
    assert set(_draws(SamplingParams(temperature=50.0, seed=3))) == set(range(len(LOGITS)))


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_new_tokens", 0), ("temperature", -0.1), ("temperature", float("nan")), ("top_k", -1), ("top_p", 0.0)],
)
def test_invalid_params_raise_typed_errors(field, value):
    with pytest.raises(InvalidSamplingParams, match=f"SamplingParams.{field}: expected"):
        SamplingParams(**{field: value})


def test_stop_token_ids_are_frozen_to_a_tuple():
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    with pytest.raises(InvalidSamplingParams):
        SamplingParams(stop_token_ids=[-1])


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_greedy_rows_without_controls(dtype):
    """The batched greedy path: each row's first maximum; a row with no allowed token (all -inf) gets none; a NaN
    is taken as numpy's argmax takes it (the first NaN), as the processed path would."""
    rows = np.array(
        [LOGITS, np.full(6, -np.inf), [0.0, np.nan, 1.0, np.nan, 2.0, 0.0], LOGITS[::-1], [-np.inf] * 5 + [-7.0]],
        dtype,
    )
    samplers = [Sampler(SamplingParams()) for _ in rows]
    contexts = [RowContext(s.params, [1], 1) for s in samplers]
    assert [s.token_id for s in sample_rows(rows, samplers, contexts)] == [1, None, 1, 1, 5]
    assert all(s.logprobs is None for s in sample_rows(rows, samplers, contexts))
