"""A plain contiguous KV cache: one preallocated (batch, max_seq_len, kv_heads, head_dim) buffer
per layer for keys and one for values (gpt-fast style: static shapes, no reallocation while
decoding). The paged cache with continuous batching replaces it for serving."""

from __future__ import annotations

import torch
from torch import Tensor

from memfit.models.config import ModelConfig


class KVCache:
    def __init__(
        self,
        config: ModelConfig,
        *,
        batch_size: int,
        max_seq_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (config.num_layers, batch_size, max_seq_len, config.num_kv_heads, config.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.max_seq_len = max_seq_len

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def update(self, layer: int, start_pos: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k, v (batch, seqlen, kv_heads, head_dim) at positions start_pos.. and return the
        keys and values of positions 0 .. start_pos + seqlen."""
        end = start_pos + k.shape[1]
        if end > self.max_seq_len:
            raise ValueError(
                f"KV cache holds {self.max_seq_len} positions; asked to write up to {end}"
            )
        self.keys[layer, :, start_pos:end] = k
        self.values[layer, :, start_pos:end] = v
        return self.keys[layer, :, :end], self.values[layer, :, :end]
