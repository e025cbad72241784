"""The engine's constraint hook: masks applied to the batch's logits, advanced per token, ending the request.

The constraints here are plain Python state machines (no grammar library), so the hook is tested on its own:
a forced sequence must come out exactly, an allowed set must hold for every token under sampling, and the
unconstrained requests of the same steps must get the tokens they get alone.
"""

from __future__ import annotations

import numpy as np

from ortpa.runtime.constraints import TokenConstraint
from ortpa.runtime.engine import Engine, SamplingParams
from ortpa.testing.toy_lm import ToyLMConfig, build_toy_lm, toy_lm_weights

CFG = ToyLMConfig()
MODEL = build_toy_lm(CFG, toy_lm_weights(CFG))
PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3]]


class Forced:
    """Allows exactly ``sequence``, one token at a time; terminated after its last token."""

    def __init__(self, sequence: list[int]) -> None:
        self.sequence, self.pos, self.seen = sequence, 0, []

    def allowed_mask(self, vocab_size: int) -> np.ndarray:
        mask = np.zeros(vocab_size, bool)
        mask[self.sequence[self.pos]] = True
        return mask

    def advance(self, token_id: int) -> None:
        self.seen.append(token_id)
        self.pos += 1

    def is_terminated(self) -> bool:
        return self.pos == len(self.sequence)


class Subset:
    """Allows ``allowed`` at every step; never terminates (the request ends by length)."""

    def __init__(self, allowed: list[int]) -> None:
        self.allowed = allowed

    def allowed_mask(self, vocab_size: int) -> np.ndarray:
        mask = np.zeros(vocab_size, bool)
        mask[self.allowed] = True
        return mask

    def advance(self, token_id: int) -> None:
        pass

    def is_terminated(self) -> bool:
        return False


def _engine() -> Engine:
    return Engine(MODEL, num_blocks=64, block_size=4, providers=["CPUExecutionProvider"])


def test_the_protocol_is_checkable():
    assert isinstance(Forced([1]), TokenConstraint) and isinstance(Subset([1]), TokenConstraint)


def test_forced_sequence_comes_out_and_ends_with_stop_while_others_run_as_alone():
    plain = SamplingParams(max_new_tokens=6)
    alone = [_engine().generate([p], plain)[0] for p in (PROMPTS[0], PROMPTS[2])]
    # the forced tokens are the ones greedy decoding is least likely to pick: the row's last ids
    forced = Forced([CFG.vocab - 1, CFG.vocab - 2, CFG.vocab - 3])
    sampled = Forced([7, 0, 7, 0])
    engine = _engine()
    ids = [
        engine.add_request(PROMPTS[0], plain),
        engine.add_request(PROMPTS[1], SamplingParams(max_new_tokens=10, constraint=forced)),
        engine.add_request(PROMPTS[2], plain),
        engine.add_request(PROMPTS[1], SamplingParams(max_new_tokens=10, temperature=1.0, seed=3, constraint=sampled)),
    ]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    reasons: dict[str, str | None] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    assert tokens[ids[1]] == forced.sequence and forced.seen == forced.sequence
    assert tokens[ids[3]] == sampled.sequence
    assert reasons[ids[1]] == reasons[ids[3]] == "stop"
    assert [tokens[ids[0]], tokens[ids[2]]] == alone
    assert reasons[ids[0]] == "length"


def test_every_sampled_token_is_allowed():
    allowed = list(range(1, CFG.vocab, 7))
    engine = _engine()
    for seed in range(4):
        params = SamplingParams(max_new_tokens=12, temperature=1.5, top_k=40, seed=seed, constraint=Subset(allowed))
        (out,) = engine.generate([PROMPTS[seed % 3]], params)
        assert len(out) == 12 and set(out) <= set(allowed), out
    # and the same draws without the constraint leave the set: the mask is what kept them in it
    free = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=12, temperature=1.5, top_k=40, seed=0))[0]
    assert not set(free) <= set(allowed)
