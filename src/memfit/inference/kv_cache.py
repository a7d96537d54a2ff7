"""A static KV cache: one preallocated (batch, max_seq_len, kv_heads, head_dim) buffer per layer
for keys and one for values, slot p holding position p (gpt-fast's pattern). Writes go to the
positions of `AttentionMetadata.positions` (a tensor: no host sync) and attention reads the whole
buffer under a mask of the valid slots, so every decode step has the same shapes and can be
compiled or captured in a CUDA graph. The paged cache with continuous batching replaces it for
serving (blocks found through a block table instead of one slot per position)."""

from __future__ import annotations

import torch
from torch import Tensor

from memfit.models.config import ModelConfig
from memfit.nn.attention import AttentionMetadata


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
        self.window = config.attention_window

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def metadata(self, positions: Tensor) -> AttentionMetadata:
        """Queries at `positions` (seqlen,) reading this cache: the mask of the slots each may
        see (causal, within the sliding window)."""
        return AttentionMetadata.cached(positions, self.max_seq_len, self.window)

    def update(
        self, layer: int, metadata: AttentionMetadata, k: Tensor, v: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Write k, v (batch, seqlen, kv_heads, head_dim) into the slots of `metadata.positions`
        (seqlen,) and return layer `layer`'s whole key and value buffers (batch, max_seq_len,
        kv_heads, head_dim)."""
        keys, values, positions = self.keys[layer], self.values[layer], metadata.positions
        keys.index_copy_(1, positions, k.to(keys.dtype))
        values.index_copy_(1, positions, v.to(values.dtype))
        return keys, values
