"""Batched generation over a paged KV cache: prompts of different lengths prefilled in one step
(their tokens flattened into one row), then one decode token per running sequence per step; a
sequence leaves the batch, and gives its blocks back, as soon as it stops. The continuous-batching
scheduler (requests joining between steps, chunked prefill, preemption when blocks run out)
builds on this step."""

from __future__ import annotations

import torch
from torch import Tensor

from memfit.inference.generate import sample
from memfit.inference.paged_cache import PagedKVCache
from memfit.inference.sampling_params import SamplingParams


@torch.inference_mode()
def paged_step(
    model: torch.nn.Module, cache: PagedKVCache, seq_ids: list[int], tokens: list[list[int]]
) -> Tensor:
    """Run `tokens[i]` (new token ids of sequence seq_ids[i]) through the model in one step,
    writing their keys and values to the cache; returns the logits of each sequence's last new
    token, (len(seq_ids), vocab)."""
    metadata = cache.step_metadata(seq_ids, [len(t) for t in tokens])
    flat = torch.tensor([t for row in tokens for t in row], device=cache.device)[None]  # (1, T)
    ends = torch.tensor([len(t) for t in tokens]).cumsum(0) - 1
    logits = model(flat, metadata=metadata, kv_cache=cache, logits_at=ends.to(cache.device))
    return logits[0]  # (sequences, vocab)


@torch.inference_mode()
def generate_paged(
    model: torch.nn.Module, prompts: list[list[int]], cache: PagedKVCache, params: SamplingParams
) -> list[list[int]]:
    """Continue every prompt (lists of token ids, any lengths) under `params` (one generator
    seeded with params.seed for the batch); rows stop at a stop token (not returned) or after
    max_tokens. The cache must hold every sequence at its longest (OutOfBlocks otherwise:
    preemption is the Engine's); it must hold no sequence when called (the prompts are sequences
    0 .. len(prompts) - 1) and holds none afterwards."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate_paged needs at least one prompt, each of >= 1 token")
    if cache.tables:
        raise ValueError(f"the cache already holds sequences {sorted(cache.tables)}: free them")
    generator = None
    if params.seed is not None:
        generator = torch.Generator(device=cache.device).manual_seed(params.seed)
    seq_ids = list(range(len(prompts)))
    out: list[list[int]] = [[] for _ in prompts]
    step_tokens = [list(p) for p in prompts]
    try:
        while seq_ids:
            logits = paged_step(model, cache, seq_ids, step_tokens)
            chosen = sample(
                logits,
                temperature=params.temperature,
                top_k=params.top_k,
                top_p=params.top_p,
                generator=generator,
            ).tolist()  # the one read per step: who stops, what comes next
            running, step_tokens = [], []
            for seq_id, token in zip(seq_ids, chosen, strict=True):
                stop = token in params.stop_token_ids
                if not stop:
                    out[seq_id].append(token)
                if stop or len(out[seq_id]) >= params.max_tokens:
                    cache.free(seq_id)
                else:
                    running.append(seq_id)
                    step_tokens.append([token])
            seq_ids = running
    finally:
        for seq_id in list(cache.tables):
            cache.free(seq_id)
    return out
