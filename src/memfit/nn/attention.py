"""Grouped-query self-attention with rotary positions, its backend chosen by name and fed an
`AttentionMetadata`, so that new kernels (paged decode, block-sparse) plug in without touching
models.

    x -> qkv -> q, k, v -> RoPE(q, k) at metadata.positions -> [cache write] -> attention -> out

Training runs with the metadata of whole causal sequences (positions 0..T-1, no mask): the
backend takes its mask-free causal path. Inference with a static KV cache (memfit.inference)
writes k and v at `positions` into preallocated buffers and attends over the whole buffer under
`key_mask` (the keys at positions <= the query's, within the sliding window): shapes do not
change from one decode step to the next, so a step can be compiled or captured in a CUDA graph
(gpt-fast's pattern). A prefill from position 0 attends over its own tokens with the plain causal
path and only writes the cache. A paged cache (memfit.inference.PagedKVCache) takes the qkv
projection whole: one kernel rotates q and k and writes k and v into their blocks
(`PagedKVCache.write_qkv`), and the paged kernels attend over the blocks.

Tensor parallelism (later): q, k and v come from one fused projection `qkv` (rows q | k | v).
Each shard must hold whole heads of each; the fused weight is then interleaved per shard (shard i
holds [q_i | k_i | v_i], heads_q / tp query heads and heads_kv / tp key/value heads), a
permutation the state-dict adapter applies on load, so the forward below runs unchanged on a
shard with its own head counts. Interleaving keeps one matrix product per layer; unfusing would
cost two more launches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch import Tensor

from memfit import functional as MF
from memfit.nn.linear import Linear


@dataclass
class AttentionMetadata:
    """What every attention layer of one forward needs to know about the tokens it sees.

    positions: (seqlen,) LongTensor, the position of each query token (RoPE and the cache write;
        the rows of a batch share them: generate keeps its prompts aligned).
    key_mask: (1 or batch, 1, seqlen, cache_len) bool, True where a query may see a cached key;
        None: plain causal attention over the tokens themselves (training, a prefill from 0).
    cu_seqlens, max_seqlen: packed variable-length sequences (cumulative lengths, int32), for the
        varlen flash kernel; None for padded batches.
    block_table, slot_mapping, seq_index: a paged KV cache's block table (sequences,
        max_blocks) int32, each token's slot in the block pool (tokens,) and each token's row of
        the block table (tokens,); the step's tokens are then flattened into one row (batch 1),
        sequence by sequence. None for the static cache.
    seq_lens, query_start, max_query_len, max_seq_len: for the paged kernels, each sequence's
        length after the step (sequences,) int32, where its tokens begin in the row (sequences +
        1,) int32, and host-side bounds on both (they choose the kernel and its split count).
    """

    positions: Tensor
    key_mask: Tensor | None = None
    cu_seqlens: Tensor | None = None
    max_seqlen: int | None = None
    block_table: Tensor | None = None
    slot_mapping: Tensor | None = None
    seq_index: Tensor | None = None
    seq_lens: Tensor | None = None
    query_start: Tensor | None = None
    max_query_len: int = 0
    max_seq_len: int = 0

    @classmethod
    def causal(cls, seqlen: int, device: torch.device | str, start: int = 0) -> AttentionMetadata:
        """Whole causal sequences at positions start .. start + seqlen - 1 (no cache read)."""
        return cls(positions=torch.arange(start, start + seqlen, device=device))

    @classmethod
    def cached(
        cls, positions: Tensor, cache_len: int, window: int | None = None
    ) -> AttentionMetadata:
        """Queries at `positions` over a static cache of `cache_len` slots, slot p holding
        position p: query i sees the slots at positions <= positions[i] (and > positions[i] -
        window with a sliding window). Built from tensors only: no host sync."""
        key_positions = torch.arange(cache_len, device=positions.device)
        mask = key_positions[None, :] <= positions[:, None]  # (seqlen, cache_len)
        if window is not None:
            mask &= key_positions[None, :] > positions[:, None] - window
        return cls(positions=positions, key_mask=mask[None, None])


class Attention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        layer_index: int,
        backend: str = "sdpa",
        bias: bool = False,
        window: int | None = None,
        pattern: str | None = None,
    ) -> None:
        """pattern: a sparse attention pattern's text form (memfit.ops.attention.sparse.parse),
        run by memfit.sparse_attention in place of dense causal attention."""
        super().__init__()
        self.layer_index, self.backend, self.window = layer_index, backend, window
        self.pattern = None
        # (window, stride) of a strided pattern: the paged engine decodes it (its kernels read
        # the window's blocks and the summary columns'); other patterns do not generate yet
        self.paged_rule: tuple[int, int] | None = None
        if pattern is not None:
            from memfit.ops.attention.sparse import parse, strided

            self.pattern = parse(pattern)
            left = self.pattern.window[0] if self.pattern.window is not None else 0
            if self.pattern.stride and self.pattern == strided(
                self.pattern.stride, window=left + 1
            ):
                self.paged_rule = (left + 1, self.pattern.stride)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv = Linear(hidden_size, q_size + 2 * kv_size, bias=bias)
        self.out = Linear(q_size, hidden_size, bias=False)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        metadata: AttentionMetadata | None = None,
        kv_cache=None,
    ) -> Tensor:
        """x: (batch, seqlen, hidden); cos, sin: (seqlen, head_dim / 2) at the tokens' positions
        (computed once per forward by the model); kv_cache: a cache with
        `update(layer, metadata, k, v) -> (keys, values)` (memfit.inference: KVCache, PagedKVCache)."""
        batch, seqlen, _ = x.shape
        cached = kv_cache is not None or (metadata is not None and metadata.key_mask is not None)
        paged = metadata is not None and metadata.block_table is not None
        if self.pattern is not None and cached and not (paged and self.paged_rule):
            raise ValueError(
                f"layer {self.layer_index} attends with the sparse pattern {self.pattern}: "
                "generating from such a model is not supported yet"
                + (
                    " with a static KV cache: decode with the paged engine "
                    "(memfit.inference.LLM, memfit serve)"
                    if self.paged_rule
                    else " (a local or strided pattern generates)"
                )
            )
        qkv = self.qkv(x)  # (B, T, (nh + 2 * nkv) * hs)
        if paged:
            # a paged cache: rotation and cache write in one kernel, then the paged kernels
            q, keys, values = kv_cache.write_qkv(
                self.layer_index, metadata, qkv, cos, sin, self.num_heads
            )
            window, stride = self.paged_rule or (self.window, 0)
            y = MF.attention(
                q, keys, values, causal=True, window=window, backend=self.backend,
                metadata=metadata, stride=stride, kv_scales=kv_cache.kv_scales(self.layer_index),
            )  # fmt: skip
            return self.out(y.reshape(batch, seqlen, self.num_heads * self.head_dim))
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(batch, seqlen, self.num_heads, self.head_dim)  # (B, T, nh, hs)
        k = k.view(batch, seqlen, self.num_kv_heads, self.head_dim)  # (B, T, nkv, hs)
        # v is a view into qkv: copying it lets the (T, q + 2kv) projection output be freed
        # after RoPE instead of being kept alive for backward by the attention kernel.
        v = v.reshape(batch, seqlen, self.num_kv_heads, self.head_dim).contiguous()
        q, k = MF.apply_rotary_qk(q, k, cos, sin)  # one kernel for both; no copy of qkv
        read = None
        if kv_cache is not None:
            cached_k, cached_v = kv_cache.update(self.layer_index, metadata, k, v)
            if metadata.key_mask is not None:
                k, v, read = cached_k, cached_v, metadata  # decode, chunked prefill
                if self.window != getattr(kv_cache, "window", self.window):
                    raise ValueError(
                        f"layer {self.layer_index} slides a window of {self.window} and the "
                        f"static KV cache masks for {kv_cache.window}: layers with different "
                        "windows decode with the paged engine (memfit serve), not this cache"
                    )
        if self.pattern is not None:
            y = MF.sparse_attention(q, k, v, self.pattern)
        else:
            y = MF.attention(
                q, k, v, causal=True, window=self.window, backend=self.backend,
                mask=read.key_mask if read is not None else None, metadata=read,
            )  # fmt: skip
        return self.out(y.reshape(batch, seqlen, self.num_heads * self.head_dim))
