"""Sparse attention patterns and block layouts (memfit.ops.attention.sparse): every layout,
expanded tile by tile with its kinds, sees exactly the pattern's token mask; no listed tile is
empty and every FULL tile is full; the transpose lists the same tiles; layouts grow linearly
with the sequence for the local patterns; bad numbers are refused with what is wrong."""

import pytest
import torch

from memfit.ops.attention import sparse
from memfit.ops.attention.sparse import CAUSAL, FULL, RULE

BLOCK = 16
PATTERNS = {
    "local causal": sparse.local(20),
    "local bidirectional": sparse.local(9, causal=False),
    "strided": sparse.strided(12),
    "strided bidirectional": sparse.strided(10, window=5, causal=False),
    "longformer start and middle": sparse.longformer(8, [0, 41]),
    "longformer causal": sparse.longformer(8, [0, 3, 50], causal=True),
    "bigbird": sparse.bigbird(8, [0, 33], random_blocks=2, block=BLOCK, seed=3),
    "bigbird causal": sparse.bigbird(8, [0], random_blocks=1, block=BLOCK, causal=True),
    "window of one (only itself)": sparse.local(1),
    # random and user blocks of 2 x 2 tiles
    "bigbird in larger blocks": sparse.bigbird(8, [0], 1, block=2 * BLOCK, seed=6),
    "bigbird causal in larger blocks": sparse.bigbird(
        8, [0], 2, block=2 * BLOCK, seed=7, causal=True
    ),
    "user blocks larger than the tiles": sparse.from_blocks(
        torch.eye(3, dtype=torch.int64).roll(1, 0) | torch.eye(3, dtype=torch.int64),
        block=2 * BLOCK,
        causal=True,
    ),
}


def expand(pattern, layout, seqlen):
    """The token mask a kernel computes from the layout: each listed tile by its kind."""
    i = torch.arange(seqlen)[:, None]
    j = torch.arange(seqlen)[None, :]
    kinds = layout.dense()[i // layout.block_m, j // layout.block_n]
    rule = sparse._rule(pattern, i, j, seqlen)  # (the token rule alone: no whole blocks)
    return (kinds == FULL) | ((kinds == RULE) & rule) | ((kinds == CAUSAL) & (j <= i))


@pytest.mark.parametrize("name", PATTERNS)
@pytest.mark.parametrize("seqlen", [77, 96])
@pytest.mark.parametrize("tile", [(BLOCK, BLOCK), (2 * BLOCK, BLOCK), (BLOCK, 2 * BLOCK)])
def test_the_layout_sees_exactly_the_patterns_tokens(name, seqlen, tile):
    """Square tiles (the forward's) and rectangles (the backward's dq and dk/dv programs)."""
    pattern = PATTERNS[name]
    bm, bn = tile
    if pattern.block is not None and pattern.block % max(tile):
        pytest.skip("the pattern's blocks are smaller than the tile")
    layout = sparse.block_layout(pattern, seqlen, bm, block_n=bn)
    mask = sparse.dense_mask(pattern, seqlen)  # (random and user blocks on their own grid)
    assert torch.equal(expand(pattern, layout, seqlen), mask)
    assert mask.any(1).all()  # every query sees a key (itself at least, here)
    tiles = layout.dense()
    assert tiles.shape == (-(-seqlen // bm), -(-seqlen // bn))
    for b in range(layout.tiles_m):  # no listed tile is empty; a FULL tile is full
        for c in range(layout.tiles_n):
            block = mask[b * bm : (b + 1) * bm, c * bn : (c + 1) * bn]
            if tiles[b, c] == -1:
                assert not block.any(), (b, c)
            else:
                assert block.any(), (b, c)
            if tiles[b, c] == FULL:
                assert block.all(), (b, c)


@pytest.mark.parametrize("name", PATTERNS)
def test_the_transpose_lists_the_same_tiles(name):
    block_n = 2 * BLOCK if (PATTERNS[name].block or 2 * BLOCK) % (2 * BLOCK) == 0 else BLOCK
    layout = sparse.block_layout(PATTERNS[name], 77, BLOCK, block_n=block_n)
    by_key = torch.full((layout.tiles_m, layout.tiles_n), -1, dtype=torch.int8)
    for c in range(layout.tiles_n):
        lo, hi = int(layout.t_indptr[0, c]), int(layout.t_indptr[0, c + 1])
        rows = layout.t_indices[0, lo:hi]
        assert torch.equal(rows, rows.sort().values)
        by_key[rows.long(), c] = layout.t_kinds[0, lo:hi].to(torch.int8)
    assert torch.equal(by_key, layout.dense())


def test_the_token_rules_are_the_documented_ones():
    n = 64
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    assert torch.equal(sparse.dense_mask(sparse.local(5), n), (j <= i) & (j >= i - 4))
    assert torch.equal(sparse.dense_mask(sparse.local(3, causal=False), n), (j - i).abs() <= 3)
    summary = (j + 1) % 8 == 0
    assert torch.equal(sparse.dense_mask(sparse.strided(8), n), (j <= i) & ((j >= i - 7) | summary))
    globals_ = torch.zeros(n, dtype=torch.bool)
    globals_[[0, 30]] = True
    expected = ((j - i).abs() <= 4) | globals_[:, None] | globals_[None, :]
    assert torch.equal(sparse.dense_mask(sparse.longformer(4, [30, 0]), n), expected)
    # dilated: |i - j| a multiple of k, at most `window` steps back
    expected = (j <= i) & ((i - j) % 4 == 0) & ((i - j) // 4 <= 3)
    assert torch.equal(sparse.dense_mask(sparse.dilated(4, window=3), n), expected)
    expected = (j <= i) & ((i - j) % 4 == 0)
    assert torch.equal(sparse.dense_mask(sparse.dilated(4), n), expected)


def test_a_dilated_layout_is_its_subsequences():
    """dilated(k): the layout of one interleaved subsequence, 1/k of the tokens: its tiles are
    about 1/k^2 of the undilated pattern's per subsequence, 1/k in all."""
    n, k = 1024, 4
    layout = sparse.block_layout(sparse.dilated(k), n, BLOCK)
    dense_causal = sparse.block_layout(sparse.local(n), n, BLOCK)
    assert layout.seqlen == n // k
    assert k * layout.nnz * 1.0 == pytest.approx(dense_causal.nnz / k, rel=0.1)


def test_random_blocks_are_seeded_and_never_repeat_a_tile():
    a = sparse.block_layout(sparse.bigbird(8, [0], 2, block=BLOCK, seed=1), 256, BLOCK)
    b = sparse.block_layout(sparse.bigbird(8, [0], 2, block=BLOCK, seed=1), 256, BLOCK)
    c = sparse.block_layout(sparse.bigbird(8, [0], 2, block=BLOCK, seed=2), 256, BLOCK)
    assert a is b  # cached per (pattern, shape, block, device)
    assert not torch.equal(a.indices, c.indices)
    band = sparse.block_layout(sparse.longformer(8, [0]), 256, BLOCK)
    # each query block gains 2 random tiles on top of what the rest lists (block 0, a global
    # token's, lists every tile already)
    free = (band.dense() == -1).sum(1)
    assert free[0] == 0 and a.nnz == band.nnz + int(free.clamp(max=2).sum()) == band.nnz + 30


def test_a_user_layout():
    blocks = torch.eye(4, dtype=torch.int64)
    blocks[3, 0] = 1
    pattern = sparse.from_blocks(blocks, block=BLOCK, causal=True)
    layout = sparse.block_layout(pattern, 60, BLOCK)
    assert torch.equal(layout.dense() >= 0, blocks.bool())
    assert layout.dense()[3, 0] == FULL and layout.dense()[1, 1] == CAUSAL


@pytest.mark.parametrize(
    "pattern",
    [sparse.local(256), sparse.longformer(128, [0, 9000]), sparse.bigbird(128, [0], 2, block=64)],
    ids=["local", "longformer", "bigbird"],
)
def test_layouts_grow_linearly_with_the_sequence(pattern):
    sizes = [sparse.block_layout(pattern, n, 64).nnz for n in (16384, 32768)]
    assert sizes[1] <= 2.1 * sizes[0]


@pytest.mark.parametrize(
    "build, seqlen, message",
    [
        (
            lambda: sparse.local(100),
            64,
            r"window \(99, 0\) reaches past the sequence \(64 tokens\)",
        ),
        (lambda: sparse.dilated(3), 64, "dilation 3 does not divide the sequence length 64"),
        (lambda: sparse.dilated(4, window=16), 64, r"reaches past the sequence \(16 steps"),
        (lambda: sparse.longformer(4, [70]), 64, r"global tokens \[70\] lie past the sequence"),
        (
            lambda: sparse.from_blocks(torch.ones(3, 3), block=16),
            64,
            "a block layout of 3 x 3 tiles does not match a sequence of 64 tokens in 16-token "
            r"tiles \(4 x 4\)",
        ),
        (
            lambda: sparse.bigbird(4, [0], 1, block=24),
            64,
            "the pattern's blocks are 24-token tiles, which 16-token tiles do not divide",
        ),
    ],
)
def test_numbers_that_do_not_fit_say_what_is_wrong(build, seqlen, message):
    with pytest.raises(ValueError, match=message):
        sparse.block_layout(build(), seqlen, BLOCK)


def test_bad_patterns_are_refused():
    with pytest.raises(ValueError, match="window right must be 0"):
        sparse.Pattern(window=(4, 4))
    with pytest.raises(ValueError, match="window must be >= 1"):
        sparse.local(0)
    with pytest.raises(ValueError, match="stride must be >= 2"):
        sparse.strided(1)
    with pytest.raises(ValueError, match="needs a window, strided columns"):
        sparse.Pattern()
    with pytest.raises(ValueError, match="say their size"):
        sparse.Pattern(window=(4, 0), random_blocks=2)


def test_keys_per_query_measure_a_patterns_work():
    """The planner's measure: about seqlen / 2 for a window as long as the sequence (dense
    causal), window + a tile for a local band, 1/k of that for dilated(k)."""
    n = 4096
    dense = sparse.keys_per_query(sparse.local(n), n)
    assert dense == pytest.approx(n / 2, rel=64 / n)
    assert 512 <= sparse.keys_per_query(sparse.local(512), n) <= 512 + 2 * 64
    assert sparse.keys_per_query(sparse.dilated(4), n) == pytest.approx(dense / 4, rel=0.05)
    extra = sparse.keys_per_query(sparse.bigbird(512, [0], 2, block=64), n)
    assert extra > sparse.keys_per_query(sparse.longformer(512, [0]), n)


def test_the_planner_counts_a_patterns_attention():
    import dataclasses

    from memfit.models import PRESETS

    model = PRESETS["llama-1b"]
    layers, heads, dim = model.num_layers, model.num_heads, model.head_dim
    local = dataclasses.replace(model, attention_pattern="local:512")
    keys = sparse.keys_per_query(sparse.local(512), 8192)
    assert local.spec.attention_forward_flops(8192) == 4 * layers * heads * dim * keys
    alternating = dataclasses.replace(local, pattern_layers="even")
    dense = model.spec.attention_forward_flops(8192)
    half = alternating.spec.attention_forward_flops(8192)
    assert half == pytest.approx((dense + local.spec.attention_forward_flops(8192)) / 2)


def test_a_layout_per_head():
    """bigbird(heads=4): the rule's tiles shared, each head its own random tiles (the first
    head's those of the shared layout with the same seed); a user layout per head."""
    shared = sparse.block_layout(sparse.bigbird(8, [0], 2, block=BLOCK, seed=7), 256, BLOCK)
    per_head = sparse.block_layout(
        sparse.bigbird(8, [0], 2, block=BLOCK, seed=7, heads=4), 256, BLOCK
    )
    assert per_head.heads == 4 and shared.heads == 1
    assert torch.equal(per_head.dense(0), shared.dense())
    assert not torch.equal(per_head.dense(1), per_head.dense(0))
    assert per_head.nnz == 4 * shared.nnz
    masks = sparse.dense_mask(sparse.bigbird(8, [0], 2, block=BLOCK, seed=7, heads=4), 256)
    assert masks.shape == (4, 256, 256) and not torch.equal(masks[0], masks[1])
    blocks = torch.stack([torch.eye(4, dtype=torch.int64), torch.ones(4, 4, dtype=torch.int64)])
    user = sparse.block_layout(sparse.from_blocks(blocks, block=BLOCK), 64, BLOCK)
    assert torch.equal(user.dense(0) >= 0, blocks[0].bool())
    assert torch.equal(user.dense(1) >= 0, blocks[1].bool())
    with pytest.raises(ValueError, match="per-head layouts come from random blocks"):
        sparse.Pattern(window=(4, 0), heads=2)


def test_a_dilated_pattern_takes_a_window_only():
    with pytest.raises(ValueError, match="dilation 2 takes a window only"):
        sparse.Pattern(window=(4, 0), stride=8, dilation=2)


def test_the_longest_rows_and_columns_come_first():
    """The kernels take query (key) blocks longest first: a global token's block, which sees
    (is seen by) every block, before the band's."""
    layout = sparse.block_layout(sparse.longformer(8, [40]), 160, BLOCK)
    counts = layout.indptr[0, 1:] - layout.indptr[0, :-1]
    assert layout.order[0] == 40 // BLOCK == layout.t_order[0]
    assert torch.equal(
        counts[layout.order.long()], counts.sort(descending=True, stable=True).values
    )
    assert sorted(layout.order.tolist()) == list(range(layout.tiles))
