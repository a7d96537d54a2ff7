"""Sparse attention patterns and the block layouts a block-sparse FlashAttention walks.

A pattern says, token by token, which keys each query sees. A layout is the same at the
granularity of (block_m x block_n) tiles (square for the forward, rectangles for the backward's
programs): for each query block the key blocks that hold any allowed
pair (CSR: `indptr`, `indices`), and the transpose (for each key block the query blocks that
see it, which the dk/dv pass walks). Each listed tile has a kind:

    FULL    every pair of the tile is allowed (no mask is computed; only the sequence end)
    RULE    the pattern's token rule decides pair by pair (the band's edges, global tokens,
            strided columns inside a tile)
    CAUSAL  a whole-tile addition (a BigBird random block, a user layout's block) that crosses
            the causal diagonal: pairs with key <= query

Work is proportional to the listed tiles, so a pattern's cost is its layout's count of tiles.

Token rule (query i, key j, positions in the sequence), with `causal` requiring j <= i:

    in the band      i - left <= j <= i + right           (local / sliding window)
    global           i or j is one of `global_tokens`     (Longformer, BigBird: see and are seen
                                                          by every token)
    strided          (j + 1) % stride == 0                (Sparse Transformer's summary columns,
                                                          beside its local band)
    whole blocks     the tile is one of the pattern's random blocks (BigBird) or a user block

Dilated (atrous) attention, where i sees j when i - j is a multiple of k (within a window of
that many steps, if given), is not a rule here: it is local attention on the k interleaved
subsequences i = r, r + k, r + 2k, ... (`Pattern.dilation`), run as k shorter sequences, so its
work is 1/k of the undilated pattern's and not a dense masked band.

Builders (`local`, `dilated`, `strided`, `longformer`, `bigbird`, `from_blocks`) document their
parameters; `block_layout(pattern, seqlen, block, block_n=)` builds a layout once per shape and
caches it (keyed by the pattern, length, tile sizes and device); `dense_mask` is the (seqlen x seqlen)
reference for tests and small shapes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = [
    "BlockLayout",
    "Pattern",
    "bigbird",
    "parse",
    "block_layout",
    "dense_mask",
    "dilated",
    "from_blocks",
    "local",
    "longformer",
    "strided",
    "tile_for",
]

FULL, RULE, CAUSAL = 0, 1, 2
NO_LIMIT = 1 << 30  # a window side no sequence reaches (memfit.ops.attention.tiles's)
# query x key token pairs evaluated at once while classifying candidate tiles (bounds memory)
_PAIRS_PER_BATCH = 1 << 24


@dataclass(frozen=True)
class Pattern:
    """A sparse attention pattern (module docstring). Build one with the functions below.

    window: (left, right) of the local band in tokens, or None for no band; causal: keys after
    the query are never seen; stride: summary columns every `stride` tokens (0: none);
    global_tokens: positions that see and are seen by every token; random_blocks: key blocks per
    query block drawn at random (seeded) from those the rest leaves out; blocks: a user block
    layout, a tuple of rows of 0/1 (query blocks x key blocks), or one such per head; block: the
    size of the blocks that random_blocks and blocks are given in (required with either; a
    multiple of the kernels' tiles, which split each block); dilation: see
    the module docstring; heads: 1 for one layout shared by every head, else the number of
    query heads, each with its own random or user blocks (the rule's tiles are shared)."""

    causal: bool = True
    window: tuple[int, int] | None = None
    stride: int = 0
    global_tokens: tuple[int, ...] = ()
    random_blocks: int = 0
    seed: int = 0
    blocks: tuple[tuple[int, ...], ...] | None = field(default=None, repr=False)
    block: int | None = None
    dilation: int = 1
    heads: int = 1

    def __post_init__(self) -> None:
        if self.window is not None:
            left, right = self.window
            if left < 0 or right < 0:
                raise ValueError(f"window (left, right) must be >= 0, got {self.window}")
            if self.causal and right:
                raise ValueError(
                    f"a causal pattern sees no key after the query: window right must be 0, "
                    f"got {self.window}"
                )
        if self.heads < 1 or (
            self.heads > 1 and not (self.random_blocks or self.blocks is not None)
        ):
            raise ValueError(
                f"heads = {self.heads}: per-head layouts come from random blocks or a user "
                "layout per head (the token rule is the same for every head)"
            )
        if self.stride < 0 or self.random_blocks < 0 or self.dilation < 1:
            raise ValueError(
                f"stride and random_blocks must be >= 0 and dilation >= 1, got stride "
                f"{self.stride}, random_blocks {self.random_blocks}, dilation {self.dilation}"
            )
        if self.dilation > 1 and (
            self.stride or self.global_tokens or self.random_blocks or self.blocks is not None
        ):
            raise ValueError(
                f"dilation {self.dilation} takes a window only (the interleaved subsequences' "
                "band): no strided columns, global tokens or blocks"
            )
        if any(t < 0 for t in self.global_tokens):
            raise ValueError(f"global token positions must be >= 0, got {self.global_tokens}")
        if (self.random_blocks or self.blocks is not None) and self.block is None:
            raise ValueError("random_blocks and blocks are given in tiles: say their size (block)")
        if self.window is None and not (
            self.stride or self.global_tokens or self.random_blocks or self.blocks is not None
        ):
            raise ValueError(
                "a pattern needs a window, strided columns, global tokens or blocks (dense "
                "attention is memfit.flash_attention)"
            )
        # (hashed once: a user layout's rows are long, and every call looks its layout up)
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, f) for f in _FIELDS)))

    def __hash__(self) -> int:
        return self._hash

    @property
    def band(self) -> int | None:
        """W when the pattern is only a causal window of W tokens (`local(W)`): sliding-window
        attention, which the dense kernels and the paged decode run as such; else None."""
        plain = not (
            self.stride or self.global_tokens or self.random_blocks or self.blocks is not None
        )
        if self.causal and plain and self.dilation == 1 and self.window is not None:
            return self.window[0] + 1
        return None

    def check(self, seqlen: int, block: int) -> None:
        """Refuse what does not fit a sequence of `seqlen` tokens in tiles of `block`, saying
        which numbers disagree."""
        span = seqlen // self.dilation  # (a dilated window counts steps of its subsequence)
        if self.window is not None and NO_LIMIT not in self.window and max(self.window) >= span:
            what = (
                f"{span} steps of each dilated subsequence"
                if self.dilation > 1
                else (f"{seqlen} tokens")
            )
            raise ValueError(
                f"window {self.window} reaches past the sequence ({what}): use dense attention "
                "(memfit.flash_attention), or a smaller window"
            )
        if self.dilation > 1 and seqlen % self.dilation:
            raise ValueError(
                f"dilation {self.dilation} does not divide the sequence length {seqlen}: pad "
                f"the sequence to a multiple of {self.dilation}"
            )
        late = [t for t in self.global_tokens if t >= seqlen]
        if late:
            raise ValueError(f"global tokens {late} lie past the sequence ({seqlen} tokens)")
        if self.block is not None and self.block % block:
            raise ValueError(
                f"the pattern's blocks are {self.block}-token tiles, which {block}-token tiles "
                "do not divide"
            )
        if self.blocks is not None:
            block = self.block
            tiles = -(-seqlen // block)
            heads = self.blocks if self.heads > 1 else (self.blocks,)
            shapes = {(len(rows), len(rows[0]) if rows else 0) for rows in heads}
            shape = next(iter(shapes))
            if shapes != {(tiles, tiles)}:
                raise ValueError(
                    f"a block layout of {shape[0]} x {shape[1]} tiles does not match a sequence "
                    f"of {seqlen} tokens in {block}-token tiles ({tiles} x {tiles})"
                )


_FIELDS = (
    "causal", "window", "stride", "global_tokens", "random_blocks", "seed", "blocks", "block",
    "dilation", "heads",
)  # fmt: skip


def local(window: int, *, causal: bool = True) -> Pattern:
    """Each token sees the `window` nearest keys: causal, itself and the window - 1 before it;
    bidirectional, `window` on each side."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    return Pattern(causal=causal, window=(window - 1, 0) if causal else (window, window))


def dilated(dilation: int, *, window: int | None = None, causal: bool = True) -> Pattern:
    """Atrous attention: token i sees j when |i - j| is a multiple of `dilation` (and at most
    `window` such steps away, if given): local attention on the `dilation` interleaved
    subsequences, each 1/dilation of the sequence (module docstring)."""
    if dilation < 1:
        raise ValueError(f"dilation must be >= 1, got {dilation}")
    steps = NO_LIMIT if window is None else window
    if steps < 1:
        raise ValueError(f"window must be >= 1 step, got {window}")
    band = (steps, 0) if causal else (steps, steps)
    return Pattern(causal=causal, window=band, dilation=dilation)


def strided(stride: int, *, window: int | None = None, causal: bool = True) -> Pattern:
    """The Sparse Transformer's strided ("fixed") pattern: each token sees the `window`
    (default `stride`) tokens before it and every summary column (positions stride - 1,
    2 stride - 1, ...)."""
    if stride < 2:
        raise ValueError(f"stride must be >= 2, got {stride}")
    width = stride if window is None else window
    return Pattern(
        causal=causal, window=(width - 1, 0) if causal else (width, width), stride=stride
    )


def longformer(
    window: int, global_tokens: tuple[int, ...] | list[int], *, causal: bool = False
) -> Pattern:
    """Longformer: a sliding window (`window` on each side; causal, `window` before) plus
    global tokens (e.g. a CLS token, a question) that see and are seen by every token."""
    band = local(window, causal=causal).window
    return Pattern(causal=causal, window=band, global_tokens=tuple(sorted(set(global_tokens))))


def bigbird(
    window: int,
    global_tokens: tuple[int, ...] | list[int],
    random_blocks: int,
    *,
    block: int,
    seed: int = 0,
    causal: bool = False,
    heads: int = 1,
) -> Pattern:
    """BigBird: Longformer's window and global tokens, plus `random_blocks` key blocks of
    `block` tokens per query block, drawn with `seed` from the blocks the rest leaves out; with
    `heads` > 1, drawn for each query head apart."""
    band = local(window, causal=causal).window
    return Pattern(
        causal=causal, window=band, global_tokens=tuple(sorted(set(global_tokens))),
        random_blocks=random_blocks, seed=seed, block=block, heads=heads,
    )  # fmt: skip


def from_blocks(blocks: Tensor | list, *, block: int, causal: bool = False) -> Pattern:
    """A user layout: `blocks` (query blocks x key blocks), or (heads, query blocks, key
    blocks) for a layout per query head, of 0/1, each 1 a whole tile of `block` tokens seen
    (causal: its pairs with key <= query)."""
    rows = torch.as_tensor(blocks).to(torch.bool)
    if rows.ndim not in (2, 3):
        raise ValueError(
            f"a block layout is (query blocks, key blocks) or (heads, query blocks, key "
            f"blocks), got {tuple(rows.shape)}"
        )
    if not rows.any():
        raise ValueError("a block layout with no block sees nothing")
    nested = rows.int().tolist()
    heads = rows.shape[0] if rows.ndim == 3 else 1
    as_tuples = (
        tuple(tuple(tuple(r) for r in h) for h in nested)
        if rows.ndim == 3
        else tuple(tuple(r) for r in nested)
    )
    return Pattern(causal=causal, blocks=as_tuples, block=block, heads=heads)


# tile size of a spec's random blocks unless it says (memfit.ops.attention.block_sparse's GPU tile)
SPEC_BLOCK = 64


def tile_for(pattern: Pattern, preferred: int) -> int:
    """The kernel tile for `pattern`: `preferred` where it divides the pattern's blocks (a
    BigBird block of 128 runs as 2 x 2 tiles of 64), else the pattern's block."""
    if pattern.block is None or pattern.block % preferred == 0:
        return preferred
    return pattern.block


SPEC_HELP = (
    "local:W, strided:S[:window=W], dilated:K[:window=W], longformer:W:globals=0,17, "
    "bigbird:W:globals=0:random=R[:seed=N][:block=B], each causal unless ':bidirectional'"
)


def parse(spec: str) -> Pattern:
    """A pattern from its text form (a model config's `attention_pattern`, TOML): SPEC_HELP,
    e.g. "longformer:256:globals=0" or "bigbird:128:globals=0:random=2"."""
    kind, *rest = [part.strip() for part in spec.split(":")]
    options: dict[str, str] = {}
    numbers: list[str] = []
    for part in rest:
        if "=" in part:
            key, _, value = part.partition("=")
            options[key.strip()] = value.strip()
        elif part == "bidirectional":
            options["causal"] = "false"
        else:
            numbers.append(part)
    known = {"window", "globals", "random", "seed", "block", "causal"}
    try:
        if not numbers or len(numbers) > 1 or set(options) - known:
            raise ValueError
        size = int(numbers[0])
        causal = options.pop("causal", "true") != "false"
        window = int(options["window"]) if "window" in options else None
        tokens = [int(t) for t in options.get("globals", "").split(",") if t.strip()]
        if kind == "local" and not options:
            return local(size, causal=causal)
        if kind == "strided" and set(options) <= {"window"}:
            return strided(size, window=window, causal=causal)
        if kind == "dilated" and set(options) <= {"window"}:
            return dilated(size, window=window, causal=causal)
        if kind == "longformer" and set(options) <= {"globals"}:
            return longformer(size, tokens, causal=causal)
        if kind == "bigbird" and set(options) <= {"globals", "random", "seed", "block"}:
            return bigbird(
                size, tokens, int(options.get("random", "1")), causal=causal,
                seed=int(options.get("seed", "0")), block=int(options.get("block", SPEC_BLOCK)),
            )  # fmt: skip
    except (ValueError, KeyError) as error:
        if str(error) and not isinstance(error, KeyError) and "invalid literal" not in str(error):
            raise ValueError(f"attention pattern {spec!r}: {error}") from None
    raise ValueError(f"attention pattern {spec!r} is not one of: {SPEC_HELP}")


def _rule(pattern: Pattern, i: Tensor, j: Tensor, seqlen: int) -> Tensor:
    """The token rule (module docstring) for broadcastable query and key positions."""
    allowed = torch.zeros(
        torch.broadcast_shapes(i.shape, j.shape), dtype=torch.bool, device=i.device
    )
    if pattern.window is not None:
        left, right = pattern.window
        allowed |= (j >= i - left) & (j <= i + right)
    if pattern.stride:
        allowed |= (j + 1) % pattern.stride == 0
    if pattern.global_tokens:
        flags = torch.zeros(seqlen, dtype=torch.bool, device=i.device)
        flags[list(pattern.global_tokens)] = True
        allowed |= flags[i.clamp(max=seqlen - 1)] | flags[j.clamp(max=seqlen - 1)]
    if pattern.causal:
        allowed &= j <= i
    return allowed & (i < seqlen) & (j < seqlen)


@dataclass(frozen=True)
class BlockLayout:
    """The tiles a block-sparse kernel visits (module docstring), for one sequence length.

    Tiles are `block_m` queries x `block_n` keys (square for the forward; the backward's dq
    and dk/dv programs take rectangles); `tiles_m` query blocks, `tiles_n` key blocks.
    indptr (heads, tiles_m + 1) int32 and indices, kinds (heads, most entries) int32: in head
    h's layout (heads = 1: one shared by every head) query block b visits key blocks
    indices[h, indptr[h, b]:indptr[h, b + 1]] (ascending) with those kinds; t_indptr
    (heads, tiles_n + 1), t_indices, t_kinds: the same by key block (the query blocks that see
    it).
    order, t_order: (tiles,) int32, the query (key) blocks by their count of tiles over all
    heads, longest first: the order the kernels' programs take them in, so that a global
    token's long row or column starts first instead of last.
    global_flags: (seqlen,) int8, 1 at the pattern's global tokens (None without any)."""

    seqlen: int
    block_m: int
    block_n: int
    tiles_m: int
    tiles_n: int
    indptr: Tensor
    indices: Tensor
    kinds: Tensor
    t_indptr: Tensor
    t_indices: Tensor
    t_kinds: Tensor
    order: Tensor
    t_order: Tensor
    global_flags: Tensor | None = None

    @property
    def heads(self) -> int:
        return self.indptr.shape[0]

    @property
    def block(self) -> int:
        """The tile size of a square layout."""
        if self.block_m != self.block_n:
            raise ValueError(f"a layout of {self.block_m} x {self.block_n} tiles is not square")
        return self.block_m

    @property
    def tiles(self) -> int:
        """Query blocks (= key blocks of a square layout)."""
        return self.tiles_m

    @property
    def nnz(self) -> int:
        """Tiles visited, over every head's layout."""
        return int(self.indptr[:, -1].sum())

    @property
    def density(self) -> float:
        """The part of all (tiles_m x tiles_n) tiles that are visited (on average over
        heads)."""
        return self.nnz / (self.heads * self.tiles_m * self.tiles_n)

    def dense(self, head: int = 0) -> Tensor:
        """(tiles_m, tiles_n) int8 of head `head`'s layout: -1 where no tile is visited, else
        its kind."""
        out = torch.full((self.tiles_m, self.tiles_n), -1, dtype=torch.int8)
        indptr = self.indptr[head].cpu().long()
        count = int(indptr[-1])
        rows = torch.repeat_interleave(torch.arange(self.tiles_m), indptr[1:] - indptr[:-1])
        out[rows, self.indices[head, :count].cpu().long()] = (
            self.kinds[head, :count].cpu().to(torch.int8)
        )
        return out


def _stack(lists: list[tuple[Tensor, Tensor, Tensor]]) -> tuple[Tensor, Tensor, Tensor]:
    """Per-head CSR lists as (heads, tiles + 1) offsets and (heads, most entries) columns and
    kinds, padded with zeros past each head's own entries."""
    width = max(len(indices) for _, indices, _ in lists)
    indptr = torch.stack([p for p, _, _ in lists])
    indices = torch.zeros((len(lists), width), dtype=torch.int32)
    kinds = torch.zeros((len(lists), width), dtype=torch.int32)
    for h, (_, cols, kind) in enumerate(lists):
        indices[h, : len(cols)], kinds[h, : len(kind)] = cols, kind
    return indptr, indices, kinds


def _csr(
    rows: Tensor, cols: Tensor, kinds: Tensor, n_rows: int, n_cols: int
) -> tuple[Tensor, Tensor, Tensor]:
    order = torch.argsort(rows * n_cols + cols)
    rows, cols, kinds = rows[order], cols[order], kinds[order]
    counts = torch.bincount(rows, minlength=n_rows)
    indptr = torch.zeros(n_rows + 1, dtype=torch.int64, device=rows.device)
    indptr[1:] = torch.cumsum(counts, 0)
    return indptr.to(torch.int32), cols.to(torch.int32), kinds.to(torch.int32)


def _candidates(pattern: Pattern, seqlen: int, bm: int, bn: int, device) -> Tensor:
    """(n, 2) (query block, key block) pairs of (bm x bn)-token tiles that may hold an allowed
    pair under the rule: the band's tiles, the global tokens' rows and columns, the strided
    columns' tiles."""
    q = torch.arange(-(-seqlen // bm), device=device)
    k = torch.arange(-(-seqlen // bn), device=device)
    found = []
    if pattern.window is not None:
        left, right = pattern.window
        first = ((q * bm - left).clamp(min=0)) // bn
        last = ((q * bm + bm - 1 + right).clamp(max=seqlen - 1)) // bn
        width = int((last - first).max()) + 1
        cols = first[:, None] + torch.arange(width, device=device)[None, :]
        keep = cols <= last[:, None]
        found.append(torch.stack([q[:, None].expand_as(cols)[keep], cols[keep]], 1))
    columns = set()
    if pattern.stride:
        columns |= {c // bn for c in range(pattern.stride - 1, seqlen, pattern.stride)}
    columns |= {t // bn for t in pattern.global_tokens}
    if columns:
        cols = torch.tensor(sorted(columns), device=device)
        found.append(torch.cartesian_prod(q, cols))
    if pattern.global_tokens:
        rows = torch.tensor(sorted({t // bm for t in pattern.global_tokens}), device=device)
        found.append(torch.cartesian_prod(rows, k))
    if not found:
        return torch.zeros((0, 2), dtype=torch.long, device=device)
    pairs = torch.unique(torch.cat(found), dim=0)
    if pattern.causal:  # (a key block starting after the query block's last row: none)
        pairs = pairs[pairs[:, 1] * bn <= pairs[:, 0] * bm + bm - 1]
    return pairs


def _classify(
    pattern: Pattern, pairs: Tensor, seqlen: int, bm: int, bn: int
) -> tuple[Tensor, Tensor]:
    """For each candidate tile: whether any pair is allowed, and whether every in-bounds pair
    is (FULL; a tile the rule's union happens to fill may come out RULE, which masks nothing
    wrong). Decided from the tile's bounds where they suffice -- inside the band, or strictly
    below the causal diagonal (any tile, bidirectional) and touching the band, a strided
    column or a global token's row or column -- and token by token, in batches, for the rest
    (the diagonal's tiles): a 128k-token layout costs seconds, not minutes."""
    rows, cols = pairs[:, 0], pairs[:, 1]
    row_lo, row_hi = rows * bm, (rows * bm + bm - 1).clamp(max=seqlen - 1)
    col_lo, col_hi = cols * bn, (cols * bn + bn - 1).clamp(max=seqlen - 1)
    below = col_hi < row_lo if pattern.causal else torch.ones_like(rows, dtype=torch.bool)
    full = torch.zeros_like(below)
    touched = torch.zeros_like(below)
    if pattern.window is not None:
        left, right = pattern.window
        full = (col_lo - row_hi >= -left) & (col_hi - row_lo <= right)
        if pattern.causal:
            full &= col_hi <= row_lo
        touched |= (col_hi - row_lo >= -left) & (col_lo - row_hi <= right)
    if pattern.stride:
        first = (col_lo + pattern.stride) // pattern.stride * pattern.stride - 1  # (>= col_lo)
        touched |= first <= col_hi
    if pattern.global_tokens:
        row_tiles = torch.zeros(-(-seqlen // bm), dtype=torch.bool)
        row_tiles[[t // bm for t in pattern.global_tokens if t < seqlen]] = True
        col_tiles = torch.zeros(-(-seqlen // bn), dtype=torch.bool)
        col_tiles[[t // bn for t in pattern.global_tokens if t < seqlen]] = True
        touched |= col_tiles[cols] | row_tiles[rows]
    decided = full | (below & touched)
    any_allowed, all_allowed = decided.clone(), full.clone()
    rest = (~decided).nonzero().flatten()
    step = max(1, _PAIRS_PER_BATCH // (bm * bn))
    for start in range(0, len(rest), step):
        index = rest[start : start + step]
        chunk = pairs[index]
        i = (chunk[:, 0:1] * bm + torch.arange(bm)[None, :])[:, :, None]  # (n, bm, 1)
        j = (chunk[:, 1:2] * bn + torch.arange(bn)[None, :])[:, None, :]  # (n, 1, bn)
        allowed = _rule(pattern, i, j, seqlen)
        inside = (i < seqlen) & (j < seqlen)
        any_allowed[index] = allowed.flatten(1).any(1)
        all_allowed[index] = (allowed | ~inside).flatten(1).all(1)
    return any_allowed, all_allowed


def _whole_blocks(
    pattern: Pattern, taken: Tensor | None, tiles: int, head: int, generator: torch.Generator
) -> Tensor:
    """(n, 2) tiles added whole for query head `head`: the user layout's, and `random_blocks`
    per query block drawn (from `generator`, heads in order) from the tiles `taken` (tiles x
    tiles bool) leaves out."""
    if pattern.blocks is not None:
        blocks = pattern.blocks[head] if pattern.heads > 1 else pattern.blocks
        return torch.tensor(blocks, dtype=torch.bool).nonzero()
    chosen = []
    for row in range(tiles):
        free = (~taken[row]).nonzero().flatten()
        if pattern.causal:
            free = free[free <= row]
        picks = free[torch.randperm(len(free), generator=generator)[: pattern.random_blocks]]
        chosen += [(row, int(c)) for c in picks.sort().values]
    return torch.tensor(chosen, dtype=torch.long).reshape(-1, 2)


def block_layout(
    pattern: Pattern,
    seqlen: int,
    block: int,
    device: torch.device | str = "cpu",
    *,
    block_n: int | None = None,
) -> BlockLayout:
    """The layout of `pattern` for sequences of `seqlen` tokens in `block`-token tiles, on
    `device`; built once per (pattern, seqlen, block, block_n, device) and cached. A pattern's random or
    user blocks may be larger than the tiles (a multiple: each is listed as its tiles). For a
    dilated pattern the layout is the one each interleaved subsequence (seqlen / dilation
    tokens) uses. `block_n`: key blocks of another size (rectangular tiles of `block` queries x
    `block_n` keys, as the backward's programs take them)."""
    block_n = block_n or block
    pattern.check(seqlen, block)
    pattern.check(seqlen, block_n)
    return _block_layout(
        pattern, seqlen // pattern.dilation, block, block_n, str(torch.device(device))
    )


def _rule_tiles(pattern: Pattern, seqlen: int, bm: int, bn: int) -> tuple[Tensor, Tensor]:
    """(n, 2) tiles of (bm x bn) tokens holding a pair the token rule allows, and their kinds
    (FULL or RULE)."""
    pairs = _candidates(pattern, seqlen, bm, bn, "cpu")
    seen, whole = _classify(pattern, pairs, seqlen, bm, bn)
    return pairs[seen], torch.where(whole[seen], FULL, RULE)


@functools.lru_cache(maxsize=64)
def _block_layout(pattern: Pattern, seqlen: int, bm: int, bn: int, device: str) -> BlockLayout:
    if device != "cpu":  # (built once on the host: the planner's copy, then moved)
        host = _block_layout(pattern, seqlen, bm, bn, "cpu")
        return BlockLayout(**{
            name: value.to(device) if isinstance(value, Tensor) else value
            for name, value in vars(host).items()
        })  # fmt: skip
    tiles_m, tiles_n = -(-seqlen // bm), -(-seqlen // bn)
    rule_pairs, rule_kinds = _rule_tiles(pattern, seqlen, bm, bn)
    grid = pattern.block or bm  # (whole blocks are drawn on the pattern's grid of tiles)
    if pattern.random_blocks:
        same = grid == bm == bn
        grid_pairs = rule_pairs if same else _rule_tiles(pattern, seqlen, grid, grid)[0]
        taken = torch.zeros((-(-seqlen // grid),) * 2, dtype=torch.bool)
        taken[grid_pairs[:, 0], grid_pairs[:, 1]] = True
    generator = torch.Generator().manual_seed(pattern.seed)
    by_query, by_key = [], []
    for head in range(pattern.heads):
        pairs, kinds = rule_pairs, rule_kinds
        if pattern.random_blocks or pattern.blocks is not None:
            extra = _whole_blocks(pattern, taken if pattern.random_blocks else None,
                                  -(-seqlen // grid), head, generator)  # fmt: skip
            # each grid block as (grid / bm) x (grid / bn) kernel tiles
            offsets = torch.cartesian_prod(torch.arange(grid // bm), torch.arange(grid // bn))
            scale = torch.tensor([grid // bm, grid // bn])
            extra = (extra[:, None, :] * scale + offsets[None]).flatten(0, 1)
            extra = extra[(extra[:, 0] < tiles_m) & (extra[:, 1] < tiles_n)]
            if pattern.causal:  # (tiles wholly above the diagonal go)
                extra = extra[extra[:, 1] * bn <= extra[:, 0] * bm + bm - 1]
            # a whole tile replaces what the rule listed there; on the diagonal (causal) it is
            # masked by causality alone
            extra_kinds = torch.full((len(extra),), FULL, dtype=torch.long)
            if pattern.causal:
                extra_kinds[(extra[:, 1] + 1) * bn - 1 > extra[:, 0] * bm] = CAUSAL
            replaced = torch.zeros((tiles_m, tiles_n), dtype=torch.bool)
            replaced[extra[:, 0], extra[:, 1]] = True
            keep = ~replaced[pairs[:, 0], pairs[:, 1]]
            pairs = torch.cat([pairs[keep], extra])
            kinds = torch.cat([kinds[keep], extra_kinds])
        if not len(pairs):
            raise ValueError(f"{pattern} lets no token see any key in a sequence of {seqlen}")
        by_query.append(_csr(pairs[:, 0], pairs[:, 1], kinds, tiles_m, tiles_n))
        by_key.append(_csr(pairs[:, 1], pairs[:, 0], kinds, tiles_n, tiles_m))
    indptr, indices, kind = _stack(by_query)
    t_indptr, t_indices, t_kind = _stack(by_key)
    order, t_order = (
        torch.argsort(-(offsets[:, 1:] - offsets[:, :-1]).sum(0), stable=True).to(torch.int32)
        for offsets in (indptr, t_indptr)
    )
    move = functools.partial(Tensor.to, device=device)
    flags = None
    if pattern.global_tokens:
        flags = torch.zeros(seqlen, dtype=torch.int8)
        flags[list(pattern.global_tokens)] = 1
        flags = move(flags)
    return BlockLayout(
        seqlen=seqlen, block_m=bm, block_n=bn, tiles_m=tiles_m, tiles_n=tiles_n,
        indptr=move(indptr), indices=move(indices),
        kinds=move(kind), t_indptr=move(t_indptr), t_indices=move(t_indices),
        t_kinds=move(t_kind), order=move(order), t_order=move(t_order), global_flags=flags,
    )  # fmt: skip


def keys_per_query(pattern: Pattern, seqlen: int, block: int = SPEC_BLOCK) -> float:
    """The keys a block-sparse kernel multiplies per query, on average: the layout's tiles x
    block^2 / seqlen (over all `dilation` subsequences) -- the planner's measure of a pattern's
    attention FLOPs, which a dense causal layer spends on about seqlen / 2."""
    layout = block_layout(pattern, seqlen, tile_for(pattern, block))
    return pattern.dilation * layout.nnz / layout.heads * layout.block_m * layout.block_n / seqlen


def dense_mask(
    pattern: Pattern, seqlen: int, block: int | None = None, head: int | None = None
) -> Tensor:
    """(seqlen, seqlen) bool: which keys each query sees, token by token (tests, small shapes);
    a pattern with a layout per head: (heads, seqlen, seqlen), or head `head`'s. `block`: the
    tile size of random or user blocks (default the pattern's)."""
    block = block or pattern.block or 64
    pattern.check(seqlen, block)
    if pattern.heads > 1 and head is None:
        return torch.stack([dense_mask(pattern, seqlen, block, h) for h in range(pattern.heads)])
    if pattern.dilation > 1:  # i sees j within its own subsequence, at the subsequence's rule
        k = pattern.dilation
        inner = dense_mask(
            Pattern(causal=pattern.causal, window=pattern.window), seqlen // k, block
        )
        position = torch.arange(seqlen)
        same = position[:, None] % k == position[None, :] % k
        return same & inner[position[:, None] // k, position[None, :] // k]
    i = torch.arange(seqlen)[:, None]
    j = torch.arange(seqlen)[None, :]
    allowed = _rule(pattern, i, j, seqlen)
    if pattern.random_blocks or pattern.blocks is not None:
        layout = block_layout(pattern, seqlen, block)
        tiles = layout.dense(head or 0)
        whole = (tiles == FULL) | (tiles == CAUSAL)
        token_whole = whole[i // block, j // block]
        if pattern.causal:
            token_whole &= j <= i
        allowed |= token_whole
    return allowed
