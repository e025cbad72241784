"""Tool calls: read out of the generated text, streamed as OpenAI's ``tool_calls`` deltas, and forced by grammar.

Two text forms are read, whichever the template asked for: JSON inside ``<tool_call>...</tool_call>`` tags
(Hermes, Qwen 2.5/3: ``{"name": ..., "arguments": {...}}``) and Llama-3's bare JSON
(``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``, several separated by ``;``).
Text that does not parse as a call stays content: a model that writes a brace is not calling a tool.

Streaming: text that can only be content is passed on at once; from the first sign of a call (an output opening
with ``{``, ``[`` or ``<|python_tag|>``, or a ``<tool_call>`` tag anywhere) the text is held, and each call is
sent as one delta (id, name and the whole arguments string) when its closing tag, or the end of the output,
shows it complete.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

__all__ = ["ToolCall", "ToolCallStream", "forced_call_grammar", "parse_tool_calls", "template_messages"]

_OPEN, _CLOSE, _PYTHON_TAG = "<tool_call>", "</tool_call>", "<|python_tag|>"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _call(obj: Any, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments already as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall("call_" + uuid.uuid4().hex[:24], obj["name"], json.dumps(args, ensure_ascii=False))


def _json_calls(text: str) -> list[ToolCall] | None:
    """Llama-3's form: one or more JSON objects (or one list of them), ``;`` or blanks between; else None."""
    text = text.strip()
    text = text.removeprefix(_PYTHON_TAG).strip()
    decoder, pos, objs = json.JSONDecoder(), 0, []
    while pos < len(text):
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        objs.extend(obj if isinstance(obj, list) else [obj])
        while pos < len(text) and text[pos] in " \t\r\n;":
            pos += 1
    calls = [_call(o, "parameters") for o in objs]
    return None if not calls or any(c is None for c in calls) else calls  # type: ignore[return-value]


def _tagged_call(inner: str) -> ToolCall | None:
    try:
        return _call(json.loads(inner), "arguments")
    except ValueError:
        return None


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """``(content, calls)`` of a whole output; content None when the output is only calls."""
    stream = ToolCallStream()
    content, calls = stream.push(text)
    more_content, more_calls = stream.finish()
    content += more_content
    calls += more_calls
    return (content if content.strip() or not calls else None), calls


class ToolCallStream:
    """Splits an output, as it arrives, into content deltas and complete tool calls."""

    def __init__(self) -> None:
        self._held = ""  # text not yet passed on
        self._state = "start"  # start -> text | tagged | json; tagged -> between (after a call) -> text | tagged

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        self._held += text
        out, calls = "", []
        while True:
            if self._state == "between":  # blanks between and after calls are layout, not content
                self._held = self._held.lstrip()
                if not self._held:
                    return out, calls
                self._state = "text"
            if self._state == "start":
                head = self._held.lstrip()
                if not head or any(m.startswith(head) for m in (_OPEN, _PYTHON_TAG)):
                    return out, calls  # not yet known
                if head.startswith(_OPEN):
                    self._state, self._held = "tagged", head
                elif head.startswith(("{", "[", _PYTHON_TAG)):
                    self._state = "json"
                else:
                    self._state = "text"
            if self._state == "json":
                return out, calls  # read whole at the end: a JSON value is complete only when it parses
            if self._state == "text":
                at = self._held.find(_OPEN)
                if at < 0:  # keep a tail that may be the start of a tag
                    keep = next((k for k in range(len(_OPEN) - 1, 0, -1) if self._held.endswith(_OPEN[:k])), 0)
                    cut = len(self._held) - keep
                    out, self._held = out + self._held[:cut], self._held[cut:]
                    return out, calls
                out, self._held, self._state = out + self._held[:at], self._held[at:], "tagged"
            # tagged: pass on each call as its closing tag arrives
            end = self._held.find(_CLOSE)
            if end < 0:
                return out, calls
            inner = self._held[len(_OPEN) : end] if self._held.startswith(_OPEN) else None
            call = _tagged_call(inner) if inner is not None else None
            if call is None:  # not a call after all: it is content, tags and all
                out += self._held[: end + len(_CLOSE)]
            else:
                calls.append(call)
            self._held, self._state = self._held[end + len(_CLOSE) :], "text" if call is None else "between"

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is held at the end: calls if it parses as calls, else content."""
        held, state = self._held, self._state
        self._held, self._state = "", "text"
        if state == "json":
            calls = _json_calls(held)
            return ("", calls) if calls else (held, [])
        if state == "tagged" and held.startswith(_OPEN):  # unclosed last tag: a call if its JSON is whole
            call = _tagged_call(held[len(_OPEN) :])
            if call is not None:
                return "", [call]
        return held, []


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
