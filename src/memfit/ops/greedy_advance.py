"""The end of a captured decode step: each greedy row's next token (the argmax of its logits)
written where the next step reads its token, and each live row's position, cache slot and
length advanced by one, so that the next step of the same sequences needs no input from the
host unless a sequence crossed into a new cache block. One kernel, launched with programmatic
dependent launch after the output projection.

Without it a step of one sequence spends about as long outside its graph as a layer inside it:
two host-to-device copies of its inputs and a transpose before the replay, an argmax after it,
each a launch whose start waits for the one before.

The decode rows (`rows`, int64, one column per row of the batch): 0 token, 1 position, 2 cache
slot, 3 sequence length (position + 1), 4 live (1 for a sequence, 0 for a padding row, which
stays where it is), 5 greedy (1: write the argmax into row 0). The argmax is split over the
vocabulary: each program reduces a slice to (value, index), packed so that a larger int64 is a
larger value or, on a tie, a smaller index, and takes the maximum with one atomic; the program
that finishes last (a counter per row) writes the token and resets both for the next step.
Ties go to the smallest index, as torch.argmax; NaN logits are passed over (a row of nothing but
NaN gives token 0).
"""

from __future__ import annotations

import torch
from torch import Tensor

from memfit.ops._triton import (
    gdc_launch_dependents,
    gdc_wait,
    launch,
    pdl_enabled,
    tl,
    triton,
    use_triton,
)

__all__ = ["greedy_advance", "argmax_scratch"]

_BLOCK_V = 4096  # vocabulary entries per program
_EMPTY = -(2**63)  # the packed maximum before any program has offered one


@triton.jit
def _greedy_advance_kernel(
    logits_ptr,
    rows_ptr,
    table_ptr,
    best_ptr,
    count_ptr,
    vocab,
    stride_logits,
    stride_rows,
    stride_table,
    width,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_V: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (row, vocabulary slice). Slice 0 advances the row."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0)
    part = tl.program_id(1)
    parts = tl.num_programs(1)
    if tl.load(rows_ptr + 5 * stride_rows + row) != 0:
        cols = part * BLOCK_V + tl.arange(0, BLOCK_V)
        x = tl.load(
            logits_ptr + row.to(tl.int64) * stride_logits + cols,
            mask=cols < vocab,
            other=float("-inf"),
        ).to(tl.float32)
        x = tl.where(x == x, x, float("-inf"))  # NaN: never the maximum
        top = tl.max(x, 0)
        index = tl.min(tl.where(x == top, cols, vocab), 0)
        index = tl.minimum(index, vocab - 1).to(tl.int64)  # (a slice of -inf: any entry)
        # fp32 bits, ordered as signed integers: negative values' magnitude bits flipped
        bits = top.to(tl.int32, bitcast=True)
        key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        low = tl.full([], 0xFFFFFFFF, tl.int64)
        packed = (key.to(tl.int64) << 32) | (low - index)
        tl.atomic_max(best_ptr + row, packed)
        if tl.atomic_add(count_ptr + row, 1) == parts - 1:  # the last slice of this row
            empty = tl.full([], -(2**62), tl.int64) * 2  # the smallest int64
            packed = tl.atomic_xchg(best_ptr + row, empty)
            tl.atomic_xchg(count_ptr + row, 0)
            tl.store(rows_ptr + row, low - (packed & low))
    if part == 0 and tl.load(rows_ptr + 4 * stride_rows + row) != 0:
        position = tl.load(rows_ptr + stride_rows + row) + 1
        column = tl.minimum(position // BLOCK_SIZE, width - 1)
        block = tl.load(table_ptr + row.to(tl.int64) * stride_table + column).to(tl.int64)
        tl.store(rows_ptr + stride_rows + row, position)
        tl.store(rows_ptr + 2 * stride_rows + row, block * BLOCK_SIZE + position % BLOCK_SIZE)
        tl.store(rows_ptr + 3 * stride_rows + row, position + 1)


def argmax_scratch(max_rows: int, device: torch.device) -> Tensor:
    """The split argmax's state for up to `max_rows` rows: (2, max_rows) int64, the packed
    maximum (reset) and the count of finished slices (zero). The kernel leaves it reset."""
    scratch = torch.zeros(2, max_rows, dtype=torch.long, device=device)
    scratch[0].fill_(_EMPTY)
    return scratch


def greedy_advance(
    logits: Tensor, rows: Tensor, block_table: Tensor, block_size: int, scratch: Tensor
) -> None:
    """In place on `rows` (6, >= batch) int64, row stride any, unit column stride: the argmax
    of `logits` (batch, vocab) into row 0 where row 5 is set, then position + 1, its slot in
    `block_table` (batch, width) int32 and length + 1 where row 4 is set (see the module's
    docstring). `scratch`: `argmax_scratch(>= batch)`. Triton where it runs, else torch."""
    batch, vocab = logits.shape
    if rows.shape[0] != 6 or rows.shape[1] < batch or rows.stride(1) != 1:
        raise ValueError(f"rows must be (6, >= {batch}) with unit column stride, got {rows.shape}")
    if use_triton(logits):
        logits = logits if logits.stride(1) == 1 else logits.contiguous()
        grid = (batch, triton.cdiv(vocab, _BLOCK_V))
        launch(
            _greedy_advance_kernel, grid, logits.device,
            logits, rows, block_table, scratch[0], scratch[1],
            vocab, logits.stride(0), rows.stride(0), block_table.stride(0), block_table.shape[1],
            BLOCK_SIZE=block_size, BLOCK_V=_BLOCK_V, PDL=pdl_enabled(logits.device),
        )  # fmt: skip
        return
    rows = rows[:, :batch]
    greedy = rows[5] != 0
    clean = logits.float().nan_to_num(nan=float("-inf"))
    rows[0] = torch.where(greedy, clean.argmax(dim=-1), rows[0])
    live = rows[4] != 0
    position = rows[1] + 1
    column = (position // block_size).clamp(max=block_table.shape[1] - 1)
    block = block_table[:batch].gather(1, column[:, None]).squeeze(1).long()
    rows[2] = torch.where(live, block * block_size + position % block_size, rows[2])
    rows[1] = torch.where(live, position, rows[1])
    rows[3] = torch.where(live, position + 1, rows[3])
