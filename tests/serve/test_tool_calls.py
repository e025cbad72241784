"""Tool calls read out of generated text: the Hermes/Qwen tagged form, Llama 3's bare JSON, and the stream that
passes content on at once and each call whole, whatever the chunking of the text."""

from __future__ import annotations

import json

import pytest

from ortpa.serve.tool_calls import ToolCallStream, parse_tool_calls, template_messages

WEATHER = {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}
TIME = {"name": "get_time", "arguments": {}}


def _tag(call: dict) -> str:
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


# (text, expected content, expected [(name, arguments)])
CASES = {
    "one tagged call": (_tag(WEATHER), None, [WEATHER]),
    "two tagged calls": (_tag(WEATHER) + "\n" + _tag(TIME), None, [WEATHER, TIME]),
    "text then a tagged call": ("Let me look. " + _tag(WEATHER), "Let me look. ", [WEATHER]),
    "unclosed last tag, whole JSON": ("<tool_call>" + json.dumps(WEATHER), None, [WEATHER]),
    "llama 3 json": (json.dumps({"name": "get_weather", "parameters": WEATHER["arguments"]}), None, [WEATHER]),
    "llama 3 python tag, two calls": (
        "<|python_tag|>" + json.dumps({"name": "get_time", "parameters": {}}) + "; " + json.dumps(WEATHER),
        None,
        [TIME, WEATHER],
    ),
    "arguments as JSON text": (
        _tag({"name": "f", "arguments": '{"x": 1}'}),
        None,
        [{"name": "f", "arguments": {"x": 1}}],
    ),
    "plain text": ("The weather is fine.", "The weather is fine.", []),
    "a brace that is not a call": ('{"answer": 42}', '{"answer": 42}', []),
    "broken JSON in tags stays content": ("<tool_call>{nope}</tool_call>", "<tool_call>{nope}</tool_call>", []),
    "cut short (length)": ('<tool_call>{"name": "get_weather", "argu', '<tool_call>{"name": "get_weather", "argu', []),
    "a tag-like word in text": ("use <tool> here", "use <tool> here", []),
}


def _calls(calls) -> list[dict]:
    return [{"name": c.name, "arguments": json.loads(c.arguments)} for c in calls]


@pytest.mark.parametrize("case", list(CASES))
def test_parse(case):
    text, content, calls = CASES[case]
    got_content, got_calls = parse_tool_calls(text)
    assert got_content == content
    assert _calls(got_calls) == calls
    assert len({c.id for c in got_calls}) == len(got_calls) and all(c.id.startswith("call_") for c in got_calls)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("size", [1, 3, 7])
def test_streamed_in_pieces_equals_whole(case, size):
    text, content, calls = CASES[case]
    stream, got_content, got_calls = ToolCallStream(), "", []
    for i in range(0, len(text), size):
        piece, found = stream.push(text[i : i + size])
        got_content += piece
        got_calls += found
    piece, found = stream.finish()
    got_content += piece
    got_calls += found
    assert got_content == (content or "")
    assert _calls(got_calls) == calls


def test_content_is_passed_on_before_the_end():
    stream = ToolCallStream()
    assert stream.push("The answer") == ("The answer", [])
    content, _ = stream.push(" is <tool")  # a possible tag start is held back, the rest is not
    assert content == " is "
    content, calls = stream.push("_call>" + json.dumps(TIME) + "</tool_call>")
    assert content == "" and _calls(calls) == [TIME]


def test_template_messages_turn_argument_text_into_objects():
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    out = template_messages(messages)
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'  # the request is not mutated
    assert out[0] == messages[0]
