"""The request side of tool calling: messages as chat templates read them, and the grammar that forces a call
(``tool_choice`` ``"required"`` or a named function) in the template's form (:mod:`ortpa.serve.tool_calls` reads
the calls back out of the text)."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["forced_call_grammar", "template_messages"]

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


def forced_call_grammar(tools: list[Any], name: str | None, tagged: bool) -> str:
    """An llguidance grammar for exactly one call of ``name`` (or of any of ``tools``), in the template's form."""
    import llguidance as llg

    args_key = "arguments" if tagged else "parameters"
    options = []
    for tool in tools:
        fn = tool.function
        if name is not None and fn.name != name:
            continue
        params = fn.parameters if fn.parameters else {"type": "object"}
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn.name}, args_key: params},
                "required": ["name", args_key],
                "additionalProperties": False,
            }
        )
    schema = {"anyOf": options} if len(options) > 1 else options[0]
    schema["x-guidance"] = {"whitespace_flexible": False}
    call = "%json " + json.dumps(schema)
    if tagged:
        return llg.LLMatcher.grammar_from_lark(f'start: "{_OPEN}\\n" call "\\n{_CLOSE}"\ncall: {call}')
    return llg.LLMatcher.grammar_from_lark(f"start: call\ncall: {call}")


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates read them: an assistant's call arguments as objects, not JSON text (what
    transformers' templates expect, and what vLLM passes them)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if m.get("role") == "assistant" and isinstance(calls, list):
            m = {**m, "tool_calls": [_arguments_as_object(c) for c in calls]}
        out.append(m)
    return out


def _arguments_as_object(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**fn, "arguments": args}}
