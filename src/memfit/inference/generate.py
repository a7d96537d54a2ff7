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
    decode_steps: int = 0
    """Decode steps run (each one token for every row; the prefill made the first token)."""

    @property
    def decode_tokens_per_s(self) -> float:
        tokens = self.decode_steps * len(self.tokens)
        return tokens / self.decode_s if self.decode_s > 0 and tokens > 0 else 0.0


# decode steps between host checks of whether every row has stopped (the loop itself never syncs)
EOS_CHECK_EVERY = 16


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
    """Continue `prompt` (batch, prompt_len) of token ids. Rows stop at `eos_id` (not returned).

    The prefill writes the prompt's keys and values into a static cache and computes the logits
    of its last position only; each decode step then runs one token per row at a position held in
    a device tensor, with the same shapes every step. New tokens stay on the device: the host
    reads them once at the end, and checks whether every row has stopped every
    `EOS_CHECK_EVERY` steps."""
    if prompt.ndim != 2 or prompt.shape[1] == 0:
        raise ValueError(
            f"prompt must be (batch, prompt_len >= 1) token ids, got shape {tuple(prompt.shape)}"
        )
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
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

    def pick(logits: Tensor) -> Tensor:
        return sample(
            logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator
        )

    start = time.perf_counter()
    logits = model(prompt, kv_cache=cache, last_only=True)[:, -1]  # (B, vocab)
    token = pick(logits)
    sync()
    prefill_s = time.perf_counter() - start

    new = torch.empty(batch, max_new_tokens, dtype=torch.long, device=device)
    new[:, 0] = token
    done = token == eos_id if eos_id is not None else None
    positions = torch.full((1,), prompt_len, dtype=torch.long, device=device)
    steps = 1
    start = time.perf_counter()
    while steps < max_new_tokens:
        if done is not None and steps % EOS_CHECK_EVERY == 0 and bool(done.all()):
            break
        metadata = cache.metadata(positions)
        logits = model(token[:, None], metadata=metadata, kv_cache=cache)[:, -1]
        token = pick(logits)
        new[:, steps] = token
        if done is not None:
            done |= token == eos_id
        positions += 1
        steps += 1
    out = new[:, :steps].tolist()  # the one read of the tokens
    sync()
    decode_s = time.perf_counter() - start
    if eos_id is not None:
        out = [row[: row.index(eos_id)] if eos_id in row else row for row in out]
    return Generation(tokens=out, prefill_s=prefill_s, decode_s=decode_s, decode_steps=steps - 1)
