"""Structured output against a live ``ortpa serve``, with the official ``openai`` client.

The model has random weights, so only the grammar makes its output valid: every schema here bounds its output
(``maxLength``, ``maxItems``, ``enum``, integer bounds; JSON is compact), ``max_tokens`` is above the longest
output the grammar allows (one token per byte, every string character a six-byte escape), and every response
must therefore finish with "stop" and validate; a "length" fails the test.
"""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest

from serve.helpers import MODEL_NAME

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 5},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "kind": {"enum": ["cat", "dog", None]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["name", "age", "ok", "kind", "tags"],
    "additionalProperties": False,
}
POINT = {
    "type": "object",
    "properties": {"x": {"type": "integer", "minimum": -50, "maximum": 50}, "label": {"enum": ["a", "b", "c"]}},
    "required": ["x", "label"],
    "additionalProperties": False,
}
LIST = {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 4}
SCHEMAS = [PERSON, POINT, LIST]
MAX_TOKENS = 160  # PERSON's longest compact output is about 140 bytes
MESSAGES = [{"role": "user", "content": "answer in JSON"}]


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_fifty_sampled_json_schema_responses_validate(structured_server):
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=structured_server.api, api_key="unused", timeout=120, max_retries=0)

    async def one(i: int):
        return await client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            top_p=0.95,
            seed=i,
            response_format=_schema_format(SCHEMAS[i % len(SCHEMAS)]),
        )

    async def all_of_them():
        try:
            return await asyncio.gather(*(one(i) for i in range(50)))
        finally:
            await client.close()

    responses = asyncio.run(all_of_them())
    texts = set()
    for i, r in enumerate(responses):
        (choice,) = r.choices
        assert choice.finish_reason == "stop", (i, choice)
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[i % len(SCHEMAS)])
        texts.add(choice.message.content)
    assert len(texts) > 25  # sampled, not one answer repeated: the grammar constrained real draws


def test_json_object_gives_an_object_or_an_honest_length(structured_client):
    stopped = 0
    for seed in range(6):
        r = structured_client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            max_tokens=96,
            temperature=1.0,
            seed=seed,
            response_format={"type": "json_object"},
        )
        (choice,) = r.choices
        text = choice.message.content
        assert text.startswith("{")
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
            stopped += 1
        else:  # nesting is unbounded: a cut answer says "length" and is not passed off as complete
            assert choice.finish_reason == "length" and r.usage.completion_tokens == 96
    assert stopped >= 1


def test_guided_choice_and_regex(structured_client):
    choices = ["yes", "no", "ask me later"]
    seen = set()
    for seed in range(8):
        r = structured_client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            max_tokens=20,
            temperature=1.0,
            seed=seed,
            extra_body={"guided_choice": choices},
        )
        assert r.choices[0].message.content in choices and r.choices[0].finish_reason == "stop"
        seen.add(r.choices[0].message.content)
    assert len(seen) > 1
    pattern = r"[a-z]{2,6}@[a-z]{2,4}\.(com|org)"
    for seed in range(5):
        r = structured_client.completions.create(
            model=MODEL_NAME,
            prompt="mail:",
            max_tokens=20,
            temperature=1.0,
            seed=seed,
            extra_body={"structured_outputs": {"regex": pattern}},
        )
        assert re.fullmatch(pattern, r.choices[0].text) and r.choices[0].finish_reason == "stop", r.choices[0]


def test_streamed_equals_whole_and_n_choices_each_valid(structured_client):
    kw = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=1.0, seed=7)
    whole = structured_client.chat.completions.create(**kw, response_format=_schema_format(PERSON))
    pieces = [
        c.choices[0].delta.content or ""
        for c in structured_client.chat.completions.create(**kw, response_format=_schema_format(PERSON), stream=True)
        if c.choices
    ]
    assert "".join(pieces) == whole.choices[0].message.content
    several = structured_client.chat.completions.create(**kw, n=3, response_format=_schema_format(POINT))
    assert len(several.choices) == 3
    for c in several.choices:
        jsonschema.validate(json.loads(c.message.content), POINT)


def test_constrained_request_batched_equals_alone(structured_server, structured_client):
    from openai import AsyncOpenAI

    kw = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=1.0, seed=11)
    alone = structured_client.chat.completions.create(**kw, response_format=_schema_format(PERSON))
    client = AsyncOpenAI(base_url=structured_server.api, api_key="unused", timeout=120, max_retries=0)

    async def crowd():
        try:
            others = [
                client.chat.completions.create(**{**kw, "seed": 100 + i}, response_format=_schema_format(POINT))
                for i in range(4)
            ]
            plain = dict(model=MODEL_NAME, max_tokens=30)
            others += [client.completions.create(**plain, prompt="hi " * (i + 1)) for i in range(4)]
            target = client.chat.completions.create(**kw, response_format=_schema_format(PERSON))
            return (await asyncio.gather(target, *others))[0]
        finally:
            await client.close()

    batched = asyncio.run(crowd())
    assert batched.choices[0].message.content == alone.choices[0].message.content


def test_a_tokenizer_the_grammar_engine_cannot_read_is_a_400(server):
    """The main fixture's tokenizer is word-level (WordPiece decoder): said in a 400, not a 500 nor a hang."""
    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=server.api, api_key="unused", timeout=60, max_retries=0)
    with pytest.raises(BadRequestError, match="structured output is not available"):
        client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=10, response_format=_schema_format(POINT)
        )
