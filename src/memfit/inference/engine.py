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
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from memfit.inference.generate import sample
from memfit.inference.paged import paged_step
from memfit.inference.paged_cache import PagedKVCache
from memfit.inference.sampling_params import SamplingParams


@dataclass
class Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    computed: int = 0
    """Tokens of prompt + output whose keys and values are in the cache."""
    finished: bool = False
    preemptions: int = 0
    generator: torch.Generator | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


class Engine:
    def __init__(
        self,
        model: torch.nn.Module,
        cache: PagedKVCache,
        *,
        max_step_tokens: int = 2048,
        max_running: int = 256,
    ) -> None:
        if max_step_tokens < 1 or max_running < 1:
            raise ValueError(
                f"max_step_tokens and max_running must be >= 1, got {max_step_tokens}, {max_running}"
            )
        self.model, self.cache = model, cache
        self.max_step_tokens, self.max_running = max_step_tokens, max_running
        self.requests: list[Request] = []
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.steps = self.preemptions = 0
        self.peak_blocks = 0
        self.max_context = getattr(model.config, "max_seq_len", None)

    def add(self, prompt: list[int], params: SamplingParams | None = None) -> int:
        """Queue a request; returns its id. A prompt that could never fit says so now."""
        params = params or SamplingParams()
        if not prompt:
            raise ValueError("a prompt needs at least one token")
        longest = len(prompt) + params.max_tokens
        capacity = self.cache.pool.num_blocks * self.cache.block_size
        if longest > capacity:
            raise ValueError(
                f"prompt of {len(prompt)} tokens + max_tokens {params.max_tokens} = {longest} "
                f"tokens exceeds the KV pool's {capacity} ({self.cache.pool.num_blocks} blocks "
                f"of {self.cache.block_size})"
            )
        if self.max_context is not None and longest > 2 * self.max_context:
            raise ValueError(
                f"prompt of {len(prompt)} tokens + max_tokens {params.max_tokens} exceeds twice "
                f"the model's context of {self.max_context}"
            )
        request = Request(id=len(self.requests), prompt=list(prompt), params=params)
        if params.seed is not None:
            request.generator = torch.Generator(device=self.cache.device).manual_seed(params.seed)
        self.requests.append(request)
        self.waiting.append(request)
        return request.id

    # -- scheduling -----------------------------------------------------------------------------

    def _preempt(self, request: Request) -> None:
        self.cache.free(request.id)
        request.computed = 0
        request.preemptions += 1
        self.preemptions += 1
        self.running.remove(request)
        self.waiting.appendleft(request)

    def _schedule(self) -> list[tuple[Request, list[int]]]:
        """The step's (request, its new tokens) pairs: decodes first, then prefill chunks. Blocks
        are counted as they are promised, so the step's slots always exist."""
        batch: list[tuple[Request, list[int]]] = []
        budget, promised = self.max_step_tokens, 0

        def fits(request: Request, count: int) -> bool:
            needed = self.cache.blocks_needed(request.id, count)
            return needed <= self.cache.pool.num_free - promised

        for request in list(self.running):  # oldest first: the newest is preempted first
            if request not in self.running:
                continue
            # a decode: its one token; a prefill in chunks: as much as the budget allows
            new = request.tokens[request.computed :][: max(budget, 1)]
            while not fits(request, len(new)):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is request:
                    break
            if request in self.running:
                promised += self.cache.blocks_needed(request.id, len(new))
                batch.append((request, new))
                budget -= len(new)
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            request = self.waiting[0]
            chunk = request.tokens[request.computed :][:budget]
            if not fits(request, len(chunk)):
                break  # wait for blocks to be freed
            self.waiting.popleft()
            self.running.append(request)
            promised += self.cache.blocks_needed(request.id, len(chunk))
            batch.append((request, chunk))
            budget -= len(chunk)
        return batch

    # -- running --------------------------------------------------------------------------------

    def step(self) -> None:
        """One scheduled forward and the sampling of the sequences whose prompt is done."""
        batch = self._schedule()
        if not batch:
            raise RuntimeError(
                "no request can be scheduled: the KV pool cannot hold even one sequence's next "
                "tokens (give the cache more blocks)"
            )
        logits = paged_step(self.model, self.cache, [r.id for r, _ in batch], [t for _, t in batch])
        self.steps += 1
        used = self.cache.pool.num_blocks - self.cache.pool.num_free
        self.peak_blocks = max(self.peak_blocks, used)
        # the greedy rows' tokens in one argmax and one read; sampled rows draw with their own
        # parameters and generator
        greedy = logits.argmax(dim=-1).tolist()
        for row, (request, tokens) in enumerate(batch):
            request.computed += len(tokens)
            if request.computed < len(request.tokens):
                continue  # a prefill chunk: the prompt is not done yet
            params = request.params
            token = greedy[row]
            if params.temperature > 0:
                token = int(
                    sample(
                        logits[row : row + 1],
                        temperature=params.temperature,
                        top_k=params.top_k,
                        top_p=params.top_p,
                        generator=request.generator,
                    )
                )
            stop = token in params.stop_token_ids
            if not stop:
                request.output.append(token)
            if stop or len(request.output) >= params.max_tokens:
                request.finished = True
                self.cache.free(request.id)
                self.running.remove(request)

    def run(self) -> list[list[int]]:
        """Step until every request has finished; each request's new tokens, by id."""
        while self.waiting or self.running:
            self.step()
        return [r.output for r in self.requests]
