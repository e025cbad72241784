"""Tool calling against a live ``ortpa serve`` with the official ``openai`` client: a forced call, the tool's
result sent back, a final answer; a named call streamed as OpenAI's ``tool_calls`` deltas. Random weights: the
calls are made by the grammar that ``required`` and a named ``tool_choice`` impose, and checked against the tool's
parameter schema. Both forms: the Hermes ``<tool_call>`` tags (a live ``ortpa serve``) and Llama 3's bare JSON
(the same app in this process, with Llama 3's template)."""

from __future__ import annotations

import json
import os

import jsonschema
import numpy as np
import pytest

from ortpa.serve.chat import ChatTemplate
from ortpa.serve.structured import GrammarConstraint
from ortpa.serve.tool_calls import parse_tool_calls
from ortpa.serve.tool_requests import forced_call_grammar, template_messages
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


# Llama 3.1's form: calls as bare JSON with "parameters", results as "ipython" turns (no <tool_call> tags)
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% if tools %}system tools: {% for t in tools %}{{ t['function']['name'] }} {% endfor %}\n"
    "{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'tool' %}ipython {{ m['content'] }}\n"
    "{% elif m['role'] == 'assistant' and m['tool_calls'] %}assistant "
    "{% for c in m['tool_calls'] %}"
    "{{ {'name': c['function']['name'], 'parameters': c['function']['arguments']} | tojson }}"
    "{% endfor %}\n{% else %}{{ m['role'] }} {{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)


@pytest.fixture(scope="module")
def llama3_client(structured_folder, tmp_path_factory):
    """The structured folder with Llama 3's tool template, served in this process (the openai client over
    Starlette's test transport: the same app and SSE as ``ortpa serve``, without a second server's start)."""
    from openai import OpenAI
    from starlette.testclient import TestClient

    from ortpa.serve.app import build_app
    from ortpa.serve.model import ServingModel

    folder = tmp_path_factory.mktemp("llama3_tools")
    for f in structured_folder.iterdir():
        if f.name != "tokenizer_config.json":
            os.link(f, folder / f.name)
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": LLAMA3_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    served = ServingModel.load(folder / "model.onnx", name=MODEL_NAME, num_blocks=64, threads=1)
    with TestClient(build_app(served, access_log=False), base_url="http://ortpa") as http:
        yield OpenAI(base_url="http://ortpa/v1", api_key="unused", http_client=http, max_retries=0)


def _call_then_answer(client, tool_choice, seed: int):
    """An agent's turn: a forced call, its result sent back, the final answer; both responses."""
    first = client.chat.completions.create(
        model=MODEL_NAME, messages=USER, tools=TOOLS, tool_choice=tool_choice, max_tokens=64, temperature=1.0, seed=seed
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
    final = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, tools=TOOLS, max_tokens=8, temperature=0
    )
    (answer,) = final.choices
    assert answer.finish_reason in ("stop", "length") and answer.message.tool_calls is None
    assert isinstance(answer.message.content, str)
    return call, messages, final


def _streamed_calls(client, **kw) -> tuple[dict[int, dict], list[str], int]:
    """The calls of a streamed response, accumulated from the deltas as agents accumulate them; the finish
    reasons; how many chunks carried an arguments fragment."""
    calls: dict[int, dict] = {}
    reasons, fragments = [], 0
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            assert not c.delta.content, c.delta
            for d in c.delta.tool_calls or []:
                if d.id is not None:  # the call's first delta: id, type and name
                    assert d.index not in calls and d.type == "function" and d.function.name, d
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                else:
                    assert d.function.name is None, d
                calls[d.index]["arguments"] += d.function.arguments or ""
                fragments += bool(d.function.arguments)
            if c.finish_reason:
                reasons.append(c.finish_reason)
    return calls, reasons, fragments


def test_tool_call_round_trip(structured_client, tmp_path):
    call, messages, final = _call_then_answer(structured_client, "required", seed=3)
    # the server rendered the call (arguments as an object) and the tool's result into the prompt
    template = ChatTemplate(TOOL_TEMPLATE, {"bos_token": "<s>", "eos_token": "</s>"})
    prompt = template.render(template_messages(messages), tools=TOOLS)
    assert "sunny" in prompt and "<tool_call>" in prompt
    assert json.dumps({"name": call.function.name, "arguments": json.loads(call.function.arguments)}) in prompt
    tokenizer = write_byte_tokenizer(tmp_path / "tokenizer.json")
    assert final.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False).ids)


def test_llama3_json_tool_call_round_trip(llama3_client):
    call, messages, _ = _call_then_answer(llama3_client, "required", seed=4)
    prompt = ChatTemplate(LLAMA3_TEMPLATE, {"bos_token": "<s>"}).render(template_messages(messages), tools=TOOLS)
    assert "ipython sunny" in prompt and "<tool_call>" not in prompt
    assert json.dumps({"name": call.function.name, "parameters": json.loads(call.function.arguments)}) in prompt


@pytest.mark.parametrize("form", ["hermes-tags", "llama3-json"])
def test_named_call_streamed_as_argument_deltas(structured_client, llama3_client, form):
    client = structured_client if form == "hermes-tags" else llama3_client
    kw = dict(
        model=MODEL_NAME,
        messages=USER,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "weather"}},
        max_tokens=64,
        temperature=1.0,
        seed=5,
    )
    whole = client.chat.completions.create(**kw).choices[0]
    (whole_call,) = whole.message.tool_calls
    calls, reasons, fragments = _streamed_calls(client, **kw)
    assert reasons == ["tool_calls"] and list(calls) == [0]
    assert calls[0]["id"].startswith("call_") and calls[0]["name"] == whole_call.function.name == "weather"
    # the same seed, the same text: the fragments concatenated are the whole response's arguments, exactly
    assert calls[0]["arguments"] == whole_call.function.arguments
    jsonschema.validate(json.loads(calls[0]["arguments"]), CITY)
    # the arguments came as deltas; how many is timing: a lagging reader gets the tokens generated meanwhile in
    # one chunk (one entry per choice per chunk). Piece-by-piece streaming is test_tool_calls.py's to show.
    assert fragments >= 1, fragments


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
