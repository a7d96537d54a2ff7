"""The decode step captured in CUDA graphs (gpt-fast's and vLLM's remedy for host overhead): a
decode step of a small model is a few hundred short kernels, and launching them from Python
takes longer than running them. A graph replays them all with one launch.

A graph fixes every shape and every address, so each batch-size bucket (1, 2, 4, 8, 16, then
steps of 16 up to `max_batch`) gets its own graph, captured once over static input buffers: the
step's tokens, positions, cache slots, sequence lengths and block table. A step of b decodes
copies its inputs into the buffers of the smallest bucket >= b and replays it; the padding rows
(bucket - b of them) are one-token sequences in the cache's scratch block, so they write and read
only there. The attention kernel's split count is fixed at capture from `max_seq_len`, the
longest context the engine allows, so any length up to it replays correctly.

All graphs share one memory pool, captured largest first, so the pool is the largest graph's
activations, not their sum.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from memfit.inference.paged_cache import PagedKVCache
from memfit.nn.attention import AttentionMetadata


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, 48, ... up to and including max_batch."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch]
    sizes += list(range(16, max_batch, 16))
    return sorted({*sizes, max_batch})


class DecodeGraphs:
    def __init__(
        self, model: torch.nn.Module, cache: PagedKVCache, *, max_batch: int, max_seq_len: int
    ) -> None:
        self.model, self.cache = model, cache
        self.max_seq_len = max_seq_len
        self.buckets = batch_buckets(max_batch)
        device = cache.device
        width = -(-max_seq_len // cache.block_size)
        self.width = width
        int32 = {"dtype": torch.int32, "device": device}
        self.tokens = torch.zeros(1, max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.slots = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(max_batch, **int32)
        self.block_table = torch.full((max_batch, width), cache.scratch_block, **int32)
        self.seq_index = torch.arange(max_batch, device=device)
        self.query_start = torch.arange(max_batch + 1, **int32)
        self._host_table = np.zeros((max_batch, width), dtype=np.int32)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, Tensor] = {}
        self.pool = None

    def _metadata(self, batch: int) -> AttentionMetadata:
        return AttentionMetadata(
            positions=self.positions[:batch],
            slot_mapping=self.slots[:batch],
            seq_index=self.seq_index[:batch],
            block_table=self.block_table[:batch],
            seq_lens=self.seq_lens[:batch],
            query_start=self.query_start[: batch + 1],
            max_query_len=1,
            max_seq_len=self.max_seq_len,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket's graph, largest first (they share its memory pool). The padding
        state (every row a scratch-block sequence) is what the warm-up and capture run on."""
        self._reset_rows(0, max(self.buckets))
        stream = torch.cuda.Stream(self.cache.device)
        stream.wait_stream(torch.cuda.current_stream(self.cache.device))
        with torch.cuda.stream(stream):
            for batch in reversed(self.buckets):
                self._forward(batch)  # warm-up: Triton compiles, cuBLAS picks its kernels
        torch.cuda.current_stream(self.cache.device).wait_stream(stream)
        for batch in reversed(self.buckets):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.logits[batch] = self._forward(batch)
            self.pool = graph.pool()
            self.graphs[batch] = graph
        torch.cuda.synchronize(self.cache.device)

    def _forward(self, batch: int) -> Tensor:
        logits = self.model(
            self.tokens[:, :batch], metadata=self._metadata(batch), kv_cache=self.cache
        )
        return logits[0]  # (batch, vocab)

    def _reset_rows(self, start: int, stop: int) -> None:
        """Rows start..stop-1 become padding: token 0 at position 0 in the scratch block."""
        scratch_slot = self.cache.scratch_block * self.cache.block_size
        self.tokens[0, start:stop] = 0
        self.positions[start:stop] = 0
        self.slots[start:stop] = scratch_slot
        self.seq_lens[start:stop] = 1
        self.block_table[start:stop, 0] = self.cache.scratch_block

    def bucket(self, batch: int) -> int | None:
        """The smallest captured batch size >= batch (None: too many rows for any graph)."""
        return next((b for b in self.buckets if b >= batch), None)

    @torch.inference_mode()
    def run(self, seq_ids: list[int], tokens: list[int]) -> Tensor:
        """Decode one token of each sequence (its cache slot is reserved here): the logits
        (len(seq_ids), vocab), a view of the graph's output valid until the next replay."""
        batch = len(seq_ids)
        bucket = self.bucket(batch)
        cache, table = self.cache, self._host_table
        rows: list[list[int]] = [[], [], [], []]  # tokens, positions, slots, lengths
        width = 1
        for row, seq_id in enumerate(seq_ids):
            position = cache.lengths.get(seq_id, 0)
            (slot,) = cache.append(seq_id, 1)
            blocks = cache.tables[seq_id]
            for column, value in zip(
                rows, (tokens[row], position, slot, position + 1), strict=True
            ):
                column.append(value)
            table[row, : len(blocks)] = blocks
            width = max(width, len(blocks))
        staged = torch.tensor(rows).to(cache.device, non_blocking=True)
        self.tokens[0, :batch] = staged[0]
        self.positions[:batch] = staged[1]
        self.slots[:batch] = staged[2]
        self.seq_lens[:batch] = staged[3].to(torch.int32)
        self.block_table[:batch, :width].copy_(
            torch.from_numpy(table[:batch, :width]).to(cache.device, non_blocking=True)
        )
        if bucket > batch:
            self._reset_rows(batch, bucket)
        self.graphs[bucket].replay()
        return self.logits[bucket][:batch]
