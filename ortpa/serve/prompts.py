"""Request prompts to token ids off the event loop, refused as early as each check can be made.

The chat template is rendered and the text tokenized in a small thread pool (as vLLM's front end does), so a long
prompt never holds the loop that streams every other request's tokens: ``Tokenizer.encode_batch`` releases
Python's GIL while it runs (``encode`` does not), and rendering, pure Python, gives the GIL back every few
milliseconds. Before a text is tokenized, two checks on its UTF-8 size alone: the deployment's ``max_prompt_bytes``
and, where the tokenizer has a bound on the bytes one token covers (:mod:`ortpa.serve.prompt_bound`), the fewest
tokens the text can be against the context; a prompt that fails either is refused without being tokenized.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ortpa.serve.chat import ChatTemplate, TemplateRenderError
from ortpa.serve.limits import ServeLimits
from ortpa.serve.model import ServingModel
from ortpa.serve.prompt_bound import TokenBound, min_tokens, token_bound
from ortpa.serve.protocol import ApiError
from ortpa.serve.request_checks import prompt_items

__all__ = ["PromptWorker"]

_WORKERS = 2  # a long prompt being tokenized does not hold up the next request's


class PromptWorker:
    """Tokenizes and renders for one server; :meth:`close` when the server stops."""

    def __init__(self, served: ServingModel, limits: ServeLimits) -> None:
        self.served = served
        self.limits = limits
        self.bound: TokenBound = token_bound(served.tokenizer)
        self._pool = ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="ortpa-prompts")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def check_text(self, texts: list[str], param: str, completion: int | None) -> None:
        """Refuse ``texts`` (one request's prompt) by their size alone: past ``max_prompt_bytes``, or more tokens,
        at the fewest, than the context holds beside ``completion`` tokens (None: not checked, as ``/tokenize``
        counts any text's tokens)."""
        sizes = [len(t.encode("utf-8", "surrogatepass")) for t in texts]
        total = sum(sizes)
        most = self.limits.prompt_bytes(self.served.max_model_len)
        if total > most:
            raise ApiError(
                400,
                f"the prompt is {total} bytes of text, past this server's limit of {most} bytes (--max-prompt-bytes)",
                param=param,
                code="prompt_too_long",
            )
        limit = self.served.max_model_len
        fewest = max((min_tokens(s, self.bound) for s in sizes), default=0)
        if limit is not None and completion is not None and fewest + completion > limit:
            raise ApiError(
                400,
                f"this model's maximum context length is {limit} tokens, but the prompt's {max(sizes)} bytes are "
                f"at least {fewest} tokens (one token of this tokenizer covers at most "
                f"{self.bound.max_bytes_per_token} bytes): shorten the prompt",
                param=param,
                code="context_length_exceeded",
            )

    def _encode(self, texts: list[str], add_special: bool) -> list[list[int]]:
        return [e.ids for e in self.served.tokenizer.encode_batch(texts, add_special_tokens=add_special)]

    async def encode(self, texts: list[str], add_special: bool, param: str, completion: int | None) -> list[list[int]]:
        """``texts`` checked (:meth:`check_text`), then tokenized in the pool."""
        self.check_text(texts, param, completion)
        if not texts:
            return []
        return await self._run(self._encode, texts, add_special)

    async def completion_prompts(self, prompt: Any, completion: int) -> tuple[list[list[int]], list[str | None]]:
        """The prompt field as token id lists (its strings tokenized in the pool, in one batch) and as texts."""
        items = prompt_items(prompt)
        strings = iter(await self.encode([p for p in items if isinstance(p, str)], True, "prompt", completion))
        out = [next(strings) if isinstance(p, str) else list(p) for p in items]
        for i, ids in enumerate(out):
            if not ids:
                raise ApiError(400, f"'prompt': prompt {i} is empty (expected at least one token)", param="prompt")
        return out, [p if isinstance(p, str) else None for p in items]

    async def render_encode(
        self,
        template: ChatTemplate,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: list[Any] | None,
        completion: int | None,
    ) -> list[int]:
        """The messages rendered by the chat template, checked and tokenized, all in the pool (one hop)."""

        def work() -> list[int]:
            try:
                text = template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools)
            except TemplateRenderError as exc:
                raise ApiError(400, str(exc), param="messages") from None
            self.check_text([text], "messages", completion)
            # the template writes the special tokens itself
            return self._encode([text], add_special=False)[0]

        return await self._run(work)

    async def decode(self, ids: list[int]) -> str:
        return (await self._run(lambda: self.served.tokenizer.decode_batch([ids], skip_special_tokens=False)))[0]
