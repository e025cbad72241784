"""Tool calling against a live ``ortpa serve`` with the official ``openai`` client: a forced call, the tool's
result sent back, a final answer; a named call streamed as OpenAI's ``tool_calls`` deltas. Random weights: the
calls are made by the grammar that ``required`` and a named ``tool_choice`` impose, and checked against the tool's
parameter schema."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from ortpa.serve.chat import ChatTemplate
from ortpa.serve.structured import GrammarConstraint
from ortpa.serve.tool_calls import forced_call_grammar, parse_tool_calls, template_messages
from serve.helpers import MODEL_NAME
from serve.structured_fixtures import TOOL_TEMPLATE, write_byte_tokenizer

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 6}},
    "required": ["city"],
    "additionalProperties": False,
}
DAYS = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["n"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": CITY}},
    {"type": "function", "function": {"name": "days", "parameters": DAYS}},
]
SCHEMAS = {"weather": CITY, "days": DAYS}
USER = [{"role": "user", "content": "weather?"}]


def test_tool_call_round_trip(structured_client, tmp_path):
    first = structured_client.chat.completions.create(
        model=MODEL_NAME, messages=USER, tools=TOOLS, tool_choice="required", max_tokens=64, temperature=1.0, seed=3
    )
    (choice,) = first.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])

    messages = [
        *USER,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    final = structured_client.chat.completions.create(
        model=MODEL_NAME, messages=messages, tools=TOOLS, max_tokens=8, temperature=0
    )
    (answer,) = final.choices
    assert answer.finish_reason in ("stop", "length") and answer.message.tool_calls is None
    assert isinstance(answer.message.content, str)
    # the server rendered the call (arguments as an object) and the tool's result into the prompt
    template = ChatTemplate(TOOL_TEMPLATE, {"bos_token": "<s>", "eos_token": "</s>"})
    prompt = template.render(template_messages(messages), tools=TOOLS)
    assert "sunny" in prompt and call.function.arguments in prompt
    tokenizer = write_byte_tokenizer(tmp_path / "tokenizer.json")
    assert final.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False).ids)


def test_named_call_streamed_as_deltas_equals_whole(structured_client):
    kw = dict(
        model=MODEL_NAME,
        messages=USER,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "days"}},
        max_tokens=64,
        temperature=1.0,
        seed=5,
    )
    whole = structured_client.chat.completions.create(**kw).choices[0]
    (whole_call,) = whole.message.tool_calls
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in structured_client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            assert not c.delta.content
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = d.id or entry["id"]
                entry["name"] += (d.function.name or "") if d.function else ""
                entry["arguments"] += (d.function.arguments or "") if d.function else ""
            if c.finish_reason:
                reasons.append(c.finish_reason)
    assert reasons == ["tool_calls"] and list(calls) == [0]
    assert calls[0]["id"].startswith("call_") and calls[0]["name"] == whole_call.function.name == "days"
    assert json.loads(calls[0]["arguments"]) == json.loads(whole_call.function.arguments)
    jsonschema.validate(json.loads(calls[0]["arguments"]), DAYS)


@pytest.mark.parametrize("tagged", [True, False], ids=["hermes-tags", "llama3-json"])
def test_forced_call_grammar_gives_parsable_calls(tmp_path, tagged):
    """Random walks through the forced-call grammar, in both forms, all parse back into a valid call."""
    import llguidance as llg

    from ortpa.serve.protocol import Tool

    tokenizer = write_byte_tokenizer(tmp_path / "tokenizer.json")
    ll = llg.LLTokenizer(tokenizer.to_str(), eos_token=[1])
    grammar = forced_call_grammar([Tool.model_validate(t) for t in TOOLS], None, tagged)
    rng = np.random.default_rng(0)
    names = set()
    for _ in range(10):
        constraint = GrammarConstraint(llg.LLMatcher(ll, grammar), [1], ll.vocab_size)
        out = []
        while not constraint.is_terminated() and len(out) < 200:
            token = int(rng.choice(np.flatnonzero(constraint.allowed_mask(ll.vocab_size))))
            constraint.advance(token)
            out.append(token)
        assert not constraint.error
        text = tokenizer.decode([t for t in out if t != 1])
        assert text.startswith("<tool_call>") == tagged
        content, (call,) = parse_tool_calls(text)
        assert content is None
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        names.add(call.name)
    assert names == {"weather", "days"}
