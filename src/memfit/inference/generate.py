"""Autoregressive generation with a contiguous KV cache: one prefill of the prompt, then one
decode step per new token that reads the cache instead of recomputing the prefix.

Sampling: temperature 0 is greedy (argmax); otherwise logits / temperature, optionally keep the
top-k, then optionally the smallest set whose probability mass reaches top_p (nucleus sampling,
Holtzman et al. 2020), renormalize and draw.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from memfit.inference.kv_cache import KVCache
from memfit.models.llama import Llama


def sample(
    logits: Tensor, *, temperature: float, top_k: int = 0, top_p: float = 1.0, generator=None
) -> Tensor:
    """logits (batch, vocab) -> token ids (batch,)."""
    if temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
        raise ValueError(
            f"need temperature >= 0, top_k >= 0 and 0 < top_p <= 1; got {temperature}, {top_k}, {top_p}"
        )
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        drop = probs.cumsum(dim=-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@dataclass
class Generation:
    tokens: list[list[int]]  # new tokens per batch row
    prefill_s: float
    decode_s: float

    @property
    def decode_tokens_per_s(self) -> float:
        steps = max(len(t) for t in self.tokens) - 1 if self.tokens else 0
        return steps * len(self.tokens) / self.decode_s if self.decode_s > 0 else 0.0


@torch.inference_mode()
def generate(
    model: Llama,
    prompt: Tensor,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_id: int | None = None,
    seed: int | None = None,
) -> Generation:
    """Continue `prompt` (batch, prompt_len) of token ids. Rows stop at `eos_id` (not returned)."""
    if prompt.ndim != 2 or prompt.shape[1] == 0:
        raise ValueError(
            f"prompt must be (batch, prompt_len >= 1) token ids, got shape {tuple(prompt.shape)}"
        )
    device = prompt.device
    batch, prompt_len = prompt.shape
    total = prompt_len + max_new_tokens
    if total > 2 * model.config.max_seq_len:
        raise ValueError(
            f"prompt {prompt_len} + {max_new_tokens} new tokens exceeds 2x max_seq_len {model.config.max_seq_len}"
        )
    dtype = next(model.parameters()).dtype
    cache = KVCache(model.config, batch_size=batch, max_seq_len=total, dtype=dtype, device=device)
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    start = time.perf_counter()
    logits = model(prompt, kv_cache=cache, start_pos=0)[:, -1]
    token = sample(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
    sync()
    prefill_s = time.perf_counter() - start

    out = [[] for _ in range(batch)]
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    start = time.perf_counter()
    for position in range(prompt_len, total):
        for row, (t, finished) in enumerate(zip(token.tolist(), done.tolist(), strict=True)):
            if not finished and t != eos_id:
                out[row].append(t)
        if eos_id is not None:
            done |= token == eos_id
        if bool(done.all()) or position == total - 1:
            break
        logits = model(token[:, None], kv_cache=cache, start_pos=position)[:, -1]
        token = sample(
            logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator
        )
    sync()
    return Generation(tokens=out, prefill_s=prefill_s, decode_s=time.perf_counter() - start)
