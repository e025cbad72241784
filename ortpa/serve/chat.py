"""The model's chat template, rendered the way ``transformers``' ``apply_chat_template`` renders it.

The template comes from ``chat_template.jinja`` beside the model (what transformers 5 saves) or the
``chat_template`` key of ``tokenizer_config.json`` (a string, or a list of ``{"name", "template"}`` of which
``default`` is used). It is rendered in jinja2's sandbox with transformers' settings (``trim_blocks``,
``lstrip_blocks``, the ``loopcontrols`` extension, ``raise_exception``, ``strftime_now`` and a ``tojson``
that keeps non-ASCII text) and its variables: ``messages``, ``add_generation_prompt`` and the special tokens of
``tokenizer_config.json`` (``bos_token``, ``eos_token``, ...), and ``tools`` when a request sends tools.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from ortpa.errors import InvalidModel

__all__ = ["ChatTemplate", "TemplateRenderError", "load_chat_template"]


class TemplateRenderError(ValueError):
    """The template refused the messages (``raise_exception``) or failed on them."""


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    special_tokens: dict[str, str] = field(default_factory=dict)
    where: str = ""

    def render(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: list[Any] | None = None
    ) -> str:
        import jinja2

        extra = {} if tools is None else {"tools": tools}  # unset, not None: templates test `tools is defined`
        try:
            return _compile(self.source).render(
                messages=messages, add_generation_prompt=add_generation_prompt, **extra, **self.special_tokens
            )
        except TemplateRenderError:
            raise
        except jinja2.TemplateError as exc:
            raise TemplateRenderError(f"the chat template ({self.where}) failed on these messages: {exc}") from None

    @property
    def supports_tools(self) -> bool:
        """The template reads a ``tools`` variable (a template that does not would drop the tools unseen)."""
        return "tools" in _variables(self.source)

    @property
    def tool_call_tags(self) -> bool:
        """The template writes calls as JSON in ``<tool_call>`` tags (Hermes, Qwen), not as bare JSON (Llama 3)."""
        return "<tool_call>" in self.source


@functools.lru_cache(maxsize=8)
def _variables(source: str) -> frozenset[str]:
    from jinja2 import meta

    return frozenset(meta.find_undeclared_variables(_environment().parse(source)))


def _raise(message: str) -> None:
    raise TemplateRenderError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)
def _compile(source: str):
    return _environment().from_string(source)


def _environment():
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):  # AddedToken as saved by transformers
        return value["content"]
    return None


def load_chat_template(folder: Path) -> ChatTemplate | None:
    """The template in ``folder`` (``chat_template.jinja`` first, then ``tokenizer_config.json``); None if none."""
    config_path = folder / "tokenizer_config.json"
    config: dict[str, Any] = {}
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise InvalidModel(str(config_path), f"expected a JSON object, could not read it: {exc}") from None
        if not isinstance(config, dict):
            raise InvalidModel(str(config_path), f"expected a JSON object, found {type(config).__name__}")
    special = {k: t for k, v in config.items() if k.endswith("_token") and (t := _token_text(v)) is not None}
    jinja_path = folder / "chat_template.jinja"
    if jinja_path.is_file():
        source, where = jinja_path.read_text(encoding="utf-8"), str(jinja_path)
    else:
        source, where = config.get("chat_template"), f"{config_path} chat_template"
        if isinstance(source, list):  # named templates: transformers uses "default"
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if source is None:
            return None
        if not isinstance(source, str):
            raise InvalidModel(where, f"expected a Jinja template string, found {type(source).__name__}")
    import jinja2

    try:
        _compile(source)
    except jinja2.TemplateSyntaxError as exc:
        raise InvalidModel(where, f"the chat template does not parse: {exc} (line {exc.lineno})") from None
    return ChatTemplate(source, special, where)
