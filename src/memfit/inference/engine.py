"""The inference engine: continuous batching over a paged KV cache (Yu et al. 2022, "Orca";
Kwon et al. 2023, "vLLM").

    engine = Engine(model, cache, max_step_tokens=512)
    engine.add(prompt_ids, SamplingParams(max_tokens=64, temperature=0.8, seed=1))
    outputs = engine.run()          # every request's new tokens, in the order they were added

Each step the scheduler builds one batch:
1. every running sequence decodes one token. If the pool has no slot for one of them, the
   newest running sequence is preempted: its blocks are freed and it goes back to the front of
   the queue, to be recomputed from its prompt and the tokens it already made (so the pool never
   overflows, nothing deadlocks and every request finishes, as long as one sequence fits);
2. waiting sequences are admitted in order with their prompt (or what is left of it: chunked
   prefill) while the step's token budget `max_step_tokens` and the free blocks allow.
All of it runs as one forward (`paged_step`), the tokens of all sequences flattened into one row.
A sequence samples a token when its whole prompt has been seen, and leaves, freeing its blocks,
at a stop token or after max_tokens.

When every running sequence decodes from a captured step and none waits (batch-1 chat, an
offline batch once admitted), steps are pipelined: each is queued on the GPU with the tokens
drawn by the one before it as its input, before the host has read those tokens, so the host's
bookkeeping runs while the GPU computes (`_decode_pipelined`). With `cuda_graphs`, decode
steps replay CUDA graphs captured per batch size, and (with `step_graphs`) steps that mix
prefill chunks and decodes replay graphs captured per (tokens, sequences) bucket: an eager step
of a small model costs more host time than GPU time (memfit.inference.cuda_graphs).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from memfit.inference.paged import paged_step
from memfit.inference.paged_cache import PagedKVCache
from memfit.inference.sampling import Sampler, StopStringChecker
from memfit.inference.sampling_params import SamplingParams


@dataclass(frozen=True)
class Limits:
    """What a request must stay within to run on an engine: checked before it joins, so that no
    request can fail inside a step shared with others (a token id outside the vocabulary would
    stop the GPU for all of them). Plain numbers, so a server's HTTP process checks requests
    without the engine (which may live in another process)."""

    vocab_size: int
    max_context: int
    num_blocks: int
    block_size: int
    stop_strings: bool
    """Whether the engine can decode text (stop strings need it)."""

    def check(self, prompt: list[int], params: SamplingParams) -> None:
        if not prompt:
            raise ValueError("a prompt needs at least one token")
        vocab = self.vocab_size
        # (C-speed scans: a server checks every prompt of thousands of tokens in its event loop)
        if not (set(map(type, prompt)) == {int} and min(prompt) >= 0 and max(prompt) < vocab):
            bad = next(t for t in prompt if not (type(t) is int and 0 <= t < vocab))
            raise ValueError(
                f"prompt token {bad!r} is not a token id of this model (0..{vocab - 1})"
            )
        longest = len(prompt) + params.max_tokens
        capacity = self.num_blocks * self.block_size
        if longest > capacity:
            raise ValueError(
                f"prompt of {len(prompt)} tokens + max_tokens {params.max_tokens} = {longest} "
                f"tokens exceeds the KV pool's {capacity} ({self.num_blocks} blocks "
                f"of {self.block_size})"
            )
        if longest > self.max_context:
            raise ValueError(
                f"prompt of {len(prompt)} tokens + max_tokens {params.max_tokens} = {longest} "
                f"tokens exceeds the engine's max_seq_len of {self.max_context}"
            )
        if params.stop and not self.stop_strings:
            raise ValueError("stop strings need a tokenizer: this engine was given no decode")


@dataclass(eq=False)  # compared by identity: the scheduler looks requests up in lists
class Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    computed: int = 0
    """Tokens of prompt + output whose keys and values are in the cache."""
    finished: bool = False
    finish_reason: str = ""
    """"stop" (a stop token or string) or "length" (max_tokens), once finished."""
    logprobs: list[float] | None = None
    """With params.logprobs: the log-probability of each output token under the model."""
    text: str | None = None
    """With stop strings: the output's text, cut before the stop string."""
    stop_checker: StopStringChecker | None = None
    preemptions: int = 0
    leader: Request | None = None
    """Another sample of the same prompt (parallel sampling): with prefix caching this one
    starts after the leader's prompt is computed, on its cached blocks."""
    prompt_keys: list[int] | None = None
    """With prefix caching: the keys of the prompt's full blocks (computed once)."""
    drawn: tuple[int, int] | None = None
    """(step, row): its next token was drawn on the device in that step and the host has not
    read it yet (an asynchronous step, `Engine._step_async`)."""

    @property
    def num_tokens(self) -> int:
        """Its tokens, a drawn one not yet read included."""
        return len(self.prompt) + len(self.output) + (self.drawn is not None)

    def pending(self, limit: int) -> list[int]:
        """Up to `limit` of the tokens not yet in the cache (without copying the whole
        sequence: a decode is the last output token)."""
        start, prompt = self.computed, len(self.prompt)
        if start >= prompt:
            known = self.output[start - prompt : start - prompt + limit]
        else:
            head = self.prompt[start : start + limit]
            rest = limit - len(head)
            known = head + self.output[:rest] if rest > 0 else head
        if self.drawn is not None and len(known) < limit:
            return [*known, DRAWN]  # (the last: the token drawn on the device)
        return known


DRAWN = -1
"""In `Request.pending`: the token drawn on the device and not yet read by the host."""


class Engine:
    def __init__(
        self,
        model: torch.nn.Module,
        cache: PagedKVCache,
        *,
        max_step_tokens: int = 2048,
        max_running: int = 256,
        max_seq_len: int | None = None,
        cuda_graphs: bool = False,
        step_graphs: bool = True,
        decode: Callable[[list[int]], str] | None = None,
        seed: int | None = None,
        prefix_caching: bool = False,
    ) -> None:
        if max_step_tokens < 1 or max_running < 1:
            raise ValueError(
                f"max_step_tokens and max_running must be >= 1, got {max_step_tokens}, {max_running}"
            )
        self.model, self.cache = model, cache
        cache.prefix_caching = prefix_caching
        self.max_step_tokens, self.max_running = max_step_tokens, max_running
        self.requests: dict[int, Request] = {}
        """Every request added and not forgotten, by id (the order they came in)."""
        self._next_id = 0
        self.pipeline_steps = 32
        """The most decode steps one `step()` may pipeline."""
        self.async_steps = True
        """Queue a step of the captured step graphs before reading the tokens of the one before
        it, when every request decodes greedily (`_step_async`)."""
        self._in_flight: tuple | None = None  # (step, sampling rows, wait for tokens, start)
        self._not_plain = 0  # unfinished requests that need the sampler
        self.on_step: Callable[[], bool] | None = None
        """Called after each step's tokens are accepted, pipelined ones included (a server
        streams them from here); returning True ends a pipelined run early (requests arrived)."""
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.steps = self.preemptions = 0
        self.peak_blocks = 0
        self.waste_samples: list[float] = []
        self.decode_steps, self.decode_seconds = 0, 0.0
        capacity = cache.pool.num_blocks * cache.block_size
        model_context = getattr(model.config, "max_seq_len", None) or capacity
        self.max_context = min(max_seq_len or 2 * model_context, capacity)
        """The longest sequence (prompt + new tokens) a request may reach."""
        self.decode = decode
        self.sampler = Sampler(model.config.vocab_size, device=cache.device, seed=seed)
        self.graphs = self.step_graphs = None
        if cuda_graphs:
            if cache.device.type != "cuda":
                raise ValueError("cuda_graphs needs the cache on a CUDA device")
            from memfit.inference.cuda_graphs import DecodeGraphs, StepGraphs

            pool = None
            if step_graphs:
                self.step_graphs = StepGraphs(
                    model, cache, max_tokens=max_step_tokens, max_seqs=max_running,
                    max_seq_len=self.max_context,
                )  # fmt: skip
                self.step_graphs.capture()
                pool = self.step_graphs.pool
            self.graphs = DecodeGraphs(
                model, cache, max_batch=max_running, max_seq_len=self.max_context
            )
            self.graphs.pool = pool
            self.graphs.capture()
            torch.cuda.empty_cache()  # (what the eager warm-ups left in the allocator)

    def add(
        self, prompt: list[int], params: SamplingParams | None = None, *, follows: int | None = None
    ) -> int:
        """Queue a request; returns its id. A prompt that could never fit says so now.
        `follows`: the id of an earlier request with the same prompt (another sample of it):
        with prefix caching, this one shares the prompt's blocks with it."""
        params = params or SamplingParams()
        self.check(prompt, params)
        request = Request(id=self._next_id, prompt=list(prompt), params=params)
        request.leader = self.requests.get(follows) if follows is not None else None
        self._next_id += 1
        self.requests[request.id] = request
        self.waiting.append(request)
        self._not_plain += not _plain_greedy(params)
        return request.id

    @property
    def limits(self) -> Limits:
        return Limits(
            vocab_size=self.model.config.vocab_size, max_context=self.max_context,
            num_blocks=self.cache.pool.num_blocks, block_size=self.cache.block_size,
            stop_strings=self.decode is not None,
        )  # fmt: skip

    def check(self, prompt: list[int], params: SamplingParams) -> None:
        """ValueError, with the numbers, for a request this engine could never run (`Limits`)."""
        self.limits.check(prompt, params)

    # -- scheduling -----------------------------------------------------------------------------

    def _preempt_newest(self) -> Request:
        """Free the newest running sequence's blocks and put it back at the queue's front."""
        request = self.running.pop()
        self.cache.free(request.id)
        request.computed = 0
        request.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(request)
        return request

    def _schedule(self) -> list[tuple[Request, list[int]]]:
        """The step's (request, its new tokens) pairs: decodes first, then prefill chunks. Blocks
        are counted as they are promised, so the step's slots always exist."""
        batch: list[tuple[Request, list[int]]] = []
        budget, promised = self.max_step_tokens, 0

        def fits(request: Request, count: int) -> bool:
            needed = self.cache.blocks_needed(request.id, count)
            return needed <= self.cache.pool.num_free - promised

        index = 0
        while index < len(self.running):  # oldest first; preemption takes the newest, at the end
            request = self.running[index]
            if request.drawn is not None and len(request.output) + 1 >= request.params.max_tokens:
                index += 1  # its last token is drawn (an asynchronous step): it ends when read
                continue
            # a decode: its one token; a prefill in chunks: as much as the budget allows
            new = request.pending(max(budget, 1))
            while not fits(request, len(new)) and self.running[-1] is not request:
                self._preempt_newest()
            if not fits(request, len(new)):
                self._preempt_newest()  # the request itself, now the newest: it waits
                break
            promised += self.cache.blocks_needed(request.id, len(new))
            batch.append((request, new))
            budget -= len(new)
            index += 1
        in_flight = self._keys_in_flight() if self.cache.prefix_caching else set()
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            request = self.waiting[0]
            leader = request.leader
            if (
                leader is not None
                and self.cache.prefix_caching
                and not leader.finished
                and leader.computed < len(leader.prompt)
            ):
                break  # another sample of its prompt computes it first: then it is cached
            matched = self.cache.prefix_caching and request.id not in self.cache.tables
            if matched:  # start on the cached blocks of its prefix: only the rest is computed
                tokens = request.prompt + request.output
                request.computed = self.cache.match_prefix(request.id, tokens)
                keys = self._prompt_keys(request)
                next_block = request.computed // self.cache.block_size
                if next_block < len(keys) and keys[next_block] in in_flight:
                    # a running sequence computes that block now: found cached once it has
                    self.cache.free(request.id)
                    request.computed = 0
                    break
                in_flight.update(keys[next_block:])
            chunk = request.pending(budget)
            # (the cached blocks it took may have been counted free for what was promised)
            if self.cache.pool.num_free < promised or not fits(request, len(chunk)):
                if matched:  # a waiting request holds no blocks
                    self.cache.free(request.id)
                    request.computed = 0
                break  # wait for blocks to be freed
            self.waiting.popleft()
            self.running.append(request)
            promised += self.cache.blocks_needed(request.id, len(chunk))
            batch.append((request, chunk))
            budget -= len(chunk)
        return batch

    def _prompt_keys(self, request: Request) -> list[int]:
        if request.prompt_keys is None:
            request.prompt_keys = self.cache.block_keys(request.prompt)
        return request.prompt_keys

    def _keys_in_flight(self) -> set[int]:
        """The keys of the prompt blocks that running sequences have yet to compute or register:
        a request arriving behind the same prefix waits for them instead of computing them
        again beside them (requests sent together behind one system prompt compute it once)."""
        keys: set[int] = set()
        for request in self.running:
            registered = len(self.cache.hashes.get(request.id, ()))
            if registered < len(request.prompt) // self.cache.block_size:
                keys.update(self._prompt_keys(request)[registered:])
        return keys

    # -- running --------------------------------------------------------------------------------

    def step(self) -> None:
        """One scheduled forward and the sampling of the sequences whose prompt is done (or,
        when every running sequence decodes greedily, several pipelined ones; or a step queued
        before the tokens of the one before it are read, `_step_async`)."""
        asynchronous = self._async_ready()
        if self._in_flight is not None and (not asynchronous or self._can_pipeline()):
            self._accept_in_flight()  # (what follows is scheduled on every token known)
            return
        if self._in_flight is None and self._can_pipeline():
            self._decode_pipelined(self.pipeline_steps)
            return
        batch = self._schedule()
        if not batch and self._in_flight is not None:
            self._accept_in_flight()
            return
        if not batch:
            raise RuntimeError(
                "no request can be scheduled: the KV pool cannot hold even one sequence's next "
                "tokens (give the cache more blocks)"
            )
        start = time.perf_counter()
        # the rows whose prompt is complete after this step sample a token: prepared before
        # the forward, so their parameters travel to the device while it runs
        sampling = [
            (row, request)
            for row, (request, tokens) in enumerate(batch)
            if request.computed + len(tokens) == request.num_tokens
        ]
        # plain greedy rows (no penalty, no logprobs) need only an argmax, not the sampler
        plain = all(_plain_greedy(r.params) for _, r in sampling)
        prepared = (
            self.sampler.prepare([r for _, r in sampling]) if sampling and not plain else None
        )
        seq_ids = [r.id for r, _ in batch]
        decode = all(len(tokens) == 1 for _, tokens in batch)
        step_tokens = [t for _, t in batch]
        if asynchronous:
            self._step_async(batch, seq_ids, step_tokens, sampling, decode, start)
            return
        if decode and self.graphs is not None and self.graphs.bucket(len(batch)) is not None:
            logits = self.graphs.run(seq_ids, [tokens[0] for tokens in step_tokens])
        elif self.step_graphs is not None and self.step_graphs.bucket(
            sum(map(len, step_tokens)), len(batch)
        ):
            logits = self.step_graphs.run(seq_ids, step_tokens)
        else:
            logits = paged_step(self.model, self.cache, seq_ids, step_tokens)
        self._queued(batch)
        if sampling:
            rows = [row for row, _ in sampling]
            if len(rows) < len(batch):
                logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
            if plain:
                sampled, logprobs = logits.argmax(dim=-1).tolist(), None
            else:
                sampled, logprobs = self.sampler.sample(logits, prepared).to_lists()
            for i, (_, request) in enumerate(sampling):
                self._accept(request, sampled[i], logprobs[i] if logprobs is not None else None)
        if decode:
            self.decode_steps += 1
            self.decode_seconds += time.perf_counter() - start
        self._stepped()

    def _queued(self, batch) -> None:
        """A step's forward is queued: count it, and its tokens are in the cache."""
        self.steps += 1
        used = self.cache.pool.num_blocks - self.cache.pool.num_free
        self.peak_blocks = max(self.peak_blocks, used)
        self.waste_samples.append(self.cache.waste())
        for request, tokens in batch:
            request.computed += len(tokens)
        self._register_blocks([request for request, _ in batch])

    # -- asynchronous steps ---------------------------------------------------------------------

    def _async_ready(self) -> bool:
        """Whether the next step may be queued before the last one's tokens are read: captured
        step graphs, every unfinished request greedy without logprobs or penalties (the
        step's argmax is the token), and blocks for every running sequence's next token and a
        full step's prefill beside them (no preemption while a token is unread)."""
        if not self.async_steps or self.step_graphs is None or self._not_plain:
            return False
        cache = self.cache
        slack = -(-self.max_step_tokens // cache.block_size) + len(self.running) + 1
        return cache.pool.num_free >= slack

    def _step_async(self, batch, seq_ids, step_tokens, sampling, decode: bool, start) -> None:
        """Queue this step with the tokens drawn by the one before it read on the device, then
        read and accept that one's tokens while this one runs (vLLM's asynchronous
        scheduling, for mixed steps: the host's scheduling and bookkeeping of a step overlap
        the GPU's work on the next). A request that the tokens read finish was queued in this
        step too: its row is discarded when this step's tokens are read."""
        drawn = [r.drawn[1] if tokens[-1] == DRAWN else -1 for r, tokens in batch]
        self.step_graphs.run(seq_ids, step_tokens, drawn)
        wait = self.step_graphs.send_sampled(len(batch))
        self._queued(batch)  # (registers the blocks of the tokens known)
        step = self.steps
        for row, request in sampling:
            request.drawn = (step, row)
        previous, self._in_flight = self._in_flight, (step, sampling, wait, start, decode)
        if previous is not None:
            self._accept_in_flight(previous)

    def _accept_in_flight(self, in_flight=None) -> None:
        """Read and accept the tokens of an asynchronous step (default: the one in flight, which
        then is none)."""
        if in_flight is None:
            in_flight, self._in_flight = self._in_flight, None
        step, rows, wait, start, decode = in_flight
        tokens = wait()
        accepted = []
        for row, request in rows:
            if request.drawn is not None and request.drawn[0] == step:
                request.drawn = None  # (not drawn again since: its token is the host's now)
            if not request.finished:
                self._accept(request, tokens[row], None)
                accepted.append(request)
        self._register_blocks(accepted)
        if decode:
            self.decode_steps += 1
            self.decode_seconds += time.perf_counter() - start
        self._stepped()

    # -- pipelined greedy decoding --------------------------------------------------------------

    def _can_pipeline(self) -> bool:
        """Every running sequence decodes from a captured step, none waits, and the pool has a
        slot for each: the steps can be queued back to back."""
        running = self.running
        return (
            self.graphs is not None
            and not self.waiting
            and bool(running)
            and self.graphs.bucket(len(running)) is not None
            and all(r.computed == r.num_tokens - 1 for r in running)
            and self._fits_one_more(running)
        )

    def _fits_one_more(self, requests: list[Request]) -> bool:
        needed = sum(self.cache.blocks_needed(r.id, 1) for r in requests)
        return needed <= self.cache.pool.num_free

    def _decode_pipelined(self, max_steps: int = 32) -> None:
        """Up to `max_steps` decode steps of the running sequences, each queued on the GPU
        before the host has read the tokens of the one before it: the tokens drawn on the device
        (argmax, or the sampler's) stay there as the next step's input, and the host stages,
        checks stops and frees blocks while the GPU runs (vLLM's async scheduling), instead of
        the GPU waiting for the host between steps. Ends after `max_steps` (the caller reports
        progress) or when a sequence finishes: its next step, already queued, is then discarded
        (a stop token cannot be known in advance; a finish by length is, and stops the pipeline
        before it)."""
        requests, graphs = list(self.running), self.graphs
        ids = [r.id for r in requests]
        plain = all(_plain_greedy(r.params) for r in requests)
        start = time.perf_counter()
        graphs.run(ids, [r.pending(1)[0] for r in requests], greedy=plain)
        tokens_of = self._draw(requests, plain, ahead=0)
        for r in requests:
            r.computed += 1
        interrupted = False
        for count in range(1, max_steps + 1):
            queue_next = (
                count < max_steps
                and not interrupted
                and all(len(r.output) + 1 < r.params.max_tokens for r in requests)
                and self._fits_one_more(requests)
            )
            if queue_next:
                graphs.run(ids, None, greedy=plain)  # its tokens: those drawn on the GPU
                # drawn for outputs one token longer than the host has seen so far
                next_tokens_of = self._draw(requests, plain, ahead=1)
            start = self._accept_decode_step(requests, *tokens_of(), start)
            interrupted = self._stepped()
            if not queue_next:
                return
            for r in requests:
                r.computed += 1  # the queued step writes the token just accepted
            tokens_of = next_tokens_of
            if any(r.finished for r in requests):
                self._accept_decode_step(requests, *tokens_of(), start)
                self._stepped()
                return

    def _draw(self, requests: list[Request], plain: bool, ahead: int):
        """The tokens of the step just queued, drawn on the device where the next step reads
        them; returns the function that waits for their copy to the host."""
        if plain:
            return self.graphs.greedy()
        prepared = self.sampler.prepare(requests, ahead=ahead)
        drawn = self.sampler.sample(self.graphs.last_logits, prepared)
        return self.graphs.feed(drawn.token_ids, drawn.logprobs)

    def _accept_decode_step(self, requests, tokens, logprobs, start: float) -> float:
        """A pipelined step's tokens, for the sequences still running; the step's statistics.
        Returns the time it ended."""
        for row, (request, token) in enumerate(zip(requests, tokens, strict=True)):
            if not request.finished:
                self._accept(request, token, logprobs[row] if logprobs is not None else None)
        self._register_blocks([r for r in requests if not r.finished])
        self.steps += 1
        self.decode_steps += 1
        self.peak_blocks = max(
            self.peak_blocks, self.cache.pool.num_blocks - self.cache.pool.num_free
        )
        self.waste_samples.append(self.cache.waste())
        end = time.perf_counter()
        self.decode_seconds += end - start
        return end

    def _stepped(self) -> bool:
        return self.on_step is not None and bool(self.on_step())

    def _register_blocks(self, requests: list[Request]) -> None:
        """With prefix caching: the blocks the step filled, registered under their tokens."""
        cache = self.cache
        if not cache.prefix_caching:
            return
        for request in requests:
            if not request.finished and cache.unregistered(request.id, request.computed):
                cache.register(request.id, (request.prompt + request.output)[: request.computed])

    def _accept(self, request: Request, token: int, logprob: float | None) -> None:
        """A sampled token: appended, or the end of the request (a stop token, a stop string,
        max_tokens), whose blocks and sampler state are then freed."""
        params = request.params
        stop = token in params.stop_token_ids
        if not stop:
            request.output.append(token)
            if params.logprobs:
                request.logprobs = (request.logprobs or []) + [logprob]
            if params.stop and self.decode is not None:
                if request.stop_checker is None:
                    request.stop_checker = StopStringChecker(
                        params.stop, self.decode, context=request.prompt[-4:]
                    )
                stop = request.stop_checker.append([token])
        if stop or len(request.output) >= params.max_tokens:
            request.finished = True
            request.finish_reason = "stop" if stop else "length"
            if request.stop_checker is not None:
                request.text = request.stop_checker.finish()
            self.cache.free(request.id)
            self.sampler.release(request.id)
            self.running.remove(request)
            self._not_plain -= not _plain_greedy(params)

    def reset_counters(self) -> None:
        """Forget finished requests and zero the statistics (the engine must be idle)."""
        if self.waiting or self.running:
            raise RuntimeError("reset_counters needs an idle engine")
        self.requests.clear()
        self._next_id = 0
        self.steps = self.preemptions = self.decode_steps = self.peak_blocks = 0
        self.decode_seconds = 0.0
        self.waste_samples.clear()
        self._in_flight = None  # (a step whose requests had all finished: nothing to read)

    def run(self) -> list[list[int]]:
        """Step until every request has finished; each request's new tokens, by id."""
        while self.waiting or self.running:
            self.step()
        if self._in_flight is not None:  # (a step of requests that its predecessor finished)
            self._accept_in_flight()
        return [r.output for r in self.requests.values()]

    def abort(self, request_id: int) -> None:
        """Stop a request wherever it is (a client went away): its blocks are freed at once and
        it finishes with finish_reason "abort". A finished or unknown id: nothing happens."""
        request = self.requests.get(request_id)
        if request is None or request.finished:
            return
        if request in self.waiting:
            self.waiting.remove(request)
        else:
            self.running.remove(request)
        self.cache.free(request.id)
        self.sampler.release(request.id)
        request.finished, request.finish_reason = True, "abort"
        self._not_plain -= not _plain_greedy(request.params)

    def forget(self, request_id: int) -> None:
        """Drop a finished request (a server, once it has answered: requests do not pile up)."""
        request = self.requests.get(request_id)
        if request is not None and request.finished:
            del self.requests[request_id]


def _plain_greedy(params: SamplingParams) -> bool:
    return params.greedy and params.repetition_penalty == 1.0 and not params.logprobs
