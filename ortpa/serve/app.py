"""The ASGI app of ``ortpa serve``: OpenAI's completions and chat routes, health, models and metrics.

:func:`build_app` wraps one :class:`~ortpa.serve.model.ServingModel`; its lifespan starts and stops the
engine's driving thread (:class:`~ortpa.serve.bridge.EngineBridge`). Every error is answered in OpenAI's body
shape (:mod:`ortpa.serve.protocol`); none leaves the server unhealthy.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ortpa.serve.access_log import AccessLog, access_logger
from ortpa.serve.bridge import EngineBridge
from ortpa.serve.chat import ChatTemplate
from ortpa.serve.generation import Admission, Choice, Delta, Generation
from ortpa.serve.guards import KeyConcurrency, bearer_token, matching_key, read_body
from ortpa.serve.limits import ServeLimits
from ortpa.serve.logprobs import TokenText, chat_logprobs, completion_logprobs
from ortpa.serve.metrics import CONTENT_TYPE, ServeMetrics
from ortpa.serve.model import ServingModel
from ortpa.serve.params import logprobs_asked
from ortpa.serve.prompts import PromptWorker
from ortpa.serve.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    parse_body,
)
from ortpa.serve.request_checks import check_common, max_tokens_for
from ortpa.serve.structured import Grammars, GuidedGrammar, guided_grammar
from ortpa.serve.tokenize import add_tokenizer_routes
from ortpa.serve.tool_requests import forced_call_grammar, template_messages

__all__ = ["ServerState", "build_app"]


_KEYED_ROUTES = ("/tokenize", "/detokenize", "/tokenizer_info")


def _keyed(path: str) -> bool:
    """The routes ``--api-key`` guards (and whose requests count against a key's concurrency)."""
    return path.startswith("/v1/") or path in _KEYED_ROUTES


class ServerState:
    """What the routes share: the model, the engine's thread, admission, limits, the prompt worker and metrics."""

    def __init__(self, served: ServingModel, *, api_keys: Sequence[str], max_queue: int, limits: ServeLimits) -> None:
        self.served = served
        self.api_keys = list(api_keys)
        self.limits = limits
        self.body_bytes = limits.body_bytes(served.max_model_len)
        self.prompts = PromptWorker(served, limits)
        self.metrics = ServeMetrics(served.engine.num_blocks)
        self.bridge = EngineBridge(served.engine, self.metrics)
        self.admission = Admission(served.engine.scheduler.max_num_seqs + max_queue)
        self.grammars = Grammars(served.tokenizer, served.eos_token_ids)
        self.created = int(time.time())
        self.token_text = TokenText(served.tokenizer)


def build_app(
    served: ServingModel,
    *,
    api_key: str | Sequence[str] | None = None,
    max_queue: int = 256,
    access_log: bool = True,
    limits: ServeLimits | None = None,
) -> FastAPI:
    """The app serving ``served``. ``api_key``: one key or several, each accepted on the /v1 and tokenizer routes
    (None: no key asked). ``max_queue``: requests waiting beyond the running batch before a 503. ``access_log``:
    one line per request on stderr (:mod:`ortpa.serve.access_log`). ``limits``: what one request may send
    (:class:`~ortpa.serve.limits.ServeLimits`; default: its defaults)."""
    keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    if any(not k for k in keys):
        raise ValueError("api_key: expected non-empty keys, found an empty one")
    state = ServerState(served, api_keys=keys, max_queue=max_queue, limits=limits or ServeLimits())

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        state.bridge.start()
        try:
            yield
        finally:
            state.bridge.stop()
            state.prompts.close()

    app = FastAPI(title="ortpa", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ortpa = state
    if keys:  # inside the access log, which then logs the 429s too
        app.add_middleware(
            KeyConcurrency,
            keys=keys,
            limit=state.limits.max_concurrent_per_key,
            gated=_keyed,
            on_refused=state.metrics.rejected.labels("429").inc,
        )
    if access_log:
        app.add_middleware(AccessLog, log=access_logger())

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        state.metrics.rejected.labels(str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(_request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error"), 500)

    def check_key(request: Request) -> None:
        """``--api-key``: every /v1 route wants ``Authorization: Bearer KEY`` (a check per route rather than a
        middleware, which would copy every streamed chunk through one more queue)."""
        if not state.api_keys:
            return
        token = bearer_token(request.headers)
        if matching_key(token, state.api_keys) is None:
            what = "no API key given" if not token else "the API key given is not valid"
            raise ApiError(
                401,
                f"{what}: send 'Authorization: Bearer KEY' with the key the server was started with",
                code="invalid_api_key",
            )

    @app.get("/health")
    async def health() -> Response:
        if state.bridge.stopping:
            return JSONResponse(error_body("the server is shutting down", "server_error"), 503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        check_key(request)
        card = {"id": served.name, "object": "model", "created": state.created, "owned_by": "ortpa"}
        if served.max_model_len is not None:
            card["max_model_len"] = served.max_model_len
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        check_key(request)
        body = parse_body(CompletionRequest, await read_body(request, state.body_bytes))
        check_common(body, served, state.limits.max_n)
        prompts, texts = await state.prompts.completion_prompts(body.prompt, _fewest_completion(body.max_tokens))
        guided = guided_grammar(body)
        echo = texts if body.echo else None
        return await _respond(state, request, body, prompts, body.max_tokens, chat=False, guided=guided, echo=echo)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        check_key(request)
        body = parse_body(ChatCompletionRequest, await read_body(request, state.body_bytes))
        check_common(body, served, state.limits.max_n)
        if served.chat_template is None:
            raise ApiError(
                400,
                f"model {served.name!r} has no chat template (no chat_template.jinja, nor a chat_template in "
                "tokenizer_config.json, beside the model): use /v1/completions with a prompt instead",
                param="messages",
                code="no_chat_template",
            )
        tools, guided = _tool_plan(body, served, served.chat_template)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        ids = await state.prompts.render_encode(
            served.chat_template,
            template_messages([m.for_template() for m in body.messages]),
            body.add_generation_prompt,
            tools,
            _fewest_completion(max_tokens),
        )
        if not ids:
            raise ApiError(400, "the messages render to an empty prompt", param="messages")
        return await _respond(state, request, body, [ids], max_tokens, chat=True, guided=guided, tools=tools)

    add_tokenizer_routes(app, served, check_key, state.prompts, state.body_bytes)
    return app


def _fewest_completion(requested: int | None) -> int:
    """The fewest completion tokens a request asks the context for (its ``max_tokens`` is checked later)."""
    return 1 if requested is None else max(requested, 0)


def _tool_plan(
    body: ChatCompletionRequest, served: ServingModel, template: ChatTemplate
) -> tuple[list[dict] | None, GuidedGrammar | None]:
    """The tools to render (None: no tools in play) and the one grammar the request's output must follow."""
    choice = body.tool_choice
    if choice is not None and choice != "none" and not body.tools:
        raise ApiError(400, "'tool_choice' is set but no 'tools' are given", param="tool_choice")
    guided = guided_grammar(body)
    if not body.tools or choice == "none":
        return None, guided
    if not template.supports_tools:
        raise ApiError(
            400,
            f"the chat template of {served.name!r} ({template.where}) does not read a 'tools' variable, so the "
            "model would never see the tools: send the request without 'tools', or serve a tool-calling template",
            param="tools",
            code="tools_not_supported",
        )
    names = [t.function.name for t in body.tools]
    if len(set(names)) != len(names):
        raise ApiError(400, f"'tools': function names must be unique, found {names}", param="tools")
    named = choice.function.name if choice not in (None, "auto", "required") else None  # type: ignore[union-attr]
    if named is not None and named not in names:
        raise ApiError(
            400, f"'tool_choice': the function {named!r} is not among the tools given ({names})", param="tool_choice"
        )
    if choice == "required" or named is not None:
        if guided is not None:
            raise ApiError(
                400,
                f"expected at most one output constraint, found 'tool_choice' and '{guided.param}'",
                param=guided.param,
            )
        guided = GuidedGrammar(forced_call_grammar(body.tools, named, template.tool_call_tags), "tools")
    return [t.model_dump(exclude_none=True) for t in body.tools], guided


async def _until_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body is read, so the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(gen: Generation, request: Request) -> list:
    """Every choice to its end; a client gone meanwhile aborts them (blocks freed) instead of finishing them."""
    work = asyncio.ensure_future(gen.collect())
    gone = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            gen.close()
    if work.cancelled():
        raise ApiError(499, "the client closed the connection", code="client_closed")  # nobody reads it
    return work.result()


async def _respond(
    state: ServerState,
    request: Request,
    body: Any,
    prompts: list[list[int]],
    requested: int | None,
    chat: bool,
    echo: list[str | None] | None = None,
    guided: GuidedGrammar | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> Response:
    served = state.served
    max_tokens = max_tokens_for(requested, prompts, served, chat, echo is not None)
    top = logprobs_asked(body)
    if echo is not None:  # a prompt given as token ids is echoed as their decoded text
        echo = [t if t is not None else served.tokenizer.decode(p) for t, p in zip(echo, prompts, strict=True)]
    constraints = None
    if guided is not None:  # off the event loop: the first one builds the tokenizer's grammar tables
        count = len(prompts) * body.n
        constraints = await asyncio.to_thread(lambda: [state.grammars.constraint(guided) for _ in range(count)])
    gen = Generation(served, state.bridge, state.admission)
    names = None if tools is None else [t["function"]["name"] for t in tools]
    await gen.start(prompts, body.n, body, max_tokens, body.stop_strings(), echo, constraints, tool_names=names)
    ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    usage = lambda: {  # noqa: E731
        "prompt_tokens": sum(len(p) for p in prompts),
        "completion_tokens": gen.completion_tokens,
        "total_tokens": sum(len(p) for p in prompts) + gen.completion_tokens,
    }
    request.state.access = (ident, usage)  # for the access log line
    head = {"id": ident, "created": created, "model": served.name}
    text_of = state.token_text

    def chat_lps(entries) -> dict[str, Any] | None:
        return None if top is None else chat_logprobs(entries, text_of, top)

    def completion_lps(c: Choice | Delta, start: int = 0) -> dict[str, Any] | None:
        if top is None:
            return None
        ids: list[int] = []
        entries: list = []
        prompt = c.prompt_ids if isinstance(c, Delta) or c.echo is not None else None
        if prompt is not None:  # the echoed prompt: its first token has nothing to be scored against
            ids += prompt
            entries += c.prompt_logprobs or [None] * len(prompt)
        ids += [e.token_id for e in c.logprobs]
        entries += c.logprobs
        return completion_logprobs(ids, entries, text_of, start)

    if not body.stream:
        try:
            choices = await _collect(gen, request)
        except ApiError:
            raise
        except Exception as exc:
            raise ApiError(500, f"generation failed: {exc}", type="server_error") from None
        if chat:
            out = [
                {
                    "index": c.index,
                    "message": _message(c),
                    "logprobs": chat_lps(c.logprobs),
                    "finish_reason": c.finish_reason,
                }
                for c in choices
            ]
            return JSONResponse({**head, "object": "chat.completion", "choices": out, "usage": usage()})
        out = [
            {
                "index": c.index,
                "text": "".join(c.pieces),
                "logprobs": completion_lps(c),
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ]
        return JSONResponse({**head, "object": "text_completion", "choices": out, "usage": usage()})

    include_usage = body.stream_options is not None and body.stream_options.include_usage
    every_chunk = include_usage and body.stream_options.continuous_usage_stats
    kind = "chat.completion.chunk" if chat else "text_completion"
    offsets: dict[int, int] = {}  # completions' text_offset continues across a choice's chunks

    def event(choices: list[dict[str, Any]], with_usage: bool = False) -> str:
        chunk = {**head, "object": kind, "choices": choices}
        if include_usage:
            chunk["usage"] = usage() if with_usage or every_chunk else None
        return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"

    def completion_chunk_lps(d: Delta) -> dict[str, Any] | None:
        lps = completion_lps(d, offsets.get(d.index, 0))
        if lps is not None and lps["tokens"]:
            offsets[d.index] = lps["text_offset"][-1] + len(lps["tokens"][-1])
        return lps

    async def sse() -> AsyncIterator[str]:
        try:
            if chat:  # the role first, as OpenAI sends it
                yield event(
                    [
                        {"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
                        | {"finish_reason": None}
                        for c in gen.choices
                    ]
                )
            async for deltas in gen.deltas():
                if chat:
                    parts = [
                        {
                            "index": d.index,
                            "delta": _chat_delta(d),
                            "logprobs": chat_lps(d.logprobs),
                            "finish_reason": d.finish_reason,
                        }
                        for d in deltas
                    ]
                else:
                    parts = [
                        {
                            "index": d.index,
                            "text": d.text,
                            "logprobs": completion_chunk_lps(d),
                            "finish_reason": d.finish_reason,
                        }
                        for d in deltas
                    ]
                yield event(parts)
        except ApiError as exc:
            yield f"data: {json.dumps(exc.body())}\n\n"
        except Exception as exc:  # a failed step: the client learns why, the stream still ends properly
            yield f"data: {json.dumps(error_body(f'generation failed: {exc}', 'server_error'))}\n\n"
        finally:
            gen.close()  # a client gone mid-stream lands here: its requests are aborted, their blocks freed
        if include_usage:  # also after an error: what was produced is counted
            yield event([], with_usage=True)
        yield "data: [DONE]\n\n"

    return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _message(choice: Any) -> dict[str, Any]:
    text = "".join(choice.pieces)
    if not choice.tool_calls:
        return {"role": "assistant", "content": text}
    content = text if text.strip() else None
    return {"role": "assistant", "content": content, "tool_calls": [c.as_openai() for c in choice.tool_calls]}


def _chat_delta(d: Any) -> dict[str, Any]:
    delta: dict[str, Any] = {"content": d.text} if d.text else {}
    if d.tool_calls:  # OpenAI's shape: a call's index, id, type and name first, then its arguments' fragments
        delta["tool_calls"] = [call.as_openai() for call in d.tool_calls]
    return delta
