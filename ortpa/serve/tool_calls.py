"""Tool calls read out of the generated text, whole or streamed as OpenAI's ``tool_calls`` deltas (the request
side, templates and forced calls, is :mod:`ortpa.serve.tool_requests`).

Two text forms are read, whichever the template asked for: JSON inside ``<tool_call>...</tool_call>`` tags
(Hermes, Qwen 2.5/3: ``{"name": ..., "arguments": {...}}``) and Llama-3's bare JSON
(``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``, several separated by ``;``).
Text that does not parse as a call stays content: a model that writes a brace is not calling a tool.

Streaming, as vLLM and OpenAI stream calls: text that can only be content is passed on at once. A call is
announced as soon as its text reads ``{"name": "NAME", "arguments": {`` (NAME one of the request's tools): a first
delta with the call's index, id and name and empty arguments; then the arguments object's text as it is generated,
verbatim, until its closing brace. The fragments concatenated are the call's ``arguments``, in the stream and in the
whole response alike (the output is read by the same code whichever way it arrives). Anything else that may be a
call (keys in another order, a list of calls, arguments given as a JSON string) is held and sent as one delta when
its closing tag, or the end of the output, shows it complete. A call announced and then cut short (``max_tokens``)
keeps the arguments generated so far, as OpenAI's does.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStream",
    "join_call_deltas",
    "parse_tool_calls",
]

_OPEN, _CLOSE, _PYTHON_TAG = "<tool_call>", "</tool_call>", "<|python_tag|>"
_WS = " \t\r\n"
_ARGUMENT_KEYS = ('"arguments"', '"parameters"')  # either, in either form (models mix them up)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of the call ``index`` of a choice: its first carries ``id`` and ``name``, every one an arguments
    fragment (maybe empty)."""

    index: int
    id: str | None
    name: str | None
    arguments: str

    def as_openai(self) -> dict[str, Any]:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function"} | {
            "function": {"name": self.name, "arguments": self.arguments}
        }


def join_call_deltas(a: tuple[ToolCallDelta, ...], b: tuple[ToolCallDelta, ...]) -> tuple[ToolCallDelta, ...]:
    """``a`` then ``b``, a call's consecutive pieces joined into one (one entry per call in a chunk)."""
    out = list(a)
    for d in b:
        if out and out[-1].index == d.index:
            prev = out[-1]
            d = ToolCallDelta(d.index, prev.id or d.id, prev.name or d.name, prev.arguments + d.arguments)
            out[-1] = d
        else:
            out.append(d)
    return tuple(out)


def _new_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


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
    return ToolCall(_new_id(), obj["name"], json.dumps(args, ensure_ascii=False))


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


def _string_end(text: str, i: int) -> int:
    """The index past the JSON string starting at ``text[i]`` (a quote), or -1 if it is not complete yet."""
    escaped = False
    for j in range(i + 1, len(text)):
        c = text[j]
        if escaped:
            escaped = False
        elif c == "\\":
            escaped = True
        elif c == '"':
            return j + 1
    return -1


def _header(text: str, names: Collection[str] | None) -> tuple[str, str | None, int]:
    """Read ``{"name": "NAME", "arguments": `` up to the arguments' first character: ``("match", NAME, index of
    that character)`` once it shows an object or a string; ``("partial", None, 0)`` while the text is a prefix of
    such a header; ``("no", None, 0)`` when it cannot become one (or NAME is not among ``names``)."""
    i, name = 0, None
    for step in ("{", '"name"', ":", "NAME", ",", "KEY", ":", "VALUE"):
        while i < len(text) and text[i] in _WS:
            i += 1
        if i == len(text):
            return "partial", None, 0
        if step == "NAME":
            if text[i] != '"':
                return "no", None, 0
            end = _string_end(text, i)
            if end < 0:
                return "partial", None, 0
            try:
                name = json.loads(text[i:end])
            except ValueError:
                return "no", None, 0
            if names is not None and name not in names:
                return "no", None, 0
            i = end
        elif step == "VALUE":
            return ("match", name, i) if text[i] in '{"' else ("no", None, 0)
        else:
            literals = _ARGUMENT_KEYS if step == "KEY" else (step,)
            rest = text[i:]
            hit = next((lit for lit in literals if rest.startswith(lit)), None)
            if hit is None:
                return ("partial", None, 0) if any(lit.startswith(rest) for lit in literals) else ("no", None, 0)
            i += len(hit)
    raise AssertionError("unreachable")


class _ValueScan:
    """Where a JSON object or string ends, fed piece by piece (strings and escapes skipped, brackets counted)."""

    def __init__(self, depth: int = 0) -> None:
        self.depth, self.in_string, self.escaped = depth, False, False

    def feed(self, text: str) -> int:
        """The index in ``text`` past the value's end, or -1 if the value goes on."""
        for j, c in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
            if self.depth == 0 and not self.in_string:
                return j + 1
        return -1


def parse_tool_calls(text: str, names: Collection[str] | None = None) -> tuple[str | None, list[ToolCall]]:
    """``(content, calls)`` of a whole output; content None when the output is only calls."""
    stream = ToolCallStream(names)
    content, _ = stream.push(text)
    more, _ = stream.finish()
    content += more
    calls = stream.calls
    return (content if content.strip() or not calls else None), calls


class ToolCallStream:
    """Splits an output, as it arrives, into content and tool-call deltas; ``calls`` holds the calls so far.

    ``names``: the request's tools (a call to another name is not streamed piece by piece); ``max_calls``: calls
    past it are dropped (``parallel_tool_calls: false`` keeps the first)."""

    def __init__(self, names: Collection[str] | None = None, max_calls: int | None = None) -> None:
        self._names = names
        self._max = max_calls
        self._held = ""  # text not yet passed on
        # start -> text | tagged | json; tagged/json -> args -> after (the call's rest) -> between -> text | tagged;
        # tagged -> whole (not a streamable call: read at its closing tag); json -> whole (read at the end)
        self._state = "start"
        self._form = ""  # the call being read: "tagged" or "json"
        self._scan = _ValueScan()
        self._string_args = False
        self._calls: list[list[str]] = []  # [id, name, arguments so far]

    @property
    def calls(self) -> list[ToolCall]:
        kept = self._calls if self._max is None else self._calls[: self._max]
        return [ToolCall(i, n, a) for i, n, a in kept]

    def push(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._held += text
        out: list[str] = []
        deltas: list[ToolCallDelta] = []
        while self._step(out, deltas):
            pass
        return "".join(out), self._kept(deltas)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """What is held at the end: calls if it parses as calls, else content."""
        held, state = self._held, self._state
        self._held, self._state = "", "text"
        deltas: list[ToolCallDelta] = []
        if state in ("json", "whole") and self._form == "json":
            calls = _json_calls(held)
            if not calls:
                return held, []
            for call in calls:
                self._whole(call, deltas)
            return "", self._kept(deltas)
        if state in ("tagged", "whole") and held.startswith(_OPEN):  # unclosed last tag: a call if its JSON is whole
            call = _tagged_call(held[len(_OPEN) :])
            if call is None:
                return held, []
            self._whole(call, deltas)
            return "", self._kept(deltas)
        if state in ("args", "after"):  # a call cut short: it keeps the arguments streamed so far
            return "", []
        return held, []

    def _kept(self, deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
        return deltas if self._max is None else [d for d in deltas if d.index < self._max]

    def _whole(self, call: ToolCall, deltas: list[ToolCallDelta]) -> None:
        deltas.append(ToolCallDelta(len(self._calls), call.id, call.name, call.arguments))
        self._calls.append([call.id, call.name, call.arguments])

    def _step(self, out: list[str], deltas: list[ToolCallDelta]) -> bool:
        """Consume what the held text allows in the current state; False when it must wait for more text."""
        state = self._state
        if state == "between":  # blanks between and after calls are layout, not content (so are Llama's ';')
            self._held = self._held.lstrip(_WS + ";" if self._form == "json" else _WS)
            if not self._held:
                return False
            self._state = "json" if self._form == "json" and self._held.startswith("{") else "text"
            return True
        if state == "start":
            head = self._held.lstrip()
            if not head or any(m.startswith(head) for m in (_OPEN, _PYTHON_TAG)):
                return False  # not yet known
            if head.startswith(_OPEN):
                self._state, self._held = "tagged", head
            elif head.startswith(("{", "[", _PYTHON_TAG)):
                self._state, self._form = "json", "json"  # held whole: if no call, it is content as written
            else:
                self._state = "text"
            return True
        if state == "text":
            at = self._held.find(_OPEN)
            if at < 0:  # keep a tail that may be the start of a tag
                keep = next((k for k in range(len(_OPEN) - 1, 0, -1) if self._held.endswith(_OPEN[:k])), 0)
                cut = len(self._held) - keep
                out.append(self._held[:cut])
                self._held = self._held[cut:]
                return False
            out.append(self._held[:at])
            self._held, self._state = self._held[at:], "tagged"
            return True
        if state in ("tagged", "json"):
            self._form = state
            if state == "tagged":
                body = self._held[len(_OPEN) :]
            else:
                body = self._held.lstrip()
                body = body[len(_PYTHON_TAG) :] if body.startswith(_PYTHON_TAG) else body
            found, name, at = _header(body, self._names)
            if found == "match":
                call_id = _new_id()
                self._calls.append([call_id, str(name), ""])
                deltas.append(ToolCallDelta(len(self._calls) - 1, call_id, name, ""))
                self._held, self._state, self._scan = body[at:], "args", _ValueScan()
                self._string_args = body[at] == '"'
                return True
            if found == "no" or (state == "tagged" and _CLOSE in self._held):
                self._state = "whole"
                return True
            return False
        if state == "args":
            if self._string_args:  # arguments as a JSON string: sent decoded, once complete
                end = _string_end(self._held, 0)
                if end < 0:
                    return False
                literal, self._held = self._held[:end], self._held[end:]
                try:
                    piece = json.loads(literal)
                except ValueError:
                    piece = literal[1:-1]
                self._state, self._scan = "after", _ValueScan(depth=1)
            else:
                end = self._scan.feed(self._held)
                cut = len(self._held) if end < 0 else end
                piece, self._held = self._held[:cut], self._held[cut:]
                if end >= 0:
                    self._state = "after"
                    self._scan = _ValueScan(depth=1)  # inside the call object, past its arguments
            if piece:
                self._calls[-1][2] += piece
                deltas.append(ToolCallDelta(len(self._calls) - 1, None, None, piece))
            return end >= 0
        if state == "after":  # the rest of the call: up to its closing tag, or (bare JSON) its object's end
            if self._form == "tagged":
                at = self._held.find(_CLOSE)
                if at < 0:
                    return False
                self._held, self._state = self._held[at + len(_CLOSE) :], "between"
                return True
            end = self._scan.feed(self._held)
            self._held = "" if end < 0 else self._held[end:]
            if end >= 0:
                self._state = "between"
            return end >= 0
        # whole: a call that is not streamed piece by piece; tagged: read at its closing tag, json: at the end
        if self._form == "json":
            return False
        end = self._held.find(_CLOSE)
        if end < 0:
            return False
        call = _tagged_call(self._held[len(_OPEN) : end])
        if call is None:  # not a call after all: it is content, tags and all
            out.append(self._held[: end + len(_CLOSE)])
            self._state = "text"
        else:
            self._whole(call, deltas)
            self._state = "between"
        self._held = self._held[end + len(_CLOSE) :]
        return True
