"""vLLM's tokenizer routes: ``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info`` (which
lm-evaluation-harness reads to use the server's tokenizer instead of downloading one). Rendering, tokenizing and
decoding run in the server's prompt worker (:mod:`ortpa.serve.prompts`), off the event loop."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request

from ortpa.serve.guards import read_body
from ortpa.serve.model import ServingModel
from ortpa.serve.prompts import PromptWorker
from ortpa.serve.protocol import ApiError, DetokenizeRequest, TokenizeRequest, parse_body

__all__ = ["add_tokenizer_routes"]


def add_tokenizer_routes(
    app: FastAPI,
    served: ServingModel,
    check_key: Callable[[Request], None],
    prompts: PromptWorker,
    max_body_bytes: int,
) -> None:
    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        check_key(request)
        body = parse_body(TokenizeRequest, await read_body(request, max_body_bytes))
        _check_model(body.model, served)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "expected exactly one of 'prompt' and 'messages'", param="prompt")
        if body.messages is not None:
            if served.chat_template is None:
                raise ApiError(400, f"model {served.name!r} has no chat template", param="messages")
            messages = [m.for_template() for m in body.messages]
            ids = await prompts.render_encode(served.chat_template, messages, body.add_generation_prompt, None, None)
        else:
            (ids,) = await prompts.encode([body.prompt], body.add_special_tokens, "prompt", None)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": served.max_model_len, "tokens": ids}
        out["token_strs"] = [served.tokenizer.id_to_token(t) for t in ids] if body.return_token_strs else None
        return out

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        check_key(request)
        body = parse_body(DetokenizeRequest, await read_body(request, max_body_bytes))
        _check_model(body.model, served)
        outside = [t for t in body.tokens if not 0 <= t < served.vocab_size]
        if outside:
            raise ApiError(
                400, f"'tokens': expected ids in [0, {served.vocab_size}), found {outside[:5]}", param="tokens"
            )
        return {"prompt": await prompts.decode(body.tokens)}

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
