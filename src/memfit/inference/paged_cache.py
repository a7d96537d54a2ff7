"""A paged KV cache (Kwon et al. 2023, "Efficient Memory Management for Large Language Model
Serving with PagedAttention"): keys and values of every layer live in one preallocated pool of
fixed-size blocks, and each sequence finds its blocks through a block table, as a process finds
its pages. A sequence takes a block only when it needs one, so at most block_size - 1 slots per
sequence are reserved but empty (vLLM measured under 4% waste against 60-80% for caches reserved
at the longest length), and a finished sequence gives its blocks back at once.

Layout: keys, values: (layers, num_blocks + 1, block_size, heads_kv, head_dim), GQA/MQA keep
heads_kv heads only; the last block is scratch space for the padding rows of captured steps. Slot s of the pool is block s // block_size, offset s % block_size. Blocks carry
reference counts: a block shared by several sequences (a common prompt prefix) returns to the
free list when the last one lets it go; `fork` shares a sequence's blocks with a new one.

Prefix caching (`prefix_caching`, vLLM's automatic prefix caching): a full block is registered
under a hash of its tokens and of its parent block's hash, so the key names the whole prefix up
to it. A new sequence takes the cached blocks of its longest cached prefix of whole blocks
(`match_prefix`, leaving at least its last token to compute) and computes only the rest; it
never writes into them (its next token goes to a new block), so no copy-on-write is needed. A
cached block nobody uses stays with its contents until a block is needed, least recently
released first.

Quantized (`kv_dtype="fp8"` or `"int8"`): keys and values are stored in one byte an element,
so the same memory holds about twice the tokens. Keys are stored less `key_offset[layer, h]`,
the keys' mean over calibration tokens after each row's first: a query's scores against every key then drop by the same
q . key_offset, which the softmax cancels, so the kernels never add it back; what it removes is
the part of k common to all tokens, which would otherwise take the rounding error on its large
magnitude. Then (head_dim a power of two of at least 32) the key and the query are rotated
after RoPE, k' = (k - key_offset) H b and q' = q H a, H the +-1 Hadamard matrix with random row
signs of `key_rotation` and a b = 1 / head_dim (`rotation_scales`), so that q' . k' =
q . (k - key_offset): a few channels of the keys carry most of a score, and their rounding
error with it; rotated, every element mixes all the channels with the same weight and the
errors average out. The paged write does it (products exact, sums in fp32); the attention
kernels see rotated queries and keys and need nothing for it. On SmolLM2-135M the KL divergence of
the next-token distribution from the full-precision cache's fell 41% for fp8 and 55% for int8;
fp8's perplexity cost, over four rounding realizations each, from +0.92% to +0.65% on average
(a single run's moves by +-0.4% with how its roundings fall; BENCHMARKS.md).
The first position apart: many models park attention they do not need on a sequence's first
token (an attention sink: Xiao et al. 2023, "Efficient Streaming Language Models with Attention
Sinks"), whose key and value then sit far from the others' and nearly the same in every
sequence. Where calibration finds that (`FIRST_APART`), position 0 is stored less offsets of
its own, `first_offset[layer, 0 / 1, h]` (keys', values'), so only its small difference from
them is rounded, and the attention kernels add back what differs from the other positions at
key 0 alone: q . `first_key` to its score and its softmax weight times `first_value` to the
output (memfit.ops.attention.paged). On SmolLM2-135M (layers 12-29: position 0's keys within
about 1% of their mean) fp8's perplexity cost over four draws of the rotation fell from +0.65%
to +0.26% on average (+0.28% with the engine's), int8's from +0.10% to +0.05% (BENCHMARKS.md).
Elsewhere (random weights, or heads without a sink) position 0 takes the others' offset.
- fp8 (e4m3): each layer's kv head h stores v / v_scale[h] and (k - key_offset[h]) / k_scale[h]
  (at position 0 less first_offset instead, as above),
  static scales that are powers of two (exact to divide by) leaving a factor 4 of headroom
  above the calibration's largest value. The kernels fold k_scale into the score scale and
  v_scale into the output.
- int8: each token's key (less the offset) and value per head is scaled so that its largest
  |element| is 127 and rounded to nearest; the scale, in fp16, is stored beside it
  (`key_token_scale`, `value_token_scale`: 2 bytes a token and head each). The kernels scale
  each key's scores and each value's weights by them. Static scales did not do here: on
  SmolLM2-135M a per-head int8 scale from calibration lost 1.1% perplexity, a factor 2 of range
  the difference between +0.07% and +1.1%; one scale a token follows each token's own range.
fp8's 3 mantissa bits on the keys cost more than int8's 7 with per-token scales
(benchmarks/quant_quality.py --kv). `calibrate` sets the offsets (and fp8's scales) from a
model's forward over a few token rows; until then the offset is 0 and the scales 1.
`calibration()` gives what it set (the tensors named in `CALIBRATION`) and `load_calibration`
sets it on another cache of the same model, which derives the rest (`first_key`, `first_value`,
fp8's inverse scales) as `calibrate` does.

Bookkeeping (tables, lengths, the free list) is on the host, where the scheduler runs; a step's
`AttentionMetadata` (positions, slot mapping, block table, each token's sequence) is built once
and copied to the device in one go, and every layer reads it.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Sequence

import torch
from torch import Tensor

from memfit import functional as MF
from memfit.models.config import ModelConfig
from memfit.nn.attention import AttentionMetadata
from memfit.ops._triton import use_triton
from memfit.ops.paged_write import rotary_paged_write, rotation_scales

KV_DTYPES = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}  # the quantized caches (kv_dtype)
FP8_MAX = 448.0  # e4m3's largest finite value: saturated there
HEADROOM = 4.0  # fp8: the calibration's largest |value| lands at most at FP8_MAX / HEADROOM
INT8_MAX = 127.0
TOKEN_SCALE_BYTES = 2  # int8: each token's key and value scale per head, fp16
# calibration: position 0 takes offsets of its own (a kv head's keys, or values) when its
# FIRST_SAMPLES or more calibration rows' keys have a mean square distance to their mean below
# FIRST_APART times their mean square distance to the other positions' offset (values: to 0),
# i.e. an rms spread below half the rms distance
FIRST_APART, FIRST_SAMPLES = 0.25, 8


def key_rotation(head_dim: int, seed: int = 0) -> Tensor | None:
    """The (head_dim, head_dim) +-1 matrix H (H H^T = head_dim I) that a quantized cache's keys
    (less their offset) and the queries are multiplied by (`rotary_paged_write`): Sylvester's
    Hadamard matrix with random signs on its rows (a fixed seed), so that every element of a
    rotated key mixes every channel with the same weight. None (no rotation) where head_dim is
    not a power of two of at least 32. (`seed`: another draw of the signs, for measurements.)"""
    if head_dim < 32 or head_dim & (head_dim - 1):
        return None
    matrix = torch.ones(1, 1)
    while matrix.shape[0] < head_dim:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)])
    generator = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (head_dim, 1), generator=generator) * 2.0 - 1.0
    return (signs * matrix).contiguous()


class OutOfBlocks(RuntimeError):
    """The pool has no free block; the scheduler preempts a sequence and tries again."""


class BlockPool:
    """The free list and reference counts of `num_blocks` blocks, and the prefix cache's index:
    a full block registered under the hash of its tokens (and of all before it) can be taken
    again by a sequence with the same prefix. A registered block whose last user lets it go is
    kept, with its contents, among the evictable ones (least recently released first) until a
    new block is needed; evictable blocks count as free."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.free: deque[int] = deque(range(num_blocks))
        self.refs = [0] * num_blocks
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.hash_of: dict[int, int] = {}
        self.block_of: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return len(self.free) + len(self.evictable)

    def allocate(self) -> int:
        if self.free:
            block = self.free.popleft()
        elif self.evictable:  # the least recently used cached block gives up its contents
            block, _ = self.evictable.popitem(last=False)
            del self.block_of[self.hash_of.pop(block)]
        else:
            raise OutOfBlocks(f"all {self.num_blocks} KV blocks are in use")
        self.refs[block] = 1
        return block

    def share(self, block: int) -> None:
        if self.refs[block] < 1:
            raise ValueError(f"block {block} is free: it cannot be shared")
        self.refs[block] += 1

    def release(self, block: int) -> None:
        if self.refs[block] < 1:
            raise ValueError(f"block {block} is already free")
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self.hash_of:
                self.evictable[block] = None
            else:
                self.free.append(block)

    def register(self, block: int, key: int) -> None:
        """`block` (in use, full) holds the tokens hashed to `key`; a key already held by
        another block keeps that one."""
        if key not in self.block_of and block not in self.hash_of:
            self.block_of[key] = block
            self.hash_of[block] = key

    def take_cached(self, key: int) -> int | None:
        """The block registered under `key`, with one more user; None when there is none."""
        block = self.block_of.get(key)
        if block is None:
            return None
        if self.refs[block] == 0:
            del self.evictable[block]
        self.refs[block] += 1
        return block


class PagedKVCache:
    def __init__(
        self,
        config: ModelConfig,
        *,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype,
        device: torch.device | str,
        kv_dtype: str | None = None,
    ) -> None:
        """dtype: the model's compute dtype; kv_dtype: None (store in dtype), 'fp8' or 'int8'."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if kv_dtype not in (None, *KV_DTYPES):
            raise ValueError(f"kv_dtype must be None or one of {list(KV_DTYPES)}, got {kv_dtype!r}")
        # one block more than the pool hands out: the scratch block, where the padding rows of a
        # captured decode step (memfit.inference.cuda_graphs) write and read
        shape = (
            config.num_layers,
            num_blocks + 1,
            block_size,
            config.num_kv_heads,
            config.head_dim,
        )
        storage = KV_DTYPES[kv_dtype] if kv_dtype else dtype
        self.keys = torch.zeros(shape, dtype=storage, device=device)
        self.values = torch.zeros(shape, dtype=storage, device=device)
        self.dtype, self.kv_dtype = dtype, kv_dtype
        if kv_dtype:
            heads = (config.num_layers, config.num_kv_heads)
            self.key_offset = torch.zeros(*heads, config.head_dim, device=device)
            # position 0's own offsets (keys', values'), and what the kernels add back for them
            self.first_offset = torch.zeros(heads[0], 2, heads[1], config.head_dim, device=device)
            self.first_key = torch.zeros(*heads, config.head_dim, device=device)
            self.first_value = torch.zeros(*heads, config.head_dim, device=device)
            self.key_scale = torch.ones(heads, device=device)
            self.value_scale = torch.ones(heads, device=device)
            # fp8: 1 / the scales, what the paged write multiplies by (kept, not made each step)
            self.key_scale_inverse = torch.ones(heads, device=device)
            self.value_scale_inverse = torch.ones(heads, device=device)
            rotation = key_rotation(config.head_dim)
            self.key_rotation = rotation.to(device) if rotation is not None else None
        if kv_dtype == "int8":  # each slot's scale per head, beside its keys and values
            self.key_token_scale = torch.ones(shape[:-1], dtype=torch.float16, device=device)
            self.value_token_scale = torch.ones(shape[:-1], dtype=torch.float16, device=device)
        self.block_size = block_size
        self.device = torch.device(device)
        self.pool = BlockPool(num_blocks)
        self.scratch_block = num_blocks
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}
        self.hashes: dict[int, list[int]] = {}  # each sequence's registered full blocks' keys
        self.prefix_caching = False
        self.prefix_queried = self.prefix_hits = 0  # prompt tokens looked up, and found

    @staticmethod
    def bytes_per_block(
        config: ModelConfig, block_size: int, dtype: torch.dtype, kv_dtype: str | None = None
    ) -> int:
        """K and V of every layer for block_size tokens (int8: with their fp16 scales)."""
        element = torch.empty((), dtype=KV_DTYPES[kv_dtype] if kv_dtype else dtype).element_size()
        per_head = config.head_dim * element + (TOKEN_SCALE_BYTES if kv_dtype == "int8" else 0)
        return 2 * config.num_layers * block_size * config.num_kv_heads * per_head

    @classmethod
    def from_budget(
        cls, config: ModelConfig, budget_bytes: int, *, block_size: int = 16, **tensor_options
    ) -> PagedKVCache:
        """As many blocks as `budget_bytes` holds (e.g. what is left of `gpu_memory_utilization`
        of the GPU after the weights); ValueError naming the numbers if not one fits.
        tensor_options: dtype, device and kv_dtype, as for the constructor."""
        per_block = cls.bytes_per_block(
            config, block_size, tensor_options["dtype"], tensor_options.get("kv_dtype")
        )
        num_blocks = budget_bytes // per_block - 1  # the scratch block
        if num_blocks < 1:
            raise ValueError(
                f"a KV budget of {budget_bytes / 2**20:.1f} MiB holds no block of {block_size} "
                f"tokens ({per_block / 2**20:.2f} MiB for {config.name}'s {config.num_layers} "
                "layers): give the cache more memory or use a smaller block_size"
            )
        return cls(config, num_blocks=num_blocks, block_size=block_size, **tensor_options)

    # -- sequences ------------------------------------------------------------------------------

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def blocks_needed(self, seq_id: int, num_tokens: int) -> int:
        """Free blocks `num_tokens` more tokens of `seq_id` (new or not) would take."""
        length = self.lengths.get(seq_id, 0)
        return self._blocks_for(length + num_tokens) - len(self.tables.get(seq_id, ()))

    def can_append(self, seq_id: int, num_tokens: int) -> bool:
        """Whether `num_tokens` more tokens of `seq_id` (new or not) fit in the free blocks."""
        return self.blocks_needed(seq_id, num_tokens) <= self.pool.num_free

    def append(self, seq_id: int, num_tokens: int) -> list[int]:
        """Reserve slots for `num_tokens` more tokens of `seq_id` (allocating blocks as needed)
        and return them; OutOfBlocks, with nothing changed, when the pool cannot hold them."""
        if not self.can_append(seq_id, num_tokens):
            raise OutOfBlocks(
                f"sequence {seq_id} needs blocks for {num_tokens} more tokens; "
                f"{self.pool.num_free} of {self.pool.num_blocks} blocks are free"
            )
        table = self.tables.setdefault(seq_id, [])
        start = self.lengths.get(seq_id, 0)
        while len(table) < self._blocks_for(start + num_tokens):
            table.append(self.pool.allocate())
        self.lengths[seq_id] = start + num_tokens
        size = self.block_size
        return [table[p // size] * size + p % size for p in range(start, start + num_tokens)]

    def fork(self, parent: int, child: int) -> None:
        """`child` starts as `parent`'s copy, sharing its blocks (reference counts). The shared
        part must not be written again: prefix sharing shares whole, full blocks."""
        if child in self.tables:
            raise ValueError(f"sequence {child} already exists")
        for block in self.tables[parent]:
            self.pool.share(block)
        self.tables[child] = list(self.tables[parent])
        self.lengths[child] = self.lengths[parent]

    def free(self, seq_id: int) -> None:
        """Give `seq_id`'s blocks back (a shared block stays until its last user frees it)."""
        for block in self.tables.pop(seq_id, []):
            self.pool.release(block)
        self.lengths.pop(seq_id, None)
        self.hashes.pop(seq_id, None)

    # -- prefix caching -------------------------------------------------------------------------

    def _key(self, parent: int | None, tokens: Sequence[int]) -> int:
        return hash((parent, tuple(tokens)))

    def match_prefix(self, seq_id: int, tokens: Sequence[int]) -> int:
        """Start the new sequence `seq_id` on the cached blocks of its longest cached prefix
        of whole blocks (at least its last token is left to compute: a step needs one to
        sample from). Returns how many of `tokens` are cached (a multiple of the block size)."""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id} already has blocks")
        size, table, keys = self.block_size, [], []
        parent = None
        for start in range(0, (len(tokens) - 1) // size * size, size):
            key = self._key(parent, tokens[start : start + size])
            block = self.pool.take_cached(key)
            if block is None:
                break
            table.append(block)
            keys.append(key)
            parent = key
        self.tables[seq_id], self.hashes[seq_id] = table, keys
        self.lengths[seq_id] = len(table) * size
        self.prefix_queried += len(tokens)
        self.prefix_hits += len(table) * size
        return len(table) * size

    def block_keys(self, tokens: Sequence[int]) -> list[int]:
        """The keys of `tokens`' full blocks, each chained on the ones before it: what
        `register` files them under and `match_prefix` looks for."""
        size, keys = self.block_size, []
        for start in range(0, len(tokens) // size * size, size):
            keys.append(self._key(keys[-1] if keys else None, tokens[start : start + size]))
        return keys

    def unregistered(self, seq_id: int, computed: int) -> bool:
        """Whether `seq_id` has full blocks (of its first `computed` tokens) not registered."""
        return computed // self.block_size > len(self.hashes.get(seq_id, ()))

    def register(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Register the full blocks of `tokens` (the sequence's tokens in the cache) that are
        not yet, under the hash of their tokens and of every block before them."""
        size, table = self.block_size, self.tables[seq_id]
        keys = self.hashes.setdefault(seq_id, [])
        for index in range(len(keys), len(tokens) // size):
            key = self._key(keys[-1] if keys else None, tokens[index * size : (index + 1) * size])
            self.pool.register(table[index], key)
            keys.append(key)

    def waste(self) -> float:
        """Reserved but empty slots over all reserved slots (0 when nothing is reserved)."""
        blocks = self.pool.num_blocks - self.pool.num_free
        stored = sum(self.lengths.values())
        return 1 - stored / (blocks * self.block_size) if blocks else 0.0

    # -- a step ---------------------------------------------------------------------------------

    def step_metadata(self, seq_ids: Sequence[int], num_new: Sequence[int]) -> AttentionMetadata:
        """Reserve slots for `num_new[i]` new tokens of each `seq_ids[i]` and describe the step:
        its tokens flattened in that order (sequence i's new tokens at positions length ..
        length + num_new[i] - 1), their slots, the block table and each token's row of it."""
        positions, slots, seq_index = [], [], []
        for row, (seq_id, count) in enumerate(zip(seq_ids, num_new, strict=True)):
            start = self.lengths.get(seq_id, 0)
            slots += self.append(seq_id, count)
            positions += range(start, start + count)
            seq_index += [row] * count
        width = max(len(self.tables[s]) for s in seq_ids)
        table = [self.tables[s] + [0] * (width - len(self.tables[s])) for s in seq_ids]
        seq_lens = [self.lengths[s] for s in seq_ids]
        host = {
            "positions": torch.tensor(positions, dtype=torch.long),
            "slot_mapping": torch.tensor(slots, dtype=torch.long),
            "seq_index": torch.tensor(seq_index, dtype=torch.long),
            "block_table": torch.tensor(table, dtype=torch.int32),
            "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
            "query_start": torch.tensor([0, *itertools.accumulate(num_new)], dtype=torch.int32),
        }
        device = {k: v.to(self.device, non_blocking=True) for k, v in host.items()}
        return AttentionMetadata(**device, max_query_len=max(num_new), max_seq_len=max(seq_lens))

    def write_qkv(
        self, layer: int, metadata: AttentionMetadata, qkv: Tensor, cos: Tensor, sin: Tensor,
        heads_q: int,
    ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        """Attention's paged path: q and k of the step's fused projection `qkv` (1, tokens,
        (heads_q + 2 heads_kv) * head_dim) rotated by the tables (tokens, head_dim), k and v
        written into their slots. Returns q (1, tokens, heads_q, head_dim) and layer `layer`'s
        pools. One kernel where Triton runs (memfit.ops.paged_write), the same values as the
        rotation and two indexed writes that run elsewhere."""
        keys, values = self.keys[layer], self.values[layer]
        heads, dim = keys.shape[-2:]
        flat = qkv.reshape(-1, qkv.shape[-1])
        if use_triton(flat) and flat.dtype == self.dtype:
            quant = self._quant(layer)
            q = rotary_paged_write(
                flat, cos, sin, keys, values, metadata.slot_mapping, heads_q=heads_q,
                **({"key_offset": quant[0], "k_scale": quant[1], "v_scale": quant[2],
                    "key_rotation": self.key_rotation, "first_offset": self.first_offset[layer],
                    "positions": metadata.positions.reshape(-1),
                    "inverse_scales": (self.key_scale_inverse[layer],
                                       self.value_scale_inverse[layer])
                    if self.kv_dtype == "fp8" else None} if quant else {}),
            )  # fmt: skip
            return q[None], keys, values
        tokens = flat.shape[0]
        q, k, v = flat.split([heads_q * dim, heads * dim, heads * dim], dim=-1)
        q, k = MF.apply_rotary_qk(
            q.view(1, tokens, heads_q, dim), k.view(1, tokens, heads, dim), cos, sin
        )
        self.update(layer, metadata, k, v)
        if self.kv_dtype and self.key_rotation is not None:  # the keys are stored rotated
            scale = rotation_scales(dim)[0]
            q = (q.to(self.dtype).float() @ self.key_rotation * scale).to(q.dtype)
        return q, keys, values

    def update(
        self, layer: int, metadata: AttentionMetadata, k: Tensor, v: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Write the step's k, v (1, tokens, heads_kv, head_dim) into their slots and return
        layer `layer`'s block pools (num_blocks, block_size, heads_kv, head_dim)."""
        keys, values = self.keys[layer], self.values[layer]
        heads, dim = keys.shape[-2:]
        slots = metadata.slot_mapping
        k, v = k.reshape(-1, heads, dim).to(self.dtype), v.reshape(-1, heads, dim).to(self.dtype)
        quant = self._quant(layer)
        if quant:  # as rotary_paged_write stores them (its docstring)
            offset, k_scale, v_scale = quant
            at0 = (metadata.positions.reshape(-1) == 0)[:, None, None]
            first_key, first_value = self.first_offset[layer]
            k = k.float() - torch.where(at0, first_key, offset)
            v = v.float() - torch.where(at0, first_value, 0.0)
            if self.key_rotation is not None:
                k = k.to(self.dtype).float() @ self.key_rotation * rotation_scales(dim)[1]
            if self.kv_dtype == "int8":
                stored = []
                for x, pool in ((k, self.key_token_scale), (v, self.value_token_scale)):
                    scale = (x.abs().amax(-1) / INT8_MAX).half().float()
                    scale = torch.where(scale > 0, scale, 1.0)
                    pool[layer].view(-1, heads).index_copy_(0, slots, scale.half())
                    x = (x * (1 / scale)[..., None]).clamp(-INT8_MAX, INT8_MAX)
                    stored.append(torch.where(x < 0, x - 0.5, x + 0.5).trunc().to(torch.int8))
                keys.view(-1, heads, dim).index_copy_(0, slots, stored[0])
                values.view(-1, heads, dim).index_copy_(0, slots, stored[1])
                return keys, values
            k = (k * (1 / k_scale)[:, None]).clamp(-FP8_MAX, FP8_MAX)
            v = (v * (1 / v_scale)[:, None]).clamp(-FP8_MAX, FP8_MAX)
            # (index_copy_ has no fp8 kernel on a CPU: copy the bytes)
            k, v = k.to(keys.dtype).view(torch.uint8), v.to(values.dtype).view(torch.uint8)
            keys.view(torch.uint8).view(-1, heads, dim).index_copy_(0, slots, k)
            values.view(torch.uint8).view(-1, heads, dim).index_copy_(0, slots, v)
        else:
            keys.view(-1, heads, dim).index_copy_(0, slots, k)
            values.view(-1, heads, dim).index_copy_(0, slots, v)
        return keys, values

    # -- fp8 and int8 ---------------------------------------------------------------------------

    def _quant(self, layer: int) -> tuple[Tensor, Tensor, Tensor] | None:
        """(key_offset, k_scale, v_scale) of layer `layer` as rotary_paged_write takes them."""
        if not self.kv_dtype:
            return None
        return self.key_offset[layer], *self.kv_scales(layer)[:2]

    def kv_scales(self, layer: int) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
        """Layer `layer`'s (k_scale, v_scale, first_key, first_value) for the kernels that read
        its pools: fp8's scales (heads_kv,) each, int8's per-token pools (num_blocks + 1,
        block_size, heads_kv); the first position's correction (heads_kv, head_dim) each
        (memfit.ops.attention.paged_attention); None where the pools hold the compute dtype."""
        if not self.kv_dtype:
            return None
        if self.kv_dtype == "int8":
            scales = self.key_token_scale[layer], self.value_token_scale[layer]
        else:
            scales = self.key_scale[layer], self.value_scale[layer]
        return *scales, self.first_key[layer], self.first_value[layer]

    @torch.inference_mode()
    def calibrate(self, model: torch.nn.Module, rows: Sequence[Sequence[int]]) -> None:
        """Set the key offsets (and fp8's scales) of a quantized cache (module docstring) from
        `model`'s keys and values over token `rows` (a few hundred tokens do: any text, or random
        ids), computed in the compute dtype through a temporary cache: the offset from the
        positions after the first; `first_offset` from each row's first token (FIRST_SAMPLES
        rows or more; one-token rows add samples cheaply) and from it `first_key` and
        `first_value`, what the kernels add back at key 0. Call it before any
        sequence is stored: the blocks already written would not match."""
        if not self.kv_dtype:
            raise ValueError("calibrate is for a quantized cache (kv_dtype='fp8' or 'int8')")
        if self.tables:
            raise ValueError(f"calibrate before storing sequences; {len(self.tables)} are stored")
        if not rows or min(len(row) for row in rows) < 1:
            raise ValueError("calibrate needs at least one row of at least one token")
        from memfit.inference.paged import paged_step

        blocks = sum(self._blocks_for(len(row)) for row in rows)
        config = model.config
        temp = PagedKVCache(
            config, num_blocks=blocks, block_size=self.block_size, dtype=self.dtype,
            device=self.device,
        )  # fmt: skip
        for index, row in enumerate(rows):
            paged_step(model, temp, [index], [list(row)])
        taken = []
        for index, row in enumerate(rows):
            table = torch.tensor(temp.tables[index], device=self.device)
            taken.append(
                (temp.keys[:, table].flatten(1, 2)[:, : len(row)].float(),
                 temp.values[:, table].flatten(1, 2)[:, : len(row)].float())
            )  # fmt: skip
        keys = torch.cat([k for k, _ in taken], 1)  # (layers, tokens, heads, dim)
        values = torch.cat([v for _, v in taken], 1)
        first = torch.zeros(keys.shape[1], dtype=torch.bool, device=self.device)
        first[torch.tensor([0, *itertools.accumulate(map(len, rows))][:-1])] = True
        later = ~first if (~first).any() else first
        self.key_offset.copy_(keys[:, later].mean(1))
        # position 0's own offsets where its keys (values) sit apart from the others' and close
        # together (an attention sink), else the others' (FIRST_APART)
        for index, x, general in (
            (0, keys[:, first], self.key_offset),
            (1, values[:, first], torch.zeros_like(self.key_offset)),
        ):
            count = x.shape[1]
            own = x.mean(1)
            spread = (x - own[:, None]).square().sum(-1).mean(1) * count / max(count - 1, 1)
            apart = (x - general[:, None]).square().sum(-1).mean(1)
            use = (spread < FIRST_APART * apart) & (count >= FIRST_SAMPLES)
            self.first_offset[:, index].copy_(torch.where(use[..., None], own, general))
        at0 = first[None, :, None, None]
        keys = keys - torch.where(at0, self.first_offset[:, None, 0], self.key_offset[:, None])
        values = values - torch.where(at0, self.first_offset[:, None, 1], 0.0)
        if self.kv_dtype == "fp8":
            if self.key_rotation is not None:
                keys = keys @ self.key_rotation * rotation_scales(keys.shape[-1])[1]
            for scale, x in (
                (self.key_scale, keys),
                (self.value_scale, values),
            ):
                amax = x.abs().amax(dim=(1, 3)).clamp(min=1e-6)
                scale.copy_(torch.exp2(torch.ceil(torch.log2(HEADROOM * amax / FP8_MAX))))
        # (int8's scales are each token's)
        self._derive()

    CALIBRATION = ("key_offset", "key_scale", "value_scale", "first_offset", "key_rotation")
    """What `calibrate` sets (the rest is derived from them: `_derive`)."""

    def calibration(self) -> dict[str, Tensor | None]:
        """A copy of this quantized cache's calibration, for `load_calibration` on another cache
        of the same model and kind (key_rotation None where head_dim takes none)."""
        if not self.kv_dtype:
            raise ValueError("calibration is a quantized cache's (kv_dtype='fp8' or 'int8')")
        return {
            name: None if getattr(self, name) is None else getattr(self, name).clone()
            for name in self.CALIBRATION
        }

    def load_calibration(self, state: dict[str, Tensor | None]) -> None:
        """Set the calibration `calibration()` gave (or one of the same names and shapes), and
        what derives from it. Call it before any sequence is stored, as `calibrate`."""
        if not self.kv_dtype:
            raise ValueError("load_calibration is for a quantized cache (kv_dtype='fp8' or 'int8')")
        if self.tables:
            raise ValueError(
                f"load a calibration before storing sequences; {len(self.tables)} are stored"
            )
        if set(state) != set(self.CALIBRATION):
            raise ValueError(
                f"a calibration has {', '.join(self.CALIBRATION)}; got {', '.join(sorted(state))}"
            )
        for name in self.CALIBRATION:
            mine, theirs = getattr(self, name), state[name]
            if (mine is None) != (theirs is None) or (
                mine is not None and theirs.shape != mine.shape
            ):
                want = None if mine is None else tuple(mine.shape)
                got = None if theirs is None else tuple(theirs.shape)
                raise ValueError(f"calibration {name}: this cache holds {want}, got {got}")
        for name in self.CALIBRATION:
            if state[name] is not None:
                getattr(self, name).copy_(state[name])
        self._derive()

    def _derive(self) -> None:
        """What follows from the calibration: what the kernels add back at key 0, q . (first key
        offset - key offset), rotated as the keys are, and the first value offset, in the units
        of the stored keys and values; fp8's inverse scales for the paged write."""
        delta = self.first_offset[:, 0] - self.key_offset
        if self.key_rotation is not None:
            delta = delta @ self.key_rotation * rotation_scales(delta.shape[-1])[1]
        value = self.first_offset[:, 1]
        if self.kv_dtype == "fp8":
            delta, value = delta / self.key_scale[..., None], value / self.value_scale[..., None]
        self.first_key.copy_(delta)
        self.first_value.copy_(value)
        self.key_scale_inverse.copy_(1 / self.key_scale)
        self.value_scale_inverse.copy_(1 / self.value_scale)
