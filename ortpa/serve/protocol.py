"""The OpenAI request bodies ``ortpa serve`` accepts and its error body.

Bodies are parsed strictly (pydantic strict mode): ``"max_tokens": "5"`` or ``"stream": 1`` is a 400, not a
silent coercion. Fields OpenAI defines that the engine cannot honour (``best_of`` > 1, ``suffix``, vLLM's
``guided_grammar`` and ``structural_tag``) are refused with a 400 naming the field when set to anything but their
neutral value; unknown extra fields are ignored, as OpenAI's own server ignores them. vLLM's extensions ``top_k``,
``min_tokens``, ``repetition_penalty``, ``stop_token_ids``, ``ignore_eos`` and ``add_generation_prompt`` are
understood. How a body becomes ``SamplingParams``: :mod:`ortpa.serve.params`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

__all__ = [
    "ApiError",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "DetokenizeRequest",
    "ResponseFormat",
    "StreamOptions",
    "StructuredOutputs",
    "TokenizeRequest",
    "Tool",
    "error_body",
    "parse_body",
]


class ApiError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's extension: usage in every chunk


class JsonSchemaFormat(_Strict):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the grammar is enforced either way


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs`` extra field (one of these at a time; its other keys are refused, not ignored)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None


class _Sampling(_Strict):
    """Fields completions and chat share."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None  # None: OpenAI's default, 1.0
    top_p: float = 1.0
    top_k: int = 0  # vLLM's extension; 0 or -1 disable it
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    ignore_eos: bool = False  # vLLM's extension (load tools send it for fixed output lengths)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's extension; 1 disables it
    logit_bias: dict[str, float] | None = None
    min_tokens: int = 0  # vLLM's extension
    stop_token_ids: list[int] | None = None  # vLLM's extension
    user: str | None = None
    # structured output: OpenAI's response_format and vLLM's guided fields (at most one per request)
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_grammar: Any = None  # vLLM's; refused (no EBNF front end here)
    structural_tag: Any = None  # vLLM's; refused

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    def unsupported(self) -> list[str]:
        """Names of the fields set to something the engine cannot do."""
        return [name for name in ("guided_grammar", "structural_tag") if getattr(self, name) is not None]


class CompletionRequest(_Sampling):
    # tried in this order, the first that fits: a long list of token ids is checked once, as ids (smart mode would
    # check it against every member: 3.7x slower, on the event loop)
    prompt: str | list[int] | list[str] | list[list[int]] = Field(union_mode="left_to_right")
    logprobs: int | None = None  # the chosen token's log-probability and this many alternatives
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.best_of not in (None, 1):
            bad.append("best_of")
        if self.suffix:
            bad.append("suffix")
        return bad


class _TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")  # name, tool_calls...: passed on to the template

    role: str
    content: str | list[_TextPart] | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as a chat template reads it: text parts joined into one string (what vLLM does)."""
        out = self.model_dump(exclude_none=False)
        if isinstance(self.content, list):
            out["content"] = "".join(p.text for p in self.content)
        return out


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")  # OpenAI's rule for names
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class _FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: _FunctionName


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    add_generation_prompt: bool = True  # vLLM's extension
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


class TokenizeRequest(_Strict):
    """vLLM's ``/tokenize``: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


def _describe(exc: ValidationError) -> tuple[str, str | None]:
    """One line naming the first bad field, what was expected and what was found."""
    err = exc.errors(include_url=False)[0]
    if err["type"] == "json_invalid":
        return f"malformed JSON body: {err['msg']}", None
    found = err.get("input")
    if not err["loc"]:
        return f"expected a JSON object body, found {type(found).__name__}", None
    top = err["loc"][0]
    if top in _UNIONS and err["type"] != "missing":  # a union reports one error per member: say what it takes
        return f"'{top}': expected {_UNIONS[top]}, found {_shown(exc, top)}", str(top)
    path = [p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-"))]
    if path and isinstance(path[-1], str) and (path[-1] in _TYPE_TAGS or path[-1].startswith(("list[", "dict["))):
        # a union member's error (content: str | list of parts): name the field, list what it takes
        loc = ".".join(map(str, path[:-1]))
        n = len(path) - 1
        members = [
            str(e["loc"][n]).replace("_TextPart", "text part")
            for e in exc.errors(include_url=False)
            if len(e["loc"]) > n and list(e["loc"][:n]) == path[:-1]
        ]
        shown = repr(found) if not isinstance(found, (dict, list)) else type(found).__name__
        return f"'{loc}': expected one of {', '.join(dict.fromkeys(members))}, found {shown}", loc
    loc = ".".join(map(str, path))
    if err["type"] == "missing":
        return f"'{loc}' is a required field", loc
    shown = repr(found) if not isinstance(found, (dict, list)) else type(found).__name__
    return f"'{loc}': {err['msg'].lower()} (found {shown})", loc or None


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none"})
_UNIONS = {
    "prompt": "a string, a list of strings, a list of token ids, or a list of lists of token ids",
    "stop": "a string or a list of strings",
    "logit_bias": "an object of token ids ('42') to numbers",
    "tool_choice": '\'none\', \'auto\', \'required\' or {"type": "function", "function": {"name": ...}}',
    "guided_json": "a JSON schema (an object, or its text)",
}


def _shown(exc: ValidationError, field: str) -> str:
    value = exc.errors(include_url=False)[0].get("input")
    for e in exc.errors(include_url=False):
        if e["loc"] == (field,) or (len(e["loc"]) == 2 and e["loc"][0] == field):
            value = e.get("input")
            break
    if isinstance(value, list):
        kinds = sorted({type(v).__name__ for v in value})
        return f"a list of {' and '.join(kinds)}" if value else "an empty list"
    return repr(value) if not isinstance(value, dict) else "an object"


def parse_body(kind: type[_Strict], raw: bytes) -> Any:
    """Parse ``raw`` as ``kind`` or raise :class:`ApiError` (400) naming what is wrong."""
    if not raw.strip():
        raise ApiError(400, "expected a JSON object body, found an empty body")
    try:
        return kind.model_validate_json(raw)
    except ValidationError as exc:
        message, param = _describe(exc)
        raise ApiError(400, message, param=param) from None
