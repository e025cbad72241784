"""``Grammars`` without a server: a request's grammar state is its own, even though the matchers of one grammar are
copies of one pristine matcher, and the masks it gives are the grammar's."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ortpa.serve.protocol import ApiError
from ortpa.serve.structured import Grammars, choice_grammar, json_grammar
from ortpa.testing.byte_tokenizer import write_byte_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return write_byte_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json", 256)


def _walk(constraint, tokenizer, seed: int, limit: int = 80) -> str:
    rng = np.random.default_rng(seed)
    out = []
    while not constraint.is_terminated() and len(out) < limit:
        token = int(rng.choice(np.flatnonzero(constraint.allowed_mask(256))))
        constraint.advance(token)
        out.append(token)
    return tokenizer.decode([t for t in out if t != 1])


def test_copies_of_one_grammar_do_not_share_state(tokenizer):
    grammars = Grammars(tokenizer, [1])
    guided = choice_grammar(["alpha", "beta"], "guided_choice")
    first, second = grammars.constraint(guided), grammars.constraint(guided)
    before = second.allowed_mask(256).copy()
    a = tokenizer.token_to_id("a")
    first.advance(a)  # "a": only "alpha" remains for the first
    assert not np.array_equal(first.allowed_mask(256), before)
    assert np.array_equal(second.allowed_mask(256), before)  # the second has not moved
    assert _walk(first, tokenizer, 0) == "lpha"  # the first goes on from its own state
    assert _walk(second, tokenizer, 0) in ("alpha", "beta")  # the second from the start
    third = grammars.constraint(guided)  # a copy made after others advanced starts from the beginning
    assert np.array_equal(third.allowed_mask(256), before)


def test_random_walks_follow_the_schema(tokenizer):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "s": {"enum": ["x", "y"]}},
        "required": ["n", "s"],
        "additionalProperties": False,
    }
    grammars = Grammars(tokenizer, [1])
    guided = json_grammar(schema, "response_format.json_schema.schema")
    for seed in range(6):
        value = json.loads(_walk(grammars.constraint(guided), tokenizer, seed))
        assert set(value) == {"n", "s"} and 0 <= value["n"] <= 99 and value["s"] in ("x", "y")


def test_a_bad_grammar_is_refused_every_time(tokenizer):
    grammars = Grammars(tokenizer, [1])
    guided = json_grammar({"type": "thing"}, "guided_json")
    for _ in range(2):  # not cached as if it were good
        with pytest.raises(ApiError, match="thing") as info:
            grammars.constraint(guided)
        assert info.value.status == 400 and info.value.param == "guided_json"


def test_a_grammar_no_token_can_start_is_a_400(tokenizer):
    """The fixture's byte-level vocabulary holds printable ASCII only: a choice of 'é' cannot be written."""
    grammars = Grammars(tokenizer, [1])
    with pytest.raises(ApiError, match="no token of its vocabulary") as info:
        grammars.constraint(choice_grammar(["é"], "guided_choice"))
    assert (info.value.status, info.value.param, info.value.code) == (400, "guided_choice", "invalid_grammar")
    assert grammars.constraint(choice_grammar(["e"], "guided_choice")).allowed_mask(256).any()
