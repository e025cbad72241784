"""``ortpa.Engine``: continuous-batching generation over a converted (paged) model.

Each :meth:`Engine.step` asks the :class:`~ortpa.runtime.scheduler.Scheduler` for a batch (decodes and prompt
chunks under a token budget; preemption and prefix-cache adoption happen there), runs the pending block copies
and one :class:`~ortpa.runtime.session.PagedSession` step, samples a token for every request whose chunk
reached its last token, and retires finished requests. With several micro-batches (pipeline stages), a step
launches the batch of every request group with none in flight and lands the oldest
(:mod:`ortpa.runtime.microbatch`).

The model is driven through the converted-model interface (docs/converted_model.md): ``input_ids``,
``cumulative_sequence_lengths``, ``past_sequence_lengths``, ``block_table``, and, when the graph declares
them, ``attention_metadata``, ``position_ids`` and ``logits_indices``. ``logits`` has one row per sequence
(ortpa's default), plus every position of a chunk whose prompt is scored where the model takes ``logits_indices``
(:mod:`ortpa.runtime.prompt_scoring`), or one per packed token (``--logits all``, onnxruntime-genai's; a model
without ortpa's metadata is told apart at run time by the row count).
Reading that interface from the graph lives in :mod:`ortpa.runtime.model_io`, the one-driver-thread guard in
:mod:`ortpa.runtime.driver`.

Example::

    engine = Engine("paged.onnx", num_blocks=256, block_size=16)
    outputs = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=8))
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from ortpa.errors import ConcurrentUse, InvalidModel, InvalidParameter, OrtpaError, StageFailed
from ortpa.model.file import LoadedModel
from ortpa.runtime.decode_feeds import DecodeFeeds
from ortpa.runtime.driver import SingleDriver
from ortpa.runtime.kv import PagedKVCache
from ortpa.runtime.microbatch import InFlight, Launched, Ran, collect, submit
from ortpa.runtime.model_io import cache_bytes_per_block, model_io, rotary_table_rows
from ortpa.runtime.prefix_cache import PrefixCache
from ortpa.runtime.prompt_scoring import RowsMode, score_prompts, step_rows
from ortpa.runtime.sampling import RowContext, Sampler, SamplingParams, TokenLogprobs, sample_rows
from ortpa.runtime.scheduler import (
    InvalidRequest,
    Request,
    RequestStatus,
    RequestTooLarge,
    RequestTooLong,
    ScheduledChunk,
    Scheduler,
    UnknownRequest,
)
from ortpa.runtime.session import PagedSession, find_cache_aliases, read_for_session
from ortpa.runtime.stage_folder import is_stage_folder

__all__ = [
    "DEFAULT_KV_BUDGET_BYTES",
    "DEFAULT_MAX_NUM_BATCHED_TOKENS",
    "ConcurrentUse",
    "Engine",
    "EngineStats",
    "InvalidRequest",
    "RequestOutput",
    "RequestTooLarge",
    "RequestTooLong",
    "SamplingParams",
    "TokenLogprobs",
    "UnknownRequest",
    "rotary_table_rows",
]

# Tokens one step may compute when the caller does not say. Larger steps read the weights fewer times per prompt
# token and let a burst of prompts finish together instead of leaving a tail of small decode steps; smaller ones
# let running decodes go on sooner while a long prompt is prefilled (docs/python_api.md). Measured on the
# vs_genai Llama (CPU, 2 threads), 16 prompts of 64 tokens arriving together, 10 alternated rounds: 256 -> 1.000,
# 512 -> 0.964, 1024 -> 0.926 of the time.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 1024  # the CLI's help says it too

# Pool size when neither num_blocks nor kv_budget_bytes is given: enough for the examples, small enough for a
# laptop. On a GPU pass kv_budget_bytes (or num_blocks) sized from the memory left after the weights.
DEFAULT_KV_BUDGET_BYTES = 256 << 20


@dataclass(frozen=True)
class RequestOutput:
    """What one request produced in one step."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None  # "stop", "length" or None while running
    # with SamplingParams.logprobs: one entry per new token (raw log-probabilities, float32 values)
    logprobs: tuple[TokenLogprobs, ...] | None = None
    # with SamplingParams.prompt_logprobs: one entry per prompt token (None for the first), in the request's
    # first output (its first token, or its end when max_new_tokens=0)
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None


@dataclass(frozen=True)
class EngineStats:
    """Counters since the engine was built."""

    steps: int
    prompt_tokens: int  # prompt tokens of every request added
    computed_tokens: int  # tokens fed through the model: prompt chunks, recomputation after preemption, decodes
    cached_tokens: int  # prompt tokens taken from the prefix cache instead of computed
    generated_tokens: int
    preemptions: int
    max_in_flight: int = 0  # the most steps in flight at once (Engine(micro_batches=...); 1 once a step ran)


class Engine:
    """Continuous batching, chunked prefill, preemption and prefix caching over one paged model.

    ``num_blocks`` sizes the KV pool directly; otherwise ``kv_budget_bytes`` (default
    :data:`DEFAULT_KV_BUDGET_BYTES`) is divided by the bytes one block costs across all layers' caches.
    ``max_num_batched_tokens`` bounds the tokens of one step (None: :data:`DEFAULT_MAX_NUM_BATCHED_TOKENS`; a
    longer prompt is prefilled in chunks),
    ``max_num_seqs`` the requests running at once. ``providers`` and ``sess_options`` go to ONNX Runtime;
    ``paged_attention`` forces a PagedAttention path (:class:`InferenceSession`). The CPU pool's spinning is ONNX
    Runtime's default unless ``sess_options`` sets ``session.intra_op.allow_spinning`` (on a machine whose cores
    other work shares, ``"0"`` pays: docs/native.md, "Threads").

    ``model`` may be a stage folder (``ortpa split``): this engine's scheduler and block manager then drive every
    stage, each a Ray actor (``stages="ray"``: ``ray_address`` joins a cluster, else a local one starts;
    ``placement`` is ``"pack"``, ``"spread"`` or ``"strict-spread"``) or all in this process (``stages="local"``);
    a stage that dies raises :class:`~ortpa.errors.StageFailed` from :meth:`step` after the requests it was
    running were ended. :meth:`close` stops the actors (docs/distributed.md).

    ``micro_batches``: how many steps may be in flight at once, each of its own group of requests (every request
    belongs to one group, the least loaded when it is added; :mod:`ortpa.runtime.microbatch`). Default: one per
    stage for a Ray pipeline, so that while stage ``k`` runs one group's step stage ``k - 1`` runs the next
    group's; 1 otherwise (a model in this process runs one step at a time; more groups there only take turns).
    :meth:`step` then launches a step for every group with none in flight and returns what the oldest step
    produced; ``max_num_batched_tokens`` bounds each group's step, ``max_num_seqs`` all groups together.

    Every step mixes decodes and prompt chunks (chunked prefill), on the native kernels and on the portable
    PagedAttention alike: the portable op attends decodes and prompt chunks in separate groups, so a step
    costs about what its parts would cost apart, and decodes keep their pace while prompts arrive.
    ``mixed_steps=False`` runs prompt chunks and decodes in separate steps instead (prompts first, vLLM v0's
    policy).

    Threads: one thread drives the engine (:meth:`step`, :meth:`generate`, :meth:`stream`); a second thread
    calling :meth:`step` or :meth:`generate` while it does gets :class:`~ortpa.errors.ConcurrentUse`.
    :meth:`add_request`, :meth:`abort` and the read-only queries are safe from any thread: they take the
    engine's lock, which a step holds from scheduling to sampling (so they wait at most one step). Each engine
    owns its own :class:`PagedSession` and KV pool; engines never share cache buffers.
    """

    def __init__(
        self,
        model: str | os.PathLike | bytes | onnx.ModelProto | LoadedModel,
        *,
        num_blocks: int | None = None,
        block_size: int = 16,
        providers: Sequence[Any] | None = None,
        max_num_batched_tokens: int | None = None,
        max_num_seqs: int = 64,
        enable_prefix_caching: bool = True,
        kv_budget_bytes: int | None = None,
        sess_options: ort.SessionOptions | None = None,
        mixed_steps: bool = True,
        paged_attention: str | None = None,
        stages: str = "ray",
        ray_address: str | None = None,
        placement: str = "pack",
        micro_batches: int | None = None,
    ) -> None:
        if micro_batches is not None and (not isinstance(micro_batches, int) or micro_batches < 1):
            raise InvalidParameter(
                "Engine", "micro_batches", "an int >= 1 (or None: one per pipeline stage)", micro_batches
            )
        budget = DEFAULT_KV_BUDGET_BYTES if kv_budget_bytes is None else kv_budget_bytes
        self.session: Any
        if isinstance(model, (str, os.PathLike)) and is_stage_folder(model):
            # a stage folder (`ortpa split`): this engine's scheduler and blocks drive every stage
            from ortpa.runtime.pipeline import open_stages

            self.session, facts = open_stages(
                model,
                num_blocks=num_blocks,
                budget=budget,
                block_size=block_size,
                providers=providers,
                sess_options=sess_options,
                executor=stages,
                ray_address=ray_address,
                placement=placement,
                paged_attention=paged_attention,
            )
            self.io, max_model_len, all_rows = facts.io, facts.max_model_len, facts.all_rows
        else:
            loaded = read_for_session(model)  # once: the session takes it as is, keeping the file's name for errors
            proto = loaded.proto
            caches = {a.input_name for a in find_cache_aliases(proto)}
            self.io = model_io(proto, caches)
            if num_blocks is None:
                num_blocks = budget // max(1, cache_bytes_per_block(proto, caches, block_size))
            if num_blocks < 1:
                raise InvalidRequest(f"Engine: the KV pool must hold at least 1 block, found num_blocks={num_blocks}")
            self.session = PagedSession(
                loaded,
                num_blocks=num_blocks,
                block_size=block_size,
                providers=providers,
                sess_options=sess_options,
                paged_attention=paged_attention,
            )
            max_model_len = rotary_table_rows(proto)
            all_rows = any(p.key == "ortpa.logits" and p.value == "all" for p in proto.metadata_props)
        # one micro-batch per stage where the stages run in the background (a Ray pipeline), else one step at a time
        if micro_batches is None:
            micro_batches = getattr(self.session, "num_stages", 1) if hasattr(self.session, "submit") else 1
        self.micro_batches = micro_batches
        self._in_flight = InFlight(micro_batches) if micro_batches > 1 else None
        self.mixed_steps = mixed_steps
        self.kv = PagedKVCache(self.session.num_blocks, self.session.block_size)
        self.prefix_cache = PrefixCache(self.kv) if enable_prefix_caching else None
        self.scheduler = Scheduler(
            self.kv,
            max_num_batched_tokens=DEFAULT_MAX_NUM_BATCHED_TOKENS
            if max_num_batched_tokens is None
            else max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            prefix_cache=self.prefix_cache,
            mixed_steps=mixed_steps,
            max_model_len=max_model_len,
            num_groups=micro_batches,
        )
        # one logits row per packed token ("all"), or the rows a step names ("indices"): a scored prompt's rows come
        # with any chunk; otherwise ("last") a scored prompt runs one token per chunk, each token some chunk's last
        self._rows_mode: RowsMode = "all" if all_rows else "indices" if self.io.logits_indices else "last"
        self._ids = itertools.count()
        self._prompt_tokens = 0
        self._generated_tokens = 0
        # all-decode steps keep their index arrays bound and update them in place (a model file's session only, one
        # step at a time: the arrays are one step's, and with several micro-batches each step would need its own)
        self._decode_feeds = (
            DecodeFeeds(attention_metadata=self.io.attention_metadata, position_ids=self.io.position_ids)
            if isinstance(self.session, PagedSession) and self._in_flight is None
            else None
        )
        self._bound_layout = -1  # the DecodeFeeds layout the session has bound
        self._lock = threading.RLock()  # scheduler, KV and prefix-cache state: held for a whole step
        self._driver = SingleDriver("Engine.step")

    # -- requests ------------------------------------------------------------------------------------
    def add_request(
        self, prompt_ids: Sequence[int], sampling: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Queue a prompt; returns its request id. Raises :class:`RequestTooLarge` if it can never fit.

        :class:`RequestTooLong` (a :class:`RequestTooLarge`) if prompt + ``max_new_tokens`` runs past the
        model's rotary position table (models converted with RoPE in the op hold ``max_positions`` rows).
        """
        with self._lock:
            request = self._make_request(prompt_ids, sampling or SamplingParams(), request_id)
            self.scheduler.add(request)
            self._prompt_tokens += request.prompt_len
            return request.request_id

    def abort(self, request_id: str) -> None:
        """Drop an unfinished request and free its blocks (its cached full blocks stay in the prefix cache)."""
        with self._lock:
            request = self.scheduler.requests.get(request_id)
            if request is None:
                raise UnknownRequest(request_id, "abort")
            self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)

    def has_unfinished(self) -> bool:
        with self._lock:
            return self.scheduler.has_unfinished()

    # -- stepping ------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one batch; return the token each sampled request got (chunks mid-prompt produce nothing).

        With several micro-batches: launch a batch for every group with none in flight, and return what the
        oldest batch in flight produced (the others stay in flight for the next calls).

        Raises :class:`~ortpa.errors.ConcurrentUse` if another thread is driving the engine.
        """
        with self._driver.hold(), self._lock:
            return self._step()

    # A step is launched (its group scheduled, its feeds built and handed to the model) and later landed (its
    # tokens sampled, its requests advanced or finished). With one micro-batch the two follow each other in
    # `_step`; with several (`_step_in_flight`) up to one step per group is in flight between them.
    def _step(self) -> list[RequestOutput]:
        if self._in_flight is not None:
            return self._step_in_flight()
        launched = self._launch(0)
        if launched is None:
            self._check_progress()
            return []
        try:
            logits = collect(self.session, launched.handle)
        except StageFailed:
            self._lose_caches()
            raise
        return self._land(launched, logits)

    def _step_in_flight(self) -> list[RequestOutput]:
        """Launch a step for every group with none in flight (and work to do), then land the oldest step."""
        assert self._in_flight is not None
        try:
            for group in self._in_flight.groups_to_launch():
                launched = self._launch(group)
                if launched is not None:
                    self._in_flight.push(launched)
            if not len(self._in_flight):
                self._check_progress()
                return []
            oldest = self._in_flight.pop_oldest()
            logits = collect(self.session, oldest.handle)
        except StageFailed:
            # every step in flight ran on the stage that died: none is collected, and every running request
            # (of every group) lost its cache there
            self._in_flight.drop_all()
            self._lose_caches()
            raise
        return self._land(oldest, logits)

    def _check_progress(self) -> None:
        """Nothing launched and nothing in flight: fine when no request is left."""
        if self.scheduler.has_unfinished():  # the scheduler's accounting makes this unreachable
            raise OrtpaError(f"Engine.step: {len(self.scheduler.requests)} unfinished request(s) but none fits")

    def _launch(self, group: int) -> Launched | None:
        """Schedule ``group``'s next step and hand it to the model; None when the group has nothing to run."""
        plan = self.scheduler.schedule(group, self._decode_feeds)
        if plan.inputs is None:
            return None
        inputs = plan.inputs
        # copies are ordered before this step on every stage, after the steps already in flight
        self.session.copy_blocks(self.kv.take_pending_copies())
        if inputs is self._decode_feeds:  # every chunk a decode: the bound index arrays, updated in place, run now
            logits = self._run_decodes(plan.chunks)
            return Launched(group, plan.chunks, len(plan.chunks), None, Ran({"logits": logits}))
        ids = np.array([t for c in plan.chunks for t in c.request.tokens[c.start : c.start + c.num_tokens]], np.int64)
        feeds = inputs.model_feeds(
            ids, attention_metadata=self.io.attention_metadata, position_ids=self.io.position_ids
        )
        asked = step_rows(plan.chunks, self._rows_mode)
        if asked.indices is not None:  # an input with a default: ONNX Runtime binds those as OrtValues only
            feeds["logits_indices"] = ort.OrtValue.ortvalue_from_numpy(asked.indices)
        return Launched(group, plan.chunks, len(ids), asked, submit(self.session, feeds))

    def _land(self, launched: Launched, logits: np.ndarray) -> list[RequestOutput]:
        """A launched step's logits arrived: score prompts, advance the requests, sample and finish them.

        A request aborted while its step was in flight (from another thread, between two steps) is skipped.
        """
        chunks, asked = launched.chunks, launched.asked
        if asked is None:  # an all-decode step on the bound feeds: one row per chunk (checked by _run_decodes)
            rows = logits
        else:
            if asked.indices is None and logits.ndim == 2 and logits.shape[0] == launched.num_ids != asked.total:
                asked = step_rows(chunks, "all")  # a model without ortpa's metadata giving every token's row
            asked.check(logits)
            rows = logits[asked.last]
            if any(c.request.prompt_scores is not None for c in chunks):
                score_prompts(chunks, logits, asked)
        self.scheduler.commit(chunks)
        return self._sample(chunks, rows)

    def _run_decodes(self, chunks: list[ScheduledChunk]) -> np.ndarray:
        """Run an all-decode step on the bound feeds (:mod:`ortpa.runtime.decode_feeds`); its logits rows."""
        feeds = self._decode_feeds
        feeds.set_tokens([c.request.tokens[-1] for c in chunks])
        if self._bound_layout != feeds.layout:  # new arrays (the batch changed, the table widened): bind them
            # and the logits rows ONNX Runtime writes into (overwritten each step: landed before the next runs)
            into = self.session.step_output("logits", len(chunks))
            self.session.bind_step(feeds.feeds, ["logits"], into=None if into is None else {"logits": into})
            self._bound_layout = feeds.layout
        logits = self.session.run_bound()["logits"]
        if logits.ndim != 2 or logits.shape[0] != len(chunks):
            n, found = len(chunks), logits.shape
            raise InvalidModel("logits", f"expected a 2-D output with {n} rows (one per decode), found {found}")
        return logits

    def _sample(self, chunks: list[ScheduledChunk], rows: np.ndarray) -> list[RequestOutput]:
        """Choose the tokens of a step whose chunks ran (``rows``: each chunk's last logits row) and retire the
        requests that finished: one batched choice for every chunk that reached its request's last token (and
        has tokens to generate). A request aborted while its step was in flight is skipped."""
        live = [c.request.status is RequestStatus.RUNNING for c in chunks]
        sampling = [
            i for i, c in enumerate(chunks) if live[i] and c.samples and c.request.sampler.params.max_new_tokens > 0
        ]
        reqs = [chunks[i].request for i in sampling]
        contexts = [RowContext(r.sampler.params, r.tokens, r.prompt_len) for r in reqs]
        picked_rows = rows if len(sampling) == len(rows) else rows[sampling]
        chosen = iter(sample_rows(picked_rows, [r.sampler for r in reqs], contexts) if sampling else ())
        outputs = []
        for chunk, alive in zip(chunks, live, strict=True):
            if not chunk.samples or not alive:
                continue
            req = chunk.request
            params = req.sampler.params
            prompt_lps = None
            if req.prompt_scores is not None:
                prompt_lps, req.prompt_scores, req.max_chunk = tuple(req.prompt_scores), None, 0
            if params.max_new_tokens == 0:  # a scored prompt, nothing to generate
                self.scheduler.finish(req, RequestStatus.FINISHED_LENGTH)
                outputs.append(RequestOutput(req.request_id, (), True, "length", None, prompt_lps))
                continue
            picked = next(chosen)
            if picked.token_id is None:  # the request's constraint allows no token: its output is complete
                self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
                outputs.append(RequestOutput(req.request_id, (), True, "stop", (), prompt_lps))
                continue
            token = picked.token_id
            req.tokens.append(token)
            self._generated_tokens += 1
            status = None
            if params.constraint is not None:
                params.constraint.advance(token)
            if token in params.stop_token_ids or (params.constraint is not None and params.constraint.is_terminated()):
                status = RequestStatus.FINISHED_STOPPED
            elif len(req.tokens) - req.prompt_len >= params.max_new_tokens:
                status = RequestStatus.FINISHED_LENGTH
            if status is not None:
                self.scheduler.finish(req, status)
            reason = None if status is None else status.value
            lps = None if picked.logprobs is None else (picked.logprobs,)
            outputs.append(RequestOutput(req.request_id, (token,), status is not None, reason, lps, prompt_lps))
        return outputs

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[list[int]]:
        """Generate for every prompt (batched continuously); the generated ids, in prompt order.

        A request aborted from another thread meanwhile returns the tokens it had produced.
        """
        with self._driver.hold():  # for the whole call: another driver would take this call's tokens
            ids = self._add_all(prompts, sampling)
            outputs: dict[str, list[int]] = {i: [] for i in ids}
            for request_id, token in self._drain(ids):
                outputs[request_id].append(token)
            return [outputs[i] for i in ids]

    def stream(
        self,
        requests: Sequence[Sequence[int]] | Sequence[str],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[tuple[str, int]]:
        """Yield ``(request_id, token)`` as tokens are produced, until every given request has finished.

        ``requests`` are prompts (added here, with ``sampling``) or ids of requests already added (tokens they
        generated before the call come first). Requests are added, and ids checked, before this returns.
        """
        if requests and all(isinstance(r, str) for r in requests):
            ids = list(requests)
            with self._lock:
                for i in ids:
                    if i not in self.scheduler.requests:
                        raise UnknownRequest(i, "stream")
                done = [(i, t) for i in ids for t in self.scheduler.requests[i].output]
        else:
            ids, done = self._add_all(requests, sampling), []  # type: ignore[arg-type]
        return itertools.chain(done, self._drain(ids))

    @property
    def stats(self) -> EngineStats:
        with self._lock:
            s = self.scheduler.stats
            return EngineStats(
                steps=s.steps,
                prompt_tokens=self._prompt_tokens,
                computed_tokens=s.computed_tokens,
                cached_tokens=s.cached_tokens,
                generated_tokens=self._generated_tokens,
                preemptions=s.preemptions,
                max_in_flight=self._in_flight.max_depth if self._in_flight is not None else min(s.steps, 1),
            )

    @property
    def num_blocks(self) -> int:
        return self.kv.num_blocks

    @property
    def num_available_blocks(self) -> int:
        """Free blocks plus cached blocks no request reads: ``num_blocks`` once every request is done."""
        with self._lock:
            return self.scheduler.num_available_blocks

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (blocks of running requests stay with them)."""
        with self._lock:
            if self.prefix_cache is not None:
                self.prefix_cache.clear()

    def close(self) -> None:
        """Release what the engine started (a stage folder's Ray actors); a model file's engine holds nothing."""
        close = getattr(self.session, "close", None)
        if close is not None:
            close()

    # -- internals -----------------------------------------------------------------------------------
    def _lose_caches(self) -> None:
        """A stage lost its cache: end every request with state in it, and forget every cached block."""
        for request in list(self.scheduler.running):
            self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    def _make_request(self, prompt_ids: Sequence[int], sampling: SamplingParams, request_id: str | None) -> Request:
        rid = str(next(self._ids)) if request_id is None else request_id
        tokens = [int(t) for t in np.asarray(prompt_ids, dtype=np.int64).reshape(-1)]
        if not tokens:
            raise InvalidRequest(f"request {rid!r}: the prompt is empty (expected at least one token id)")
        bad = [t for t in tokens if t < 0 or (self.io.vocab is not None and t >= self.io.vocab)]
        if bad:
            raise InvalidRequest(f"request {rid!r}: token ids {bad[:5]} outside the vocabulary [0, {self.io.vocab})")
        if not isinstance(sampling, SamplingParams):
            raise InvalidRequest(f"request {rid!r}: expected SamplingParams, found {type(sampling).__name__}")
        if self.io.vocab is not None:
            outside = [t for t, _ in sampling.logit_bias if t >= self.io.vocab]
            if outside:
                raise InvalidRequest(
                    f"request {rid!r}: logit_bias token ids {outside[:5]} outside the vocabulary [0, {self.io.vocab})"
                )
        request = Request(rid, tokens, len(tokens), Sampler(sampling))
        if sampling.prompt_logprobs is not None:
            request.prompt_scores = [None] * len(tokens)
            request.max_chunk = 0 if self._rows_mode != "last" else 1
        return request

    def _add_all(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams | Sequence[SamplingParams] | None
    ) -> list[str]:
        """Add every prompt, or none: all are checked (sizes included) before the first is queued."""
        if sampling is None or isinstance(sampling, SamplingParams):
            params = [sampling or SamplingParams()] * len(prompts)
        else:
            params = list(sampling)
            if len(params) != len(prompts):
                raise InvalidRequest(f"expected one SamplingParams per prompt ({len(prompts)}), found {len(params)}")
        with self._lock:
            requests = [self._make_request(p, s, None) for p, s in zip(prompts, params, strict=True)]
            for r in requests:
                self.scheduler.check(r)
            for r in requests:
                self.scheduler.add(r)
                self._prompt_tokens += r.prompt_len
            return [r.request_id for r in requests]

    def _drain(self, ids: list[str]) -> Iterator[tuple[str, int]]:
        with self._lock:
            pending = {i for i in ids if i in self.scheduler.requests}
        while pending:
            for out in self.step():
                if out.request_id in pending:
                    for t in out.new_token_ids:
                        yield out.request_id, t
                    if out.finished:
                        pending.discard(out.request_id)
            with self._lock:  # aborted meanwhile (from another thread): nothing more will come for it
                pending = {i for i in pending if i in self.scheduler.requests}
