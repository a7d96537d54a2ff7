"""Inference: a static KV cache and `generate` (one batch of aligned prompts), a paged KV cache
and `generate_paged` (prompts of any lengths in one batch, blocks taken as sequences grow)."""

from memfit.inference.generate import Generation, generate, sample
from memfit.inference.kv_cache import KVCache
from memfit.inference.paged import generate_paged, paged_step
from memfit.inference.paged_cache import BlockPool, OutOfBlocks, PagedKVCache

__all__ = [
    "BlockPool",
    "Generation",
    "KVCache",
    "OutOfBlocks",
    "PagedKVCache",
    "generate",
    "generate_paged",
    "paged_step",
    "sample",
]
