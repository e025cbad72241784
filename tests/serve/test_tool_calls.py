"""Tool calls read out of generated text: the Hermes/Qwen tagged form, Llama 3's bare JSON, and the stream that
passes content on at once and a call's arguments as they are generated, the same whatever the chunking of the
text."""

from __future__ import annotations

import json

import pytest

from ortpa.serve.tool_calls import ToolCallStream, parse_tool_calls
from ortpa.serve.tool_requests import template_messages

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
    "an indented brace that is not a call": (' \n {"answer": 42}', ' \n {"answer": 42}', []),
    "llama 3 json after blanks": (" " + json.dumps({"name": "get_time", "parameters": {}}), None, [TIME]),
    "broken JSON in tags stays content": ("<tool_call>{nope}</tool_call>", "<tool_call>{nope}</tool_call>", []),
    "cut short (length)": ('<tool_call>{"name": "get_weather", "argu', '<tool_call>{"name": "get_weather", "argu', []),
    "a tag-like word in text": ("use <tool> here", "use <tool> here", []),
}


def _calls(calls) -> list[dict]:
    return [{"name": c.name, "arguments": json.loads(c.arguments)} for c in calls]


def _streamed(text: str, size: int, **kw) -> tuple[str, dict[int, dict]]:
    """Content and calls of ``text`` pushed ``size`` characters at a time, deltas accumulated as agents do."""
    stream, content, calls = ToolCallStream(**kw), "", {}
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    for piece, last in zip(pieces, [False] * (len(pieces) - 1) + [True], strict=True):
        out = [stream.push(piece)] + ([stream.finish()] if last else [])
        for got, deltas in out:
            content += got
            for d in deltas:
                if d.id is not None:  # a call's first delta: id and name, nothing before it
                    assert d.index not in calls and d.index == len(calls), d
                    calls[d.index] = {"id": d.id, "name": d.name, "arguments": ""}
                calls[d.index]["arguments"] += d.arguments
    return content, calls


@pytest.mark.parametrize("case", list(CASES))
def test_parse(case):
    text, content, calls = CASES[case]
    got_content, got_calls = parse_tool_calls(text)
    assert got_content == content
    assert _calls(got_calls) == calls
    assert len({c.id for c in got_calls}) == len(got_calls) and all(c.id.startswith("call_") for c in got_calls)


@pytest.mark.parametrize("names", [None, frozenset({"get_time"})], ids=["any-name", "one-tool"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("size", [1, 3, 7])
def test_streamed_in_pieces_equals_whole(case, size, names):
    text, content, _ = CASES[case]
    got_content, got_calls = _streamed(text, size, names=names)
    whole_content, whole_calls = parse_tool_calls(text, names)
    assert got_content == (whole_content or "") == (content or "")
    # the fragments concatenated are the whole response's arguments, character for character
    assert [(c["name"], c["arguments"]) for c in got_calls.values()] == [(c.name, c.arguments) for c in whole_calls]


def test_arguments_stream_as_they_are_generated():
    stream = ToolCallStream(frozenset({"get_weather"}))
    assert stream.push('<tool_call>\n{"name": "get_wea') == ("", [])  # the name is not whole yet
    content, (head, first) = stream.push('ther", "arguments": {"ci')
    assert content == "" and (head.index, head.name, head.arguments) == (0, "get_weather", "")
    assert head.id.startswith("call_") and (first.id, first.name, first.arguments) == (None, None, '{"ci')
    _, (more,) = stream.push('ty": "Paris", "days": 2}}\n</tool')
    assert more.arguments == 'ty": "Paris", "days": 2}'  # up to the arguments' closing brace, not the call's
    assert stream.push("_call>") == ("", []) and stream.finish() == ("", [])
    (call,) = stream.calls
    assert call.id == head.id and json.loads(call.arguments) == WEATHER["arguments"]


def test_a_call_cut_short_keeps_its_arguments_so_far():
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Pa'
    content, (call,) = parse_tool_calls(text)
    assert content is None and (call.name, call.arguments) == ("get_weather", '{"city": "Pa')


def test_llama3_calls_stream_one_after_the_other():
    text = '<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"d": [1]}}'
    content, calls = _streamed(text, 2, names=frozenset({"get_time", "get_weather"}))
    assert content == "" and [(c["name"], c["arguments"]) for c in calls.values()] == [
        ("get_time", "{}"),
        ("get_weather", '{"d": [1]}'),
    ]


def test_a_name_not_among_the_tools_is_read_whole():
    text = _tag({"name": "other", "arguments": {"x": "}"}})
    stream = ToolCallStream(frozenset({"get_time"}))
    assert stream.push(text[:-3]) == ("", [])  # held until its closing tag
    _, (delta,) = stream.push(text[-3:])
    assert (delta.name, json.loads(delta.arguments)) == ("other", {"x": "}"})


def test_parallel_tool_calls_false_keeps_the_first():
    content, calls = _streamed(_tag(WEATHER) + _tag(TIME), 5, max_calls=1)
    assert content == "" and [c["name"] for c in calls.values()] == ["get_weather"]


def test_content_is_passed_on_before_the_end():
    stream = ToolCallStream()
    assert stream.push("The answer") == ("The answer", [])
    content, _ = stream.push(" is <tool")  # a possible tag start is held back, the rest is not
    assert content == " is "
    content, deltas = stream.push("_call>" + json.dumps(TIME) + "</tool_call>")
    assert content == "" and [d.name for d in deltas if d.id] == ["get_time"] and _calls(stream.calls) == [TIME]


def test_template_messages_turn_argument_text_into_objects():
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    out = template_messages(messages)
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'  # the request is not mutated
    assert out[0] == messages[0]
