"""The paged KV cache: block bookkeeping (reference counts, reuse, waste), paged attention
against dense attention on scattered block tables, and generation of prompts of different
lengths in one batch token-identical to full recompute."""

import pytest
import torch

from memfit import functional as MF
from memfit.inference import BlockPool, OutOfBlocks, PagedKVCache, SamplingParams, generate_paged
from memfit.models import PRESETS, build_model
from memfit.nn import AttentionMetadata


def test_blocks_are_counted_shared_and_reused():
    pool = BlockPool(3)
    a, b = pool.allocate(), pool.allocate()
    pool.share(a)
    pool.release(a)
    assert pool.num_free == 1  # a is still held once
    pool.release(a)
    pool.release(b)
    assert pool.num_free == 3
    with pytest.raises(ValueError, match="already free"):
        pool.release(a)
    for _ in range(3):
        pool.allocate()
    with pytest.raises(OutOfBlocks, match="all 3 KV blocks"):
        pool.allocate()


def test_sequences_take_blocks_as_they_grow():
    config = PRESETS["tiny"]
    cache = PagedKVCache(config, num_blocks=4, block_size=4, dtype=torch.float32, device="cpu")
    # four blocks to hand out and the scratch block of captured decode steps
    assert cache.keys.shape == (config.num_layers, 5, 4, config.num_kv_heads, config.head_dim)
    assert cache.scratch_block == 4
    slots = cache.append(0, 6)  # two blocks, the second half full
    assert len(cache.tables[0]) == 2 and len(slots) == 6 and len(set(slots)) == 6
    assert cache.waste() == pytest.approx(2 / 8)
    cache.fork(0, 1)  # shares both blocks
    assert cache.pool.num_free == 2
    assert not cache.can_append(2, 9) and cache.can_append(2, 8)
    with pytest.raises(OutOfBlocks, match="2 of 4 blocks are free"):
        cache.append(2, 9)
    assert 2 not in cache.tables  # nothing changed
    cache.free(0)
    assert cache.pool.num_free == 2  # the fork still holds them
    cache.free(1)
    assert cache.pool.num_free == 4 and cache.waste() == 0.0


def test_budget_sizes_the_pool_and_says_when_nothing_fits():
    config = PRESETS["tiny"]
    per_block = PagedKVCache.bytes_per_block(config, 16, torch.bfloat16)
    assert per_block == 2 * config.num_layers * 16 * config.num_kv_heads * config.head_dim * 2
    # ten blocks and the scratch block
    cache = PagedKVCache.from_budget(config, 11 * per_block + 1, dtype=torch.bfloat16, device="cpu")
    assert cache.pool.num_blocks == 10
    with pytest.raises(ValueError, match="holds no block of 16 tokens"):
        PagedKVCache.from_budget(config, per_block - 1, dtype=torch.bfloat16, device="cpu")


@pytest.mark.parametrize(("heads", "heads_kv", "window"), [(4, 4, None), (8, 2, None), (4, 1, 5)])
def test_paged_attention_matches_dense_on_scattered_blocks(heads, heads_kv, window):
    """Three sequences of lengths 7, 1 and 12 in 4-token blocks scattered over the pool; the
    step's tokens (the last 3, 1 and 5 of each) attend to their own sequence only."""
    torch.manual_seed(0)
    dim, block, lengths, new = 16, 4, [7, 1, 12], [3, 1, 5]
    keys = [torch.randn(n, heads_kv, dim) for n in lengths]
    values = [torch.randn(n, heads_kv, dim) for n in lengths]
    queries = [torch.randn(m, heads, dim) for m in new]
    num_blocks = 12
    order = torch.randperm(num_blocks).tolist()
    key_pool = torch.zeros(num_blocks, block, heads_kv, dim)
    value_pool = torch.zeros_like(key_pool)
    tables, positions, seq_index = [], [], []
    for row, (n, m) in enumerate(zip(lengths, new, strict=True)):
        table = [order.pop() for _ in range(-(-n // block))]
        for p in range(n):
            key_pool[table[p // block], p % block] = keys[row][p]
            value_pool[table[p // block], p % block] = values[row][p]
        tables.append(table + [0] * (3 - len(table)))
        positions += range(n - m, n)
        seq_index += [row] * m
    metadata = AttentionMetadata(
        positions=torch.tensor(positions),
        block_table=torch.tensor(tables, dtype=torch.int32),
        seq_index=torch.tensor(seq_index),
        slot_mapping=torch.zeros(len(positions), dtype=torch.long),
    )
    q = torch.cat(queries)[None]  # (1, T, nh, hs)
    out = MF.attention(q, key_pool, value_pool, window=window, metadata=metadata)
    start = 0
    for row, m in enumerate(new):
        dense = MF.attention(
            queries[row][None], keys[row][None], values[row][None], window=window, backend="eager"
        )  # causal, bottom-right: the last m positions
        torch.testing.assert_close(out[0, start : start + m], dense[0], rtol=1e-5, atol=1e-5)
        start += m


@pytest.mark.parametrize(("block_size", "window"), [(4, None), (16, None), (4, 6)])
def test_generation_of_mixed_lengths_matches_full_recompute(block_size, window):
    config = PRESETS["tiny"].replace(sliding_window=window)
    model = build_model(config, seed=0).eval()
    generator = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(0, config.vocab_size, (n,), generator=generator).tolist() for n in (3, 17, 9)
    ]
    cache = PagedKVCache(
        config, num_blocks=32, block_size=block_size, dtype=torch.float32, device="cpu"
    )
    steps = 7
    out = generate_paged(model, prompts, cache, SamplingParams(max_tokens=steps))
    for prompt, got in zip(prompts, out, strict=True):
        sequence = torch.tensor([prompt])
        for _ in range(steps):  # greedy without a cache: the whole sequence each time
            with torch.no_grad():
                next_token = model(sequence)[:, -1].argmax(-1, keepdim=True)
            sequence = torch.cat([sequence, next_token], dim=1)
        assert got == sequence[0, len(prompt) :].tolist()
    assert cache.pool.num_free == 32 and not cache.tables  # every block given back


def test_a_row_stops_at_eos_and_leaves_the_batch():
    config = PRESETS["tiny"]
    model = build_model(config, seed=0).eval()
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    cache = PagedKVCache(config, num_blocks=16, block_size=4, dtype=torch.float32, device="cpu")
    greedy = generate_paged(model, prompts, cache, SamplingParams(max_tokens=6))
    eos = greedy[0][2]
    stopped = generate_paged(
        model, prompts, cache, SamplingParams(max_tokens=6, stop_token_ids=[eos])
    )
    assert stopped[0] == greedy[0][: greedy[0].index(eos)]
    expected = greedy[1][: greedy[1].index(eos)] if eos in greedy[1] else greedy[1]
    assert stopped[1] == expected
