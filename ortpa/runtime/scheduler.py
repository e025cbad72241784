"""The continuous-batching scheduler: which requests compute how many tokens in the next step.

One step packs every running request's next tokens and newly admitted prompts under a token budget
(``max_num_batched_tokens``), the policy of vLLM v1's scheduler:

1. running requests, oldest first: a decode takes 1 token, an unfinished prompt takes the next chunk that
   fits the remaining budget (chunked prefill); when its blocks do not fit, the *newest* running request is
   preempted (blocks freed, requeued at the front of the waiting queue to recompute prompt + generated tokens)
   until they do, or the request itself is the newest and is preempted;
2. only if nobody was preempted, waiting requests in order, each adopting its cached prefix blocks first.

With ``mixed_steps=False`` a step takes either prompt chunks (running and admitted) or decodes, never both:
prompts first while any are pending (vLLM v0's policy); decodes then wait while prompts keep arriving.

Micro-batch groups (``num_groups``, pipeline stages with several steps in flight): every request belongs to one
group, the least loaded when it is added, for its whole life; :meth:`Scheduler.schedule` plans one group's step
from that group's requests only (a preemption's victim is of the same group too), so the steps of different
groups touch disjoint sequences and one group's step can run while another's is still in flight. The block
pool, the prefix cache, ``max_num_seqs`` and the order of the queues are shared (vLLM's virtual engines keep a
scheduler each; one shared pool lets a busy group use the blocks an idle one does not need).

Token layout of one request (``bs`` = block size; ``cached`` ⊆ ``computed``)::

    tokens:   | prompt ................................ | generated ....... |
              | < cached: adopted full blocks > | < computed > | < chunk > | rest |
                                                 num_computed ^           ^ num_computed + chunk

Block accounting: each step reserves ``PagedKVCache.blocks_needed`` per chunk against the free pool plus the
prefix cache's evictable blocks, evicting only when a reservation would otherwise fail. Adopted blocks are
always full and never a partial block is shared, so these per-request counts add up exactly and
``plan_step`` cannot run out of blocks.
"""

from __future__ import annotations

import collections
import enum
from dataclasses import dataclass, field

from ortpa.errors import InvalidRequest, RequestTooLarge, RequestTooLong, UnknownRequest
from ortpa.runtime.decode_feeds import DecodeFeeds
from ortpa.runtime.kv import PagedKVCache, StepInputs
from ortpa.runtime.prefix_cache import BlockHash, PrefixCache, extend_block_hashes
from ortpa.runtime.sampling import Sampler

__all__ = [
    "InvalidRequest",
    "Request",
    "RequestStatus",
    "RequestTooLarge",
    "RequestTooLong",
    "ScheduledChunk",
    "Scheduler",
    "SchedulerOutput",
    "SchedulerStats",
    "UnknownRequest",
]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"  # emitted a stop token
    FINISHED_LENGTH = "length"  # reached max_new_tokens
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


@dataclass(eq=False)
class Request:
    """One generation request. ``tokens`` is the prompt followed by the tokens generated so far."""

    request_id: str
    tokens: list[int]
    prompt_len: int
    sampler: Sampler
    status: RequestStatus = RequestStatus.WAITING
    # Leading tokens whose K/V is in the cache; equals the KV sequence's length while running.
    num_computed: int = 0
    # Leading full blocks already known to the prefix cache (adopted from it or offered to it).
    num_cached_blocks: int = 0
    # Hash chain over full blocks of `tokens`, grown lazily; stays valid across preemption (tokens only grow).
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_preemptions: int = 0
    # Prompt scoring (prompt_logprobs): one entry per prompt token (None for the first), filled as the prompt's
    # logits rows arrive; None once delivered or when not asked. While scoring, cached blocks are not adopted
    # (their tokens would have no logits) and chunks hold at most `max_chunk` tokens (0: no bound) when the
    # model returns one logits row per sequence.
    prompt_scores: list | None = None
    max_chunk: int = 0
    # The micro-batch group whose steps compute this request (Scheduler(num_groups=...)); set when it is added.
    group: int = 0

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def is_decoding(self) -> bool:
        """Past its prompt with one token (the last sampled) left to compute; else it needs a prompt chunk."""
        return self.num_computed >= self.prompt_len and len(self.tokens) - self.num_computed == 1


@dataclass(frozen=True)
class ScheduledChunk:
    """``num_tokens`` tokens of ``request`` starting at position ``start``, computed in this step."""

    request: Request
    start: int
    num_tokens: int

    @property
    def samples(self) -> bool:
        """Whether the chunk reaches the request's last token, so its logits give the next token."""
        return self.start + self.num_tokens == len(self.request.tokens)


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    inputs: StepInputs | DecodeFeeds | None  # None when nothing is scheduled; DecodeFeeds: see schedule()
    preempted: list[Request]


@dataclass
class SchedulerStats:
    computed_tokens: int = 0  # tokens scheduled for compute (prefill chunks, recomputation and decodes)
    cached_tokens: int = 0  # prompt tokens adopted from the prefix cache instead of computed
    preemptions: int = 0
    steps: int = 0


class Scheduler:
    """Waiting and running queues over one :class:`PagedKVCache` (and optionally a :class:`PrefixCache`)."""

    def __init__(
        self,
        kv: PagedKVCache,
        *,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        prefix_cache: PrefixCache | None = None,
        mixed_steps: bool = True,
        max_model_len: int | None = None,
        num_groups: int = 1,
    ) -> None:
        """``mixed_steps=False`` never puts prompt chunks and decodes in one step: prompt chunks go first while
        any are pending (vLLM v0's policy); decodes wait while prompts keep arriving.
        ``max_model_len`` (positions the model can take, ``None`` = unbounded) refuses longer requests.
        ``num_groups``: micro-batch groups (see the module docstring); ``max_num_batched_tokens`` bounds each
        group's step, ``max_num_seqs`` the running requests of all groups together.
        """
        if max_num_batched_tokens < 1 or max_num_seqs < 1 or num_groups < 1:
            raise InvalidRequest(
                f"Scheduler: expected max_num_batched_tokens >= 1, max_num_seqs >= 1 and num_groups >= 1, found "
                f"{max_num_batched_tokens}, {max_num_seqs} and {num_groups}"
            )
        self.kv = kv
        self.prefix_cache = prefix_cache
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.mixed_steps = mixed_steps
        self.max_model_len = max_model_len
        self.num_groups = num_groups
        self.group_load = [0] * num_groups  # unfinished requests of each group
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # admission order: oldest first, preempted last-in-first-out
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.stats = SchedulerStats()
        self._reserved = 0  # blocks promised to this step's chunks, not yet taken by plan_step

    # -- queue management --------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue a request; raise :class:`RequestTooLarge` if it could never fit the pool, even alone."""
        self.check(request)
        # the least loaded group (the lowest index among equals): prompts added together alternate groups
        request.group = min(range(self.num_groups), key=self.group_load.__getitem__)
        self.group_load[request.group] += 1
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def check(self, request: Request) -> None:
        """Raise what :meth:`add` would raise for ``request``, queueing nothing."""
        if request.request_id in self.requests:
            raise InvalidRequest(f"add_request: request id {request.request_id!r} is already in use")
        # The last generated token is returned, never fed back, so it needs no K/V.
        longest = request.prompt_len + max(request.sampler.params.max_new_tokens - 1, 0)
        blocks = -(-longest // self.kv.block_size)
        if self.max_model_len is not None and longest > self.max_model_len:
            raise RequestTooLong(request.request_id, longest, self.max_model_len)
        if blocks > self.kv.num_blocks:
            raise RequestTooLarge(request.request_id, longest, blocks, self.kv.num_blocks, self.kv.block_size)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Retire a request: free its blocks (cached ones stay in the prefix cache) and forget it."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self._free(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        request.status = status
        del self.requests[request.request_id]
        self.group_load[request.group] -= 1

    @property
    def num_available_blocks(self) -> int:
        """Free blocks plus cached blocks no request reads (evictable on demand)."""
        evictable = self.prefix_cache.num_evictable() if self.prefix_cache is not None else 0
        return self.kv.num_free_blocks + evictable

    # -- one step ----------------------------------------------------------------------------------
    def schedule(self, group: int = 0, decode_feeds: DecodeFeeds | None = None) -> SchedulerOutput:
        """Choose this step's chunks (of ``group``'s requests), reserve their blocks and return the op's index
        inputs for them.

        With ``decode_feeds``, a step whose chunks are all decodes is planned into it (its arrays updated in
        place, :mod:`ortpa.runtime.decode_feeds`) and it is the output's ``inputs``; any other step resets it.
        """
        if not 0 <= group < self.num_groups:
            raise InvalidRequest(f"Scheduler.schedule: expected a group in [0, {self.num_groups}), found {group}")
        self._reserved = 0
        if self.mixed_steps:
            chunks, preempted = self._select(group, decodes=True, prompts=True)
        else:  # prompt chunks while any prompt is pending, else decodes (see __init__)
            chunks, preempted = self._select(group, decodes=False, prompts=True)
            if not chunks:
                # Also when the prompt phase preempted (possibly its own request, the newest running one):
                # the older decodes still hold their blocks, and a step with nothing to run would stall.
                more, also_preempted = self._select(group, decodes=True, prompts=False)
                chunks, preempted = more, preempted + also_preempted
        inputs = None
        if chunks and decode_feeds is not None and all(c.request.is_decoding for c in chunks):
            decode_feeds.plan(self.kv, [c.request.request_id for c in chunks])
            inputs = decode_feeds
        else:
            if decode_feeds is not None:
                decode_feeds.reset()
            if chunks:
                inputs = self.kv.plan_step([(c.request.request_id, c.num_tokens) for c in chunks])
        if chunks:
            self.stats.computed_tokens += sum(c.num_tokens for c in chunks)
            self.stats.steps += 1
        self.stats.preemptions += len(preempted)
        return SchedulerOutput(chunks, inputs, preempted)

    def _select(self, group: int, *, decodes: bool, prompts: bool) -> tuple[list[ScheduledChunk], list[Request]]:
        """Running requests first, then admissions, of ``group`` only; ``decodes`` / ``prompts`` say which kinds
        of chunk to take."""
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[Request] = []
        # this group's running requests, oldest first: only they may be preempted (another group's step may be
        # in flight, computing into its requests' blocks)
        mine = [r for r in self.running if r.group == group]

        i = 0
        while i < len(mine) and budget > 0:
            req = mine[i]
            if not (decodes if req.is_decoding else prompts):
                i += 1
                continue
            n = min(len(req.tokens) - req.num_computed, budget, req.max_chunk or budget)
            need = self.kv.blocks_needed(req.request_id, n)
            fits = self._reserve(need)
            while not fits and mine[-1] is not req:
                victim = mine.pop()
                self._preempt(victim)
                preempted.append(victim)
                fits = self._reserve(need)
            if not fits:  # req is the newest running request and still does not fit: it waits instead
                self._preempt(mine.pop())
                preempted.append(req)
                break
            chunks.append(ScheduledChunk(req, req.num_computed, n))
            budget -= n
            i += 1

        # Admitting while preempting would free blocks for one request only to take them for another.
        queue = [r for r in self.waiting if r.group == group] if prompts and not preempted else []
        for req in queue:
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            hits = self._match(req)
            cached = len(hits) * self.kv.block_size
            n = min(len(req.tokens) - cached, budget, req.max_chunk or budget)
            self.kv.add_sequence(req.request_id, cached, shared_blocks=hits)  # full blocks only: no allocation
            if not self._reserve(self.kv.blocks_needed(req.request_id, n)):
                self.kv.free(req.request_id)
                break
            self.waiting.remove(req)
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            req.num_computed = cached
            req.num_cached_blocks = len(hits)
            if self.prefix_cache is not None:
                self.prefix_cache.touch(req.block_hashes[: len(hits)])
            self.stats.cached_tokens += cached
            chunks.append(ScheduledChunk(req, cached, n))
            budget -= n
        return chunks, preempted

    def commit(self, chunks: list[ScheduledChunk]) -> None:
        """The step ran: advance each request's computed count and offer its new full blocks to the cache.

        A request that finished while its step was in flight (aborted) has nothing left to advance: skipped.
        """
        for c in chunks:
            req = c.request
            if req.status is not RequestStatus.RUNNING:
                continue
            req.num_computed = c.start + c.num_tokens
            if self.prefix_cache is None:
                continue
            bs = self.kv.block_size
            full = req.num_computed // bs
            if full <= req.num_cached_blocks:
                continue
            extend_block_hashes(req.block_hashes, req.tokens, bs, full)
            blocks = self.kv.block_ids(req.request_id)
            for b in range(req.num_cached_blocks, full):
                self.prefix_cache.insert(req.block_hashes[b], blocks[b], req.tokens[b * bs : (b + 1) * bs])
            req.num_cached_blocks = full

    # -- internals ---------------------------------------------------------------------------------
    def _match(self, req: Request) -> list[int]:
        """Cached blocks the request can adopt: full blocks only, and never its last token (it needs logits)."""
        if self.prefix_cache is None or req.prompt_scores is not None:
            return []
        limit = (len(req.tokens) - 1) // self.kv.block_size
        extend_block_hashes(req.block_hashes, req.tokens, self.kv.block_size, limit)
        return self.prefix_cache.match(req.block_hashes[:limit], req.tokens)

    def _reserve(self, need: int) -> bool:
        """Promise ``need`` more blocks to this step, evicting cached blocks only if that makes it fit."""
        short = self._reserved + need - self.kv.num_free_blocks
        if short > 0:
            if self.prefix_cache is None or self.prefix_cache.num_evictable() < short:
                return False
            self.prefix_cache.evict(short)
        self._reserved += need
        return True

    def _preempt(self, req: Request) -> None:
        """Free a running request's blocks and requeue it first, to recompute prompt + generated tokens."""
        self.running.remove(req)
        self._free(req)
        req.status = RequestStatus.WAITING
        req.num_computed = 0
        req.num_cached_blocks = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def _free(self, req: Request) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.release(req.block_hashes[: req.num_cached_blocks])
        self.kv.free(req.request_id)
