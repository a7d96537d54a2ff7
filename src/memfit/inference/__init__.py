"""Inference: a static KV cache and `generate` (one batch of aligned prompts), a paged KV cache
and `generate_paged` (prompts of any lengths in one batch, blocks taken as sequences grow), and
the `Engine`: continuous batching with chunked prefill and preemption over the paged cache."""

from memfit.inference.engine import Engine, Request
from memfit.inference.generate import Generation, generate, sample
from memfit.inference.kv_cache import KVCache
from memfit.inference.paged import generate_paged, paged_step
from memfit.inference.paged_cache import BlockPool, OutOfBlocks, PagedKVCache
from memfit.inference.sampling_params import SamplingParams

__all__ = [
    "BlockPool",
    "Engine",
    "Generation",
    "KVCache",
    "OutOfBlocks",
    "PagedKVCache",
    "Request",
    "SamplingParams",
    "generate",
    "generate_paged",
    "paged_step",
    "sample",
]
