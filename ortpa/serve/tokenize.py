"""vLLM's tokenizer routes: ``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info`` (which
lm-evaluation-harness reads to use the server's tokenizer instead of downloading one)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request

from ortpa.serve.chat import TemplateRenderError
from ortpa.serve.model import ServingModel
from ortpa.serve.protocol import ApiError, DetokenizeRequest, TokenizeRequest, parse_body

__all__ = ["add_tokenizer_routes"]


def add_tokenizer_routes(app: FastAPI, served: ServingModel, check_key: Callable[[Request], None]) -> None:
    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        check_key(request)
        body = parse_body(TokenizeRequest, await request.body())
        _check_model(body.model, served)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "expected exactly one of 'prompt' and 'messages'", param="prompt")
        if body.messages is not None:
            if served.chat_template is None:
                raise ApiError(400, f"model {served.name!r} has no chat template", param="messages")
            try:
                text = served.chat_template.render(
                    [m.for_template() for m in body.messages], add_generation_prompt=body.add_generation_prompt
                )
            except TemplateRenderError as exc:
                raise ApiError(400, str(exc), param="messages") from None
            add_special = False  # the template writes the special tokens itself, as /v1/chat/completions reads it
        else:
            text, add_special = body.prompt, body.add_special_tokens
        ids = served.tokenizer.encode(text, add_special_tokens=add_special).ids
        out: dict[str, Any] = {"count": len(ids), "max_model_len": served.max_model_len, "tokens": ids}
        out["token_strs"] = [served.tokenizer.id_to_token(t) for t in ids] if body.return_token_strs else None
        return out

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        check_key(request)
        body = parse_body(DetokenizeRequest, await request.body())
        _check_model(body.model, served)
        outside = [t for t in body.tokens if not 0 <= t < served.vocab_size]
        if outside:
            raise ApiError(
                400, f"'tokens': expected ids in [0, {served.vocab_size}), found {outside[:5]}", param="tokens"
            )
        return {"prompt": served.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> dict[str, Any]:
        check_key(request)
        special = dict(served.chat_template.special_tokens) if served.chat_template is not None else {}
        if "eos_token" not in special and served.eos_token_ids:
            special["eos_token"] = served.tokenizer.id_to_token(served.eos_token_ids[0])
        return {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": special.get("eos_token"),
            "bos_token": special.get("bos_token"),
            "pad_token": special.get("pad_token"),
            "chat_template": None if served.chat_template is None else served.chat_template.source,
            "model_max_length": served.max_model_len,
            "vocab_size": served.vocab_size,
        }


def _check_model(model: str | None, served: ServingModel) -> None:
    if model is not None and model != served.name:
        raise ApiError(
            404,
            f"the model {model!r} does not exist: this server serves {served.name!r}",
            param="model",
            code="model_not_found",
        )
