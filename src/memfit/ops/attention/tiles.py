"""What the attention kernels share: casts and matrix products that behave under Triton's
interpreter, a sequence's bounds in a packed batch, the band of blocks a block must visit under
causal / sliding-window masks, and the one masked-load helper every tile load goes through."""

from memfit.ops._triton import round_to_bf16, tl, triton

NO_LIMIT = 1 << 30  # a window side that no sequence reaches


@triton.jit
def _to_dtype(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """Cast fp32 to the compute dtype, rounding to nearest even also under the interpreter."""
    if INTERPRET and dtype == tl.bfloat16:
        return round_to_bf16(x)
    return x.to(dtype)


@triton.jit
def _dot(a, b, acc, INTERPRET: tl.constexpr):
    """a @ b + acc with fp32 accumulation. Triton's interpreter multiplies bf16 operands wrongly
    (it has no bf16 arithmetic); there the operands, already bf16 values, are widened first. fp32
    operands multiply in full fp32 ("ieee"), not Triton's default tf32, as PyTorch's own fp32
    attention does (the paged kernels serve fp32 models too)."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _sequence(CU, off_b, seqlen, IS_VARLEN: tl.constexpr):
    """(first row, length) of sequence off_b: from cu_seqlens when packed, else (0, seqlen)."""
    if IS_VARLEN:
        start = tl.load(CU + off_b)
        return start, tl.load(CU + off_b + 1) - start
    return off_b * 0, seqlen  # a tensor, like the packed case's


@triton.jit
def _band(start, seqlen_other, shift, first, last, BLOCK: tl.constexpr, BLOCK_OTHER: tl.constexpr):
    """The runs of BLOCK-sized blocks (aligned to 0) along the other axis that a block of
    BLOCK_OTHER rows starting at `start` must visit, for a band where row r sees columns
    [r + shift - first, r + shift + last] (first/last = NO_LIMIT when unbounded) within
    [0, seqlen_other). Returns (lo, mid_lo, mid_hi, hi): masked [lo, mid_lo), unmasked
    [mid_lo, mid_hi) (every row of the block sees every column, all in bounds), masked [mid_hi, hi).
    """
    lo = tl.maximum(start + shift - first, 0)
    lo = (lo // BLOCK) * BLOCK
    hi = tl.minimum(start + BLOCK_OTHER + shift + last, seqlen_other)
    hi = tl.maximum(hi, lo)
    # first column every row sees: start + BLOCK_OTHER - 1 + shift - first, rounded up to a block
    mid_lo = tl.maximum(start + BLOCK_OTHER - 1 + shift - first, 0)
    mid_lo = tl.minimum(tl.maximum(((mid_lo + BLOCK - 1) // BLOCK) * BLOCK, lo), hi)
    # one past the last column every row sees, rounded down to a block
    mid_hi = tl.maximum(tl.minimum(start + shift + last + 1, seqlen_other), 0)
    mid_hi = tl.minimum(tl.maximum((mid_hi // BLOCK) * BLOCK, mid_lo), hi)
    return lo, mid_lo, mid_hi, hi


@triton.jit
def _load_tile(
    ptrs, rows_ok, d_ok, MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr
):
    """A (rows, BLOCK_D) tile of q, k, v or dout: bounds-checked where the block may cross the
    sequence end or the band's edge (MASKED), masked on the head dim only where it is padded
    (BLOCK_D != HEAD_DIM), and loaded without predicates otherwise. The flags are constexpr: each
    call compiles to exactly one of the three loads."""
    if MASKED:
        x = tl.load(ptrs, mask=rows_ok[:, None] & d_ok, other=0.0)
    elif BLOCK_D != HEAD_DIM:
        x = tl.load(ptrs, mask=d_ok, other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _load_rows(ptrs, rows_ok, other, MASKED: tl.constexpr):
    """A per-row vector (lse, delta): bounds-checked only where the block may cross the end."""
    if MASKED:
        x = tl.load(ptrs, mask=rows_ok, other=other)
    else:
        x = tl.load(ptrs)
    return x
