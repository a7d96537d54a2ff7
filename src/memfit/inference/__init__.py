"""Inference: the offline `LLM` API over the `Engine` (continuous batching with chunked prefill,
preemption and batched GPU sampling over a paged KV cache, decode steps replayed from CUDA
graphs), and the static-cache `generate` (one batch of aligned prompts)."""

from memfit.inference.engine import Engine, Request
from memfit.inference.generate import Generation, generate, sample
from memfit.inference.kv_cache import KVCache
from memfit.inference.llm import LLM, RequestOutput
from memfit.inference.paged import generate_paged, paged_step
from memfit.inference.paged_cache import BlockPool, OutOfBlocks, PagedKVCache
from memfit.inference.sampling import Sampler
from memfit.inference.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "BlockPool",
    "Engine",
    "Generation",
    "KVCache",
    "OutOfBlocks",
    "PagedKVCache",
    "Request",
    "RequestOutput",
    "Sampler",
    "SamplingParams",
    "generate",
    "generate_paged",
    "paged_step",
    "sample",
]
