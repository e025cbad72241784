"""Bad structured-output and tool fields: each a 400 in OpenAI's body naming the field, never a silent 200."""

from __future__ import annotations

import json

import pytest

from serve.helpers import MODEL_NAME, get, request

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
POINT = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": POINT}}


def _schema(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}


# name: (extra body fields, param the error names, words the message must hold)
CASES = {
    "response_format type unknown": ({"response_format": {"type": "yaml"}}, "response_format.type", ["yaml"]),
    "json_schema missing": ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", []),
    "json_schema name missing": (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": POINT}}},
        "response_format.json_schema.name",
        [],
    ),
    "schema type unknown": (
        {"response_format": _schema({"type": "thing"})},
        "response_format.json_schema.schema",
        ["thing"],
    ),
    "schema keyword not implemented": (
        {"response_format": _schema({"not": {"type": "string"}})},
        "response_format.json_schema.schema",
        ["not"],
    ),
    "schema $ref dangling": (
        {"response_format": _schema({"$ref": "#/$defs/missing"})},
        "response_format.json_schema.schema",
        ["missing"],
    ),
    "schema not an object": ({"response_format": _schema([1])}, "response_format.json_schema.schema", []),
    "guided_json text not JSON": ({"guided_json": "{nope"}, "guided_json", ["not JSON"]),
    "guided_regex does not parse": ({"guided_regex": "a(["}, "guided_regex", ["regex"]),
    "guided_choice empty": ({"guided_choice": []}, "guided_choice", ["at least one"]),
    "guided_choice not strings": ({"guided_choice": [1, 2]}, "guided_choice.0", []),
    "two constraints at once": (
        {"guided_regex": "a+", "response_format": {"type": "json_object"}},
        "guided_regex",
        ["response_format", "guided_regex"],
    ),
    "guided_regex not a string": ({"guided_regex": 5}, "guided_regex", []),
    "ignore_eos not a bool": ({"ignore_eos": "yes"}, "ignore_eos", []),
    "parallel_tool_calls not a bool": ({"tools": [WEATHER], "parallel_tool_calls": 1}, "parallel_tool_calls", []),
    "guided_grammar": ({"guided_grammar": "root ::= 'a'"}, "guided_grammar", ["not supported"]),
    "structural_tag": ({"structural_tag": "{}"}, "structural_tag", ["not supported"]),
    "structured_outputs unknown key": ({"structured_outputs": {"grammar": "x"}}, "structured_outputs.grammar", []),
    "tools not a list": ({"tools": {"type": "function"}}, "tools", []),
    "tool type not function": ({"tools": [{"type": "code", "function": {"name": "f"}}]}, "tools.0.type", []),
    "tool name with a space": (
        {"tools": [{"type": "function", "function": {"name": "get weather"}}]},
        "tools.0.function.name",
        [],
    ),
    "tool names repeated": ({"tools": [WEATHER, WEATHER]}, "tools", ["unique"]),
    "tool_choice unknown": ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice", ["required"]),
    "tool_choice without tools": ({"tool_choice": "required"}, "tool_choice", ["no 'tools'"]),
    "tool_choice names no tool": (
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
        "tool_choice",
        ["get_time", "get_weather"],
    ),
    "forced call and a format": (
        {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
        "response_format",
        ["tool_choice"],
    ),
    "forced call with a bad parameters schema": (
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "thing"}}}],
            "tool_choice": "required",
        },
        "tools",
        ["thing"],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_structured_input(structured_server, case):
    extra, param, words = CASES[case]
    status, _, raw = request(
        "POST", structured_server.api + "/chat/completions", json.dumps({**CHAT, **extra}).encode()
    )
    assert status == 400, raw
    error = json.loads(raw)["error"]
    assert error["param"] == param, error
    assert all(w in error["message"] for w in words), error
    assert get(structured_server.base + "/health")[0] == 200


def test_tools_on_a_template_that_cannot_show_them(server):
    """The main fixture's template has no ``tools`` variable: tools would be dropped unseen, so it is a 400."""
    body = {**CHAT, "tools": [WEATHER]}
    status, _, raw = request("POST", server.api + "/chat/completions", json.dumps(body).encode())
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == "tools" and error["code"] == "tools_not_supported", error
    # tool_choice "none" asks for no tools: the same request then runs, tools unrendered
    status, _, raw = request(
        "POST", server.api + "/chat/completions", json.dumps({**body, "tool_choice": "none"}).encode()
    )
    assert status == 200, raw
