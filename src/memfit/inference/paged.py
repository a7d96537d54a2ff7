"""One step over a paged KV cache: any mix of prefill and decode tokens of several sequences,
flattened into one row, in one forward (`paged_step`, what the Engine runs each step), and
`generate_paged`, a batch of prompts through the Engine in one call."""

from __future__ import annotations

import torch
from torch import Tensor

from memfit.inference.paged_cache import PagedKVCache
from memfit.inference.sampling_params import SamplingParams
from memfit.ops._triton import programmatic_launch


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
    with programmatic_launch():  # the weights stay constant during the step
        logits = model(flat, metadata=metadata, kv_cache=cache, logits_at=ends.to(cache.device))
    return logits[0]  # (sequences, vocab)


def generate_paged(
    model: torch.nn.Module, prompts: list[list[int]], cache: PagedKVCache, params: SamplingParams
) -> list[list[int]]:
    """Continue every prompt (lists of token ids, any lengths) under `params`, all in one
    batch: the `Engine` with every prompt admitted at once (a request's generator is seeded with
    params.seed). Rows stop at a stop token (not returned) or after max_tokens. The cache must
    hold no sequence when called and holds none afterwards."""
    from memfit.inference.engine import Engine

    if not prompts:
        raise ValueError("generate_paged needs at least one prompt")
    if cache.tables:
        raise ValueError(f"the cache already holds sequences {sorted(cache.tables)}: free them")
    engine = Engine(model, cache, max_step_tokens=sum(len(p) for p in prompts))
    for prompt in prompts:
        engine.add(prompt, params)
    return engine.run()
