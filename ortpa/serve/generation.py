"""One HTTP request's engine requests (its choices): admission, sampling parameters, and the merged stream of
text deltas, with stop strings and EOS handled per choice."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ortpa.errors import InvalidRequest
from ortpa.runtime.constraints import TokenConstraint
from ortpa.serve.bridge import EngineBridge, Refused, ShuttingDown, TokenEvent
from ortpa.serve.detokenizer import TextStream
from ortpa.serve.model import ServingModel
from ortpa.serve.params import sampling_params
from ortpa.serve.protocol import ApiError
from ortpa.serve.tool_calls import ToolCall, ToolCallDelta, ToolCallStream, join_call_deltas

__all__ = ["Admission", "Choice", "Delta", "Generation", "sampling_params"]

_ECHO_CONTEXT = 6  # prompt tokens an echoed completion is decoded after (vLLM's incremental window)


@dataclass(frozen=True)
class Delta:
    index: int
    text: str
    finish_reason: str | None
    tool_calls: tuple[ToolCallDelta, ...] = ()  # pieces of the choice's calls (one entry per call)
    logprobs: tuple = ()  # TokenLogprobs of the tokens this delta covers (when asked)
    prompt_ids: tuple[int, ...] | None = None  # with the echoed prompt: its ids and log-probabilities
    prompt_logprobs: tuple | None = None


@dataclass
class Choice:
    index: int
    prompt_ids: list[int]
    text: TextStream
    echo: str | None = None  # the prompt's text, sent before the completion's
    request_id: str | None = None
    tokens: int = 0
    finish_reason: str | None = None
    pieces: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    prompt_logprobs: tuple | None = None
    started: bool = False
    tool_stream: ToolCallStream | None = None  # set when the request has tools: calls are read out of the text

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [] if self.tool_stream is None else self.tool_stream.calls

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


class Admission:
    """Engine requests admitted and unfinished, against ``max_num_seqs + max_queue``: past it, 503."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.in_flight = 0

    def take(self, n: int) -> None:
        if self.in_flight + n > self.capacity:
            raise ApiError(
                503,
                f"the server is at capacity ({self.in_flight} requests running or queued, at most "
                f"{self.capacity}); retry shortly",
                type="server_error",
                code="server_busy",
                headers={"Retry-After": "1"},
            )
        self.in_flight += n

    def give(self, n: int = 1) -> None:
        self.in_flight -= n


class Generation:
    """The choices of one request: submitted together, streamed as one sequence of :class:`Delta` lists."""

    def __init__(self, served: ServingModel, bridge: EngineBridge, admission: Admission) -> None:
        self.served = served
        self.bridge = bridge
        self.admission = admission
        self.choices: list[Choice] = []
        self._sink: asyncio.Queue = asyncio.Queue()
        self._by_id: dict[str, Choice] = {}
        self._admitted = 0

    async def start(
        self,
        prompts: list[list[int]],
        n: int,
        body: Any,
        max_tokens: int,
        stop: list[str],
        echo: list[str] | None = None,
        constraints: Sequence[TokenConstraint] | None = None,
        tool_names: Sequence[str] | None = None,
    ) -> None:
        """Admit and submit ``n`` choices per prompt; on any refusal, nothing stays queued.

        ``echo``: each prompt's text, sent first in its choices' text. ``constraints``: one per choice
        (prompt-major), each used by that choice alone. ``tool_names``: the request's tools, whose calls are read
        out of each choice's text (``Choice.tool_calls``, deltas' ``tool_calls``).
        """
        # one SamplingParams per choice (a choice's constraint is its own state), all checked before admission
        vocab, eos = self.served.vocab_size, self.served.eos_token_ids
        params = [[sampling_params(body, max_tokens, j, eos, vocab) for j in range(n)] for _ in prompts]
        self.admission.take(len(prompts) * n)
        self._admitted = len(prompts) * n
        batch = []
        try:
            for p, prompt in enumerate(prompts):
                for j in range(n):
                    # an echoed completion is decoded after the prompt's last tokens: the space between them shows
                    context = prompt[-_ECHO_CONTEXT:] if echo is not None else ()
                    one = params[p][j]
                    if constraints is not None:
                        one = dataclasses.replace(one, constraint=constraints[len(self.choices)])
                    stream = TextStream(self.served.tokenizer, stop, one.stop_token_ids, context, one.min_tokens)
                    choice = Choice(len(self.choices), list(prompt), stream, None if echo is None else echo[p])
                    if tool_names is not None:
                        one_call = not getattr(body, "parallel_tool_calls", True)
                        choice.tool_stream = ToolCallStream(frozenset(tool_names), 1 if one_call else None)
                    self.choices.append(choice)
                    batch.append((prompt, one))
            ids = await self.bridge.submit_all(batch, self._sink)
        except ShuttingDown as exc:
            self.close()
            raise ApiError(503, str(exc), type="server_error", code="shutting_down") from None
        except Refused as exc:
            self.close()
            if not isinstance(exc.cause, InvalidRequest):
                raise exc.cause from None
            raise ApiError(
                400, f"prompt {exc.index // n}: {exc.cause}", param="prompt", code="invalid_prompt"
            ) from None
        except BaseException:
            self.close()
            raise
        for choice, request_id in zip(self.choices, ids, strict=True):
            choice.request_id = request_id
            self._by_id[request_id] = choice

    async def deltas(self) -> AsyncIterator[list[Delta]]:
        """Text deltas as tokens arrive, several choices' at once; each choice ends with a finish reason."""
        try:
            while not all(c.done for c in self.choices):
                items = [await self._sink.get()]
                while not self._sink.empty():
                    items.append(self._sink.get_nowait())
                merged: dict[int, Delta] = {}  # one entry per choice per chunk: clients read choices by index
                for item in items:
                    d = self._apply(*item)
                    if d is not None:
                        prev = merged.get(d.index)
                        merged[d.index] = d if prev is None else _merge(prev, d)
                if merged:
                    yield list(merged.values())
        finally:
            self.close()

    async def collect(self) -> list[Choice]:
        async for _ in self.deltas():
            pass
        return self.choices

    def close(self) -> None:
        """Abort every unfinished choice (a client gone, an error) and return their admission slots."""
        for c in self.choices:
            if not c.done:
                c.finish_reason = "abort"
                if c.request_id is not None:
                    self.bridge.abort(c.request_id)
        if self._admitted:
            self.admission.give(self._admitted)
            self._admitted = 0

    def _apply(self, request_id: str, item: TokenEvent | BaseException) -> Delta | None:
        choice = self._by_id.get(request_id)
        if choice is None or choice.done:
            return None  # tokens of a choice stopped by a stop string, produced before its abort landed
        if isinstance(item, BaseException):
            raise item
        choice.tokens += len(item.token_ids)
        choice.token_ids.extend(item.token_ids)
        lps = tuple(item.logprobs or ())
        choice.logprobs.extend(lps)
        text = choice.text.push(item.token_ids)
        reason = item.finish_reason
        if choice.text.stopped:
            reason = "stop"
            self.bridge.abort(request_id, "stop")
        elif reason is not None:
            text += choice.text.finish()
        calls: tuple[ToolCallDelta, ...] = ()
        if choice.tool_stream is not None:
            text, found = choice.tool_stream.push(text)
            if reason is not None:
                more, more_found = choice.tool_stream.finish()
                text, found = text + more, found + more_found
            calls = join_call_deltas((), tuple(found))
            if choice.tool_calls and reason == "stop":
                reason = "tool_calls"
        prompt_ids = prompt_lps = None
        if not choice.started:  # the first event: the echoed prompt and its log-probabilities go first
            choice.started = True
            if choice.echo is not None:
                text = choice.echo + text
                prompt_ids = tuple(choice.prompt_ids)
                choice.prompt_logprobs = prompt_lps = item.prompt_logprobs
        if reason is not None:
            choice.finish_reason = reason
        if text:
            choice.pieces.append(text)
        if not text and not calls and reason is None and not lps and prompt_ids is None:
            return None
        return Delta(choice.index, text, reason, calls, lps, prompt_ids, prompt_lps)

    @property
    def prompt_tokens(self) -> int:
        return sum(c.prompt_len for c in self.choices)

    @property
    def completion_tokens(self) -> int:
        return sum(c.tokens for c in self.choices)


def _merge(a: Delta, b: Delta) -> Delta:
    """Two deltas of one choice as one (the first holds the echoed prompt, if any)."""
    prompt_ids = a.prompt_ids if a.prompt_ids is not None else b.prompt_ids
    prompt_lps = a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs
    calls, lps = join_call_deltas(a.tool_calls, b.tool_calls), a.logprobs + b.logprobs
    return Delta(a.index, a.text + b.text, b.finish_reason, calls, lps, prompt_ids, prompt_lps)
