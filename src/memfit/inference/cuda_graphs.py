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

A graph ends with `greedy_advance`: the argmax of greedy rows written where the next step reads
its token, and every row's position, slot and length moved on by one. The next step of the same
sequences then replays at once, with nothing copied from the host, unless one of them has
crossed into a new cache block (every `block_size` steps), when its inputs are staged again.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from memfit.inference.paged_cache import PagedKVCache
from memfit.nn.attention import AttentionMetadata
from memfit.ops._triton import programmatic_launch
from memfit.ops.greedy_advance import argmax_scratch, greedy_advance


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
        # the per-row inputs: tokens, positions, slots, lengths, live and greedy flags (int64
        # rows of one buffer, `greedy_advance`'s layout), and the block table; staged on the host
        # in pinned buffers and copied with two transfers
        self._rows = torch.zeros(6, max_batch, dtype=torch.long, device=device)
        self.tokens, self.positions = self._rows[0:1], self._rows[1]
        self.slots, self.seq_lens = self._rows[2], self._rows[3]
        self.block_table = torch.zeros(max_batch, width, dtype=torch.int32, device=device)
        self.seq_index = torch.arange(max_batch, device=device)
        self.query_start = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self._argmax_scratch = argmax_scratch(max_batch, device)
        pinned = {"pin_memory": device.type == "cuda"}
        self._rows_host = torch.zeros(max_batch, 6, dtype=torch.long, **pinned)
        self._table_host = torch.zeros(max_batch * width, dtype=torch.int32, **pinned)
        self._rows_staged = torch.zeros(max_batch, 6, dtype=torch.long, device=device)
        # what the device holds after the last step: its bucket, sequences, greedy flag and
        # each row's next position (the last step's graph advanced them); None: nothing
        self._advanced: tuple | None = None
        self.staged_steps = 0
        """Steps whose inputs were copied from the host (the others replayed at once)."""
        # a pipelined step's inputs are staged while the step before it runs: the host buffers
        # are rewritten only once their last copy has left (this event)
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        # the greedy tokens of two steps in flight, copied back without waiting
        self._tokens_host = torch.zeros(2, max_batch, dtype=torch.long, **pinned)
        self._logprobs_host = torch.zeros(2, max_batch, dtype=torch.float32, **pinned)
        self._flip = 0
        self._last: Tensor | None = None
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
        """Capture every bucket's graph, largest first (they share its memory pool). Every row
        a padding row while they run: warm-up and capture write only the scratch block."""
        self._stage([], [], max(self.buckets), False)
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
        self._advanced = None

    def _forward(self, batch: int) -> Tensor:
        with programmatic_launch():  # the weights stay constant during a step
            logits = self.model(
                self.tokens[:, :batch], metadata=self._metadata(batch), kv_cache=self.cache
            )[0]  # (batch, vocab)
            greedy_advance(
                logits, self._rows, self.block_table, self.cache.block_size, self._argmax_scratch
            )
        return logits

    def bucket(self, batch: int) -> int | None:
        """The smallest captured batch size >= batch (None: too many rows for any graph)."""
        return next((b for b in self.buckets if b >= batch), None)

    @torch.inference_mode()
    def run(self, seq_ids: list[int], tokens: list[int] | None, *, greedy: bool = False) -> Tensor:
        """Decode one token of each sequence (its cache slot is reserved here): the logits
        (len(seq_ids), vocab), a view of the graph's output valid until the next replay.
        tokens None: each row's token is the one left on the device for it by the step before
        (its argmax, or `feed`; the rows are the last step's, in its order): the step is queued
        without waiting for the host. greedy: the step leaves its argmax there (see `greedy`)."""
        bucket = self.bucket(len(seq_ids))
        self._stage(seq_ids, tokens, bucket, greedy)
        if bucket not in self.graphs:  # not captured (a CPU): the same step, run eagerly
            self._last = self._forward(bucket)[: len(seq_ids)]
        else:
            self.graphs[bucket].replay()
            self._last = self.logits[bucket][: len(seq_ids)]
        return self._last

    @property
    def last_logits(self) -> Tensor:
        """The logits of the last `run`."""
        return self._last

    @torch.inference_mode()
    def greedy(self) -> Callable[[], tuple[list[int], None]]:
        """The argmax of the last step's logits (a step run with greedy=True leaves it where
        the next step reads its tokens): see `feed`."""
        if self._advanced is None or not self._advanced[2]:
            raise RuntimeError("greedy() needs a step run with greedy=True before it")
        return self._send(self.tokens[0, : self._last.shape[0]], None)

    @torch.inference_mode()
    def feed(
        self, tokens: Tensor, logprobs: Tensor | None
    ) -> Callable[[], tuple[list[int], list[float] | None]]:
        """Tokens drawn on the device from the last step's logits (one per row, with their
        log-probabilities or None), written where the next step reads its tokens and copied to
        the host without waiting. Returns a function that waits for the copy and gives them
        (call it before the step after next is queued)."""
        self.tokens[0, : tokens.shape[0]].copy_(tokens)
        return self._send(tokens, logprobs)

    def _send(self, tokens: Tensor, logprobs: Tensor | None):
        batch, flip = tokens.shape[0], self._flip
        self._flip ^= 1
        host = self._tokens_host[flip, :batch]
        host.copy_(tokens, non_blocking=True)
        host_logprobs = None
        if logprobs is not None:
            host_logprobs = self._logprobs_host[flip, :batch]
            host_logprobs.copy_(logprobs, non_blocking=True)
        event = None
        if self._copied is not None:
            event = torch.cuda.Event()
            event.record()

        def wait() -> tuple[list[int], list[float] | None]:
            if event is not None:
                event.synchronize()
            return host.tolist(), host_logprobs.tolist() if host_logprobs is not None else None

        return wait

    def _stage(
        self, seq_ids: list[int], tokens: list[int] | None, bucket: int, greedy: bool
    ) -> None:
        """Fill the inputs of `bucket` rows: the sequences' (their slots reserved in the cache),
        then padding rows (token 0 at position 0 in the scratch block). Nothing to do when the
        last step's graph has advanced the same sequences to where they are (no new tokens
        from the host, no new block); else two host-to-device copies, both from pinned memory,
        and one transpose on the device; without `tokens` the token row is left as it is."""
        cache, batch = self.cache, len(seq_ids)
        positions = [cache.lengths.get(seq_id, 0) for seq_id in seq_ids]
        blocks = [len(cache.tables.get(seq_id, ())) for seq_id in seq_ids]
        slots = [cache.append(seq_id, 1)[0] for seq_id in seq_ids]
        key = (bucket, tuple(seq_ids), greedy)
        advanced, self._advanced = self._advanced, (*key, tuple(p + 1 for p in positions))
        if (
            tokens is None
            and advanced == (*key, tuple(positions))
            and all(len(cache.tables[s]) == n for s, n in zip(seq_ids, blocks, strict=True))
        ):
            return  # the device holds these inputs already
        self.staged_steps += 1
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copies have left the host buffers
        rows = self._rows_host.numpy()
        for row, (position, slot) in enumerate(zip(positions, slots, strict=True)):
            token = tokens[row] if tokens is not None else 0
            rows[row] = (token, position, slot, position + 1, 1, int(greedy))
        tables = [cache.tables[seq_id] for seq_id in seq_ids]
        width = max((len(t) for t in tables), default=1)
        table = self._table_host.numpy()[: bucket * width].reshape(bucket, width)
        for row, blocks in enumerate(tables):
            table[row, : len(blocks)] = blocks
        rows[batch:bucket] = (0, 0, cache.scratch_block * cache.block_size, 1, 0, 0)
        table[batch:bucket, 0] = cache.scratch_block
        staged = self._rows_staged[:bucket]
        staged.copy_(self._rows_host[:bucket], non_blocking=True)
        first = 0 if tokens is not None else 1
        self._rows[first:, :bucket].copy_(staged.T[first:])
        self.block_table[:bucket, :width].copy_(
            self._table_host[: bucket * width].view(bucket, width), non_blocking=True
        )
        if self._copied is not None:
            self._copied.record()


def token_buckets(max_tokens: int) -> list[int]:
    """16, 32, 64, then steps of 32 up to 256, of 64 up to 512, of 128 up to 1024, of 256 up to
    2048 and of 512 beyond, up to and including max_tokens: a step of t > 64 tokens runs the
    smallest bucket >= t, padding at most a third of the bucket (a fifth past 128). Serving
    under load runs steps of a few hundred tokens (decodes and a chunk), where power-of-two
    buckets padded a 347-token step to 512."""
    sizes = [16, 32, 64]
    for stride, end in ((32, 256), (64, 512), (128, 1024), (256, 2048)):
        sizes += range(sizes[-1] + stride, end + 1, stride)
    while sizes[-1] < max_tokens:
        sizes.append(sizes[-1] + 512)
    return sorted({*(t for t in sizes if t < max_tokens), max_tokens})


class StepGraphs:
    """Steps of any mix (prefill chunks beside decodes) captured in CUDA graphs, per bucket of
    (tokens, sequences): an eager step of a few hundred kernels costs more host time than GPU
    time, and under load every step is one of these. A step of t tokens of s sequences replays
    the graph of the smallest buckets >= t and >= s. Its padding tokens sit at position 0 in the
    scratch block and belong to no sequence; its padding sequences have no tokens (the chunk
    kernel's programs for them return at once); their logits are never read. The graphs share
    one memory pool with each other (captured largest first) and with the decode graphs.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        cache: PagedKVCache,
        *,
        max_tokens: int,
        max_seqs: int,
        max_seq_len: int,
    ) -> None:
        self.model, self.cache = model, cache
        self.max_seq_len = max_seq_len
        self.token_buckets = token_buckets(max_tokens)
        self.seq_buckets = sorted({s for s in (4, 16, 64) if s < max_seqs} | {max_seqs})
        device = cache.device
        self.width = width = -(-max_seq_len // cache.block_size)
        # per token: token, position, slot, row of the block table, and the row of the last
        # step whose drawn token it is (-1: the token given); per sequence: length, where its
        # tokens begin (one more), the row of its last token (int64 rows of one buffer)
        self._tokens = torch.zeros(5, max_tokens, dtype=torch.long, device=device)
        self.sampled = torch.zeros(max_seqs, dtype=torch.long, device=device)
        """Each sequence's argmax of the last step (where the next step reads drawn tokens)."""
        self._seqs = torch.zeros(3, max_seqs + 1, dtype=torch.long, device=device)
        self.block_table = torch.zeros(max_seqs, width, dtype=torch.int32, device=device)
        # (the kernels take int32 lengths and starts: converted on the device, in the graph)
        pinned = {"pin_memory": device.type == "cuda"}
        self._tokens_host = torch.zeros(5, max_tokens, dtype=torch.long, **pinned)
        self._sampled_host = torch.zeros(2, max_seqs, dtype=torch.long, **pinned)
        self._flip = 0
        self._seqs_host = torch.zeros(3, max_seqs + 1, dtype=torch.long, **pinned)
        self._table_host = torch.zeros(max_seqs * width, dtype=torch.int32, **pinned)
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple[int, int], Tensor] = {}
        self.pool = None

    def buckets(self) -> list[tuple[int, int]]:
        """Every (tokens, sequences) pair a step may need: a step of t tokens has at most t
        sequences."""
        return [
            (t, s) for t in self.token_buckets for s in self.seq_buckets
            if s <= self._seq_bucket(min(t, self.seq_buckets[-1]))
        ]  # fmt: skip

    def _seq_bucket(self, seqs: int) -> int | None:
        return next((b for b in self.seq_buckets if b >= seqs), None)

    def bucket(self, tokens: int, seqs: int) -> tuple[int, int] | None:
        """The smallest captured (tokens, sequences) bucket that holds a step (None: none)."""
        t = next((b for b in self.token_buckets if b >= tokens), None)
        s = self._seq_bucket(seqs)
        return None if t is None or s is None else (t, s)

    def _forward(self, bucket: tuple[int, int]) -> Tensor:
        tokens, seqs = bucket
        rows = self._tokens
        metadata = AttentionMetadata(
            positions=rows[1, :tokens],
            slot_mapping=rows[2, :tokens],
            seq_index=rows[3, :tokens],
            block_table=self.block_table[:seqs],
            seq_lens=self._seqs[0, :seqs].to(torch.int32),
            query_start=self._seqs[1, : seqs + 1].to(torch.int32),
            max_query_len=tokens,
            max_seq_len=self.max_seq_len,
        )
        # a drawn token: the last step's argmax of its sequence, read on the device
        source = rows[4, :tokens]
        drawn = self.sampled.index_select(0, source.clamp(min=0))
        ids = torch.where(source >= 0, drawn, rows[0, :tokens])
        with programmatic_launch():
            logits = self.model(
                ids[None], metadata=metadata, kv_cache=self.cache,
                logits_at=self._seqs[2, :seqs],
            )  # fmt: skip
        self.sampled[:seqs].copy_(logits[0].argmax(dim=-1))
        return logits[0]  # (seqs, vocab)

    @torch.inference_mode()
    def capture(self, pool=None) -> None:
        """Capture every bucket's graph, largest first, into `pool` (another set of graphs'):
        every token a padding token while they run, so warm-up and capture write only the
        scratch block."""
        self.pool = pool
        largest = (max(self.token_buckets), max(self.seq_buckets))
        self._stage([], [], largest)
        device = self.cache.device
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        order = sorted(self.buckets(), reverse=True)
        with torch.cuda.stream(stream):
            for bucket in order:
                self._forward(bucket)  # warm-up: Triton compiles, cuBLAS picks its kernels
        torch.cuda.current_stream(device).wait_stream(stream)
        for bucket in order:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.logits[bucket] = self._forward(bucket)
            self.pool = graph.pool()
            self.graphs[bucket] = graph
        torch.cuda.synchronize(device)

    @torch.inference_mode()
    def run(
        self, seq_ids: list[int], tokens: list[list[int]], drawn: list[int] | None = None
    ) -> Tensor:
        """One step: `tokens[i]` (the new tokens of seq_ids[i]) through the model, their slots
        reserved here; the logits of each sequence's last token (len(seq_ids), vocab), a view
        of the graph's output valid until the next replay, and their argmax in `sampled`.
        drawn[i] >= 0: the last of tokens[i] is not known on the host yet; it is the argmax that
        the step before left for its row drawn[i] (the next step is queued without waiting)."""
        bucket = self.bucket(sum(map(len, tokens)), len(seq_ids))
        self._stage(seq_ids, tokens, bucket, drawn)
        if bucket not in self.graphs:  # not captured (a CPU): the same step, run eagerly
            return self._forward(bucket)[: len(seq_ids)]
        self.graphs[bucket].replay()
        return self.logits[bucket][: len(seq_ids)]

    @torch.inference_mode()
    def send_sampled(self, count: int) -> Callable[[], list[int]]:
        """Copy the last step's argmax of its first `count` rows to the host without waiting;
        returns the function that waits for the copy and gives them."""
        host = self._sampled_host[self._flip, :count]
        self._flip ^= 1
        host.copy_(self.sampled[:count], non_blocking=True)
        event = None
        if self._copied is not None:
            event = torch.cuda.Event()
            event.record()

        def wait() -> list[int]:
            if event is not None:
                event.synchronize()
            return host.tolist()

        return wait

    def _stage(self, seq_ids, tokens: list[list[int]], bucket, drawn=None) -> None:
        """Fill the inputs of `bucket`: the sequences' tokens (their slots reserved in the
        cache), then padding. Three host-to-device copies, from pinned memory."""
        cache, size = self.cache, self.cache.block_size
        bucket_tokens, bucket_seqs = bucket
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copies have left the host buffers
        rows, seqs = self._tokens_host.numpy(), self._seqs_host.numpy()
        at = 0
        for row, (seq_id, new) in enumerate(zip(seq_ids, tokens, strict=True)):
            start, count = cache.lengths.get(seq_id, 0), len(new)
            slots = cache.append(seq_id, count)
            end = at + count
            rows[0, at:end] = new
            rows[1, at:end] = range(start, start + count)
            rows[2, at:end] = slots
            rows[3, at:end] = row
            rows[4, at:end] = -1
            if drawn is not None and drawn[row] >= 0:
                rows[0, end - 1], rows[4, end - 1] = 0, drawn[row]
            seqs[:, row] = (start + count, at, end - 1)
            at = end
        batch = len(seq_ids)
        pad_row = min(batch, bucket_seqs - 1)  # a padding sequence's, where there is one
        rows[:, at:bucket_tokens] = ((0,), (0,), (cache.scratch_block * size,), (pad_row,), (-1,))
        seqs[:, batch:bucket_seqs] = ((1,), (at,), (0,))
        seqs[1, bucket_seqs] = at
        tables = [cache.tables[s] for s in seq_ids]  # (append may have grown them)
        width = max((len(t) for t in tables), default=1)
        table = self._table_host.numpy()[: bucket_seqs * width].reshape(bucket_seqs, width)
        for row, blocks in enumerate(tables):
            table[row, : len(blocks)] = blocks
        table[batch:bucket_seqs, 0] = cache.scratch_block
        self._tokens[:, :bucket_tokens].copy_(
            self._tokens_host[:, :bucket_tokens], non_blocking=True
        )
        self._seqs[:, : bucket_seqs + 1].copy_(
            self._seqs_host[:, : bucket_seqs + 1], non_blocking=True
        )
        self.block_table[:bucket_seqs, :width].copy_(
            self._table_host[: bucket_seqs * width].view(bucket_seqs, width), non_blocking=True
        )
        if self._copied is not None:
            self._copied.record()
