"""The matrix-vector product of a batch-1 decode step over a weight-only quantized W (int8 per
row, or int4 in groups, asymmetric: memfit.ops.quant), y = W x (+ b), with the SwiGLU before it
and the residual add after it folded in as memfit.ops.gemv does for bf16 weights.

At one token per step the product streams W once, so its time is W's bytes over the memory's
bandwidth: 1 byte a weight for int8 and 0.54 (4 bits and a group's scale and zero) for int4,
against 2 for bf16. At those rates the instructions that turn levels into numbers, not the
memory, bound the kernel, so each weight costs as few as the bits allow:

- int8 (`quantize_int8`, a scale per row): the byte, its sign bit flipped (q + 128), is put
  into the low mantissa bits of 2^23 (one logic instruction) and 2^23 + 128 is subtracted (one
  floating-point instruction); then a multiply-add with x. A program owns BLOCK_N rows and
  walks K in tiles of BLOCK_K features, sixteen a thread (one 16-byte load), W's bytes and x's
  values in one layout; each tile's products are summed over a thread's sixteen at once, so the
  accumulator is BLOCK_K / 16 values a row (a whole tile's accumulator held 16 times the
  registers and cut the programs an SM holds: the llama-3-8b decode step took 3.40 ms against
  3.14); a row's sum is scaled once at the end.
- int4 (`quantize_int4`, groups of 8 * WORDS features, eight levels a 32-bit word interleaved
  in the group): a tile is (BLOCK_N rows, BLOCK_K groups, WORDS words); nibble j of a group's
  words holds its features j * WORDS .. j * WORDS + WORDS - 1, so each nibble position
  multiplies a contiguous slice of x. A nibble masked in place (one logic instruction) is read
  as a float: the subnormal q 2^(4p - 149) for the nibble at bits 4p..4p+3 (p <= 5; nibbles 6
  and 7 after one shift of the word), and the multiply-add with x scaled by 2^(149 - 4p - 64)
  forms q x 2^-64 exactly. The zero point comes off once a word through the sum of x,
  (q - z) x = q x - z x, and the scale once a word. x's scaling and the sums are made once,
  by a small kernel before the product (`_int4_x_kernel`), not by each row's thread: that
  halves the instructions of the loop (3.7 a weight against 7.0, counted in the compiled
  code), which then waited on its loads, so two tiles of W were read ahead of the one in use.
  An A/B in llama-3-8b's batch-1 decode step on an H100: 3.07 ms against 3.18 for the kernel
  that scaled x in each thread and read one tile ahead (llama-3.2-3b: 1.78 against 1.76;
  results/quant_gemv_variants.json). One tile ahead since the rows-a-thread layout below
  (these fp32 products are CUDA's only for groups of 16 features).
- int4 on CUDA, in packed halves (`_int4_half_sums`, PTX): that loop still spent 131
  instructions on a thread's four words a tile and read x from L1 at four bytes a weight (the
  profiler: L1 85% busy, DRAM 50%). Two nibbles masked into the mantissas of the fp16 pair
  (1024, 1024) (one lop3) read as 1024 + q; one packed subtract of (1024 + z) (or multiply-add
  by 1/16 for the nibbles one place higher) leaves q - z exactly, and one packed multiply-add
  accumulates it times a pair of x: three instructions for two weights, the zero point taken off
  on the way, x read at two bytes a weight. A small kernel first scales each group's x by the
  power of two that puts its largest |x| in [128, 256) (bf16 values are exact in fp16 there)
  and packs the pairs (`_int4_half_x_kernel`); a thread's 32 products are summed in fp16 (below
  61440, no overflow), widened, and scaled by the group's scale over that power of two in fp32.
  109 instructions for the four words; llama-3-8b's batch-1 decode step on an H100 2.57 ms
  against 3.05 (results/quant_gemv_variants.json). Its error against fp64 is within the tests'
  bound (twice PyTorch's, dequantized to bf16 then the product; x from 1e-6 to 3e4): the fp16
  sums of 16 terms round at 2^-11, bf16 weights at 2^-9 (a CPU emulation put it at 0.7-0.85
  times PyTorch's mean error).
- Packed halves, rows in a thread (CONFIG["int4_half"]): with a warp to a row, eight warps read
  the same x (two bytes a weight, four times W's bytes) from L1. Now a thread holds four rows'
  16 bytes of one group and the threads lie along K (a tile of 2048 features, two warps), so x's
  pairs are read once for four rows; 73 instructions a thread's four words (109 before, counted
  in the compiled code). A row's few tiles (two for K = 4096) are not worth reading ahead (the
  registers cost more programs an SM), so the next tile is read ahead only where a row has
  INT4_AHEAD_TILES or more. SwiGLU's gate and up rows are taken together, one of each in turn,
  so all of a program's loads are issued at once. llama-3-8b's batch-1 decode step on an H200:
  2.21 ms against 2.35 (gate_up 24.4 us against 31.3).

Numerics: x widened to fp32, every product exact in fp32, sums in fp32, scales applied in
fp32, one rounding to the output dtype: more exact than multiplying by the weight dequantized
to bf16 (the reference that `dequantize` then F.linear computes), whose error against an fp32
product the tests bound it by. int4's scaling by 2^-64 is exact for |x| below 2^43 and sums
above 2^-62 (activations of a bf16 model are inside by far). The swiglu and residual folds
round each half and the product as the separate ops would (memfit.ops.gemv).

Under programmatic dependent launch (the engine's decode step) a program signals its
dependents at once, reads its first tile of W and waits for the kernel before it before
reading x; int4's x kernel does the same, so the product's first tile is read while x is made
ready.
"""

from __future__ import annotations

import torch
from torch import Tensor

from memfit.ops._triton import gdc_launch_dependents, gdc_wait, launch, pdl_enabled, tl, triton
from memfit.ops.gemv import _finish, check_one_row

__all__ = ["quant_gemv", "gemv_supported"]

# int8: (BLOCK_N, BLOCK_K, num_warps, num_stages); int4: (BLOCK_N, groups a tile, num_warps,
# num_stages). int8's: the fastest llama-3-8b batch-1 decode step of a sweep of 20 layouts and
# launch configurations, each captured in the step on an H100 (results/quant_gemv_variants.json):
# 3.14 ms against 3.40 for (2, 1024, 2, 1) with eight bytes a thread and the whole tile
# accumulated; its BLOCK_K falls to 1024 where 2048 does not divide K (llama-3.2-3b's 3072
# features: 1.66 ms against 1.82). int4's (8, 8, 8): the fastest of a sweep over llama-3-8b's
# four layers together, with x made ready by its own kernel (the fp32 products; CUDA takes them
# for groups of 16 features). int4 in packed halves: (rows a program, features a tile, warps,
# stages): four rows a thread, each 16 bytes of one group, 2048 features a tile (for groups of
# 128: a tile of 16 groups, two warps), the fastest of the 8-10 configurations swept on each of
# llama-3-8b's layers on an H200 (results/quant_gemv_variants.json).
CONFIG = {"int8": (2, 2048, 4, 1), "int4": (8, 8, 8, 1), "int4_half": (4, 2048, 2, 1)}
# int4: the next tile of W is read while the one before is summed where a row has this many
# tiles or more (llama-3-8b's down, 7 tiles: 14.7 us against 15.3; qkv, 2 tiles: 8.4 against
# 10.2, on an H200)
INT4_AHEAD_TILES = 4
# int4 products are formed at 2^-SHIFT (`_int4_products`): exact for |x| below 2^(SHIFT - 21),
# sums normal down to 2^(SHIFT - 126)
SHIFT = tl.constexpr(64)
_INTERPRET = {"int8": (4, 32, 1, 1), "int4": (4, 2, 1, 1)}
# int8: the bytes of W a thread reads at a time (one 16-byte load)
INT8_VEC = 16
# int4 on CUDA: products in packed fp16 pairs (`_int4_half_sums`); False: the fp32 products
INT4_HALF = True


@triton.jit
def _int8_cols(start, BLOCK_K: tl.constexpr, VEC: tl.constexpr):
    """A tile's features as (BLOCK_K / VEC, VEC): VEC a thread at a time, so that W's bytes and
    x's values take one layout (no exchange through shared memory)."""
    return start + tl.arange(0, BLOCK_K // VEC)[:, None] * VEC + tl.arange(0, VEC)[None, :]


@triton.jit
def _int8_w(w_rows, cols, rows_ok, K, EVEN: tl.constexpr):
    """The (BLOCK_N, BLOCK_K / 8, 8) int8 tile at `cols`, zeros past K."""
    if EVEN:
        return tl.load(w_rows + cols[None, :, :], mask=rows_ok[:, None, None], other=0)
    ok = rows_ok[:, None, None] & (cols < K)[None, :, :]
    return tl.load(w_rows + cols[None, :, :], mask=ok, other=0)


@triton.jit
def _int8_products(q, x_ptr, cols, K, EVEN: tl.constexpr):
    """q * x, (BLOCK_N, BLOCK_K / 8, 8) fp32: the byte, its sign bit flipped (q + 128), put in
    the mantissa of 2^23, and 2^23 + 128 taken off."""
    if EVEN:  # x as (1, BLOCK_K / 8, 8): the layout of q's tile
        x = tl.load(x_ptr + cols[None, :, :]).to(tl.float32)
    else:
        x = tl.load(x_ptr + cols[None, :, :], mask=(cols < K)[None, :, :], other=0.0)
        x = x.to(tl.float32)
    bits = (q.to(tl.int32) & 0xFF) ^ 0x4B000080
    return (bits.to(tl.float32, bitcast=True) - 8388736.0) * x


@triton.jit
def _int8_rows(
    x_ptr, w_ptr, s_ptr, rows, rows_ok, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    VEC: tl.constexpr, EVEN: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """W[rows] x for int8 W (N, K) with a scale per row: (BLOCK_N,) fp32. Each tile's products
    are summed over a thread's VEC features at once, so the accumulator holds BLOCK_K / VEC
    values a row, not BLOCK_K (fewer registers, more programs an SM). Under PDL the first tile
    of W is read before the wait for the kernel before."""
    w_rows = w_ptr + rows.to(tl.int64)[:, None, None] * K
    cols = _int8_cols(0, BLOCK_K, VEC)
    q = _int8_w(w_rows, cols, rows_ok, K, EVEN)
    if PDL:
        gdc_wait()
    acc = tl.sum(_int8_products(q, x_ptr, cols, K, EVEN), axis=2)
    for start in range(BLOCK_K, K, BLOCK_K):
        cols = _int8_cols(start, BLOCK_K, VEC)
        q = _int8_w(w_rows, cols, rows_ok, K, EVEN)
        acc += tl.sum(_int8_products(q, x_ptr, cols, K, EVEN), axis=2)
    return tl.sum(acc, axis=1) * tl.load(s_ptr + rows, mask=rows_ok, other=0.0)


@triton.jit
def _int4_tile(
    w_rows, s_ptr, z_ptr, s_rows, g, rows_ok, groups, WORDS: tl.constexpr, EVEN: tl.constexpr
):  # fmt: skip
    """The (BLOCK_N, TILE_GROUPS, WORDS) words of groups g, their scales and their zero points
    (uint8), (BLOCK_N, TILE_GROUPS); zeros past the last group."""
    if EVEN:
        ok = rows_ok[:, None] & (g >= 0)[None, :]
    else:
        ok = rows_ok[:, None] & (g < groups)[None, :]
    # W is read once a step: first out of the caches, so that x and the scales stay
    w = tl.load(
        w_rows + g[None, :, None] * WORDS, mask=ok[:, :, None], other=0,
        eviction_policy="evict_first",
    )  # fmt: skip
    scale = tl.load(s_ptr + s_rows + g[None, :], mask=ok, other=0.0)
    zero = tl.load(z_ptr + s_rows + g[None, :], mask=ok, other=0)
    return w, scale, zero


@triton.jit
def _int4_x_kernel(
    x_ptr, xs_ptr, xsum_ptr, K, groups, WORDS: tl.constexpr, GROUPS: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """x made ready for the int4 product, once for all the rows that use it: xs (K,) fp32, each
    feature scaled by 2^(149 - 4p - SHIFT) for the nibble position p its level is read at
    (`_int4_products`), and xsum (groups * WORDS,) fp32, each word's eight features summed
    (times 2^-SHIFT) to take the zero points off. A program takes GROUPS groups, as (GROUPS,
    8 nibbles, WORDS)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    g = tl.program_id(0) * GROUPS + tl.arange(0, GROUPS)
    j = tl.arange(0, 8)
    word = tl.arange(0, WORDS)
    feats = g[:, None, None] * (8 * WORDS) + j[None, :, None] * WORDS + word[None, None, :]
    ok = feats < K
    x = tl.load(x_ptr + feats, mask=ok, other=0.0).to(tl.float32)
    # nibbles 6 and 7 are read at bits 16-23 (after a shift of the word by 8): p = j - 2
    p = tl.where(j < 6, j, j - 2)
    # 2^(149 - 4p - SHIFT) exactly: its biased exponent in the bits of a float
    power = ((-4 * p + (127 + 149 - SHIFT)) << 23).to(tl.float32, bitcast=True)
    tl.store(xs_ptr + feats, x * power[None, :, None], mask=ok)
    xsum = tl.sum(x, axis=1) * 2.0**-SHIFT
    tl.store(xsum_ptr + g[:, None] * WORDS + word[None, :], xsum, mask=(g < groups)[:, None])


def _half_asm_word(k: int) -> str:
    """PTX for word k of the four (operand $1 + k): its four nibble pairs, each made q - z
    (lop3, then sub.f16x2 or, one nibble higher, fma.rn.f16x2 by 1/16 = r16) and multiplied
    into acc with x's pair $5 + 4k + p (the first product of word 0 starts acc)."""
    w, x = f"${1 + k}", [f"${5 + 4 * k + p}" for p in range(4)]
    first = f"mul.f16x2 acc, v, {x[0]}; " if k == 0 else f"fma.rn.f16x2 acc, v, {x[0]}, acc; "
    return (
        f"lop3.b32 v, {w}, 0x000F000F, 0x64006400, 0xEA; sub.f16x2 v, v, $21; {first}"
        f"lop3.b32 v, {w}, 0x00F000F0, 0x64006400, 0xEA; fma.rn.f16x2 v, v, r16, $22; "
        f"fma.rn.f16x2 acc, v, {x[1]}, acc; shr.b32 s, {w}, 8; "
        f"lop3.b32 v, s, 0x000F000F, 0x64006400, 0xEA; sub.f16x2 v, v, $21; "
        f"fma.rn.f16x2 acc, v, {x[2]}, acc; "
        f"lop3.b32 v, s, 0x00F000F0, 0x64006400, 0xEA; fma.rn.f16x2 v, v, r16, $22; "
        f"fma.rn.f16x2 acc, v, {x[3]}, acc; "
    )


# The packed-half int4 product of one thread's four words of a group (PTX), `_int4_half_sums`:
# operands $1-$4 the words, $5 + 4k + p the fp16 pair of x that pair p of word k multiplies, $21
# the pair (1024 + z, 1024 + z), $22 (-(64 + z), -(64 + z)); $0 the fp32 sum of the 32 products.
_HALF_ASM = tl.constexpr(
    "{ .reg .b32 v, s, acc, r16; .reg .f16 lo, hi; .reg .f32 flo, fhi; "
    "mov.b32 r16, 0x2C002C00; "
    + "".join(_half_asm_word(k) for k in range(4))
    + "mov.b32 {lo, hi}, acc; cvt.f32.f16 flo, lo; cvt.f32.f16 fhi, hi; add.f32 flo, flo, fhi; "
    "mov.b32 $0, flo; }"
)
_HALF_CONSTRAINTS = tl.constexpr("=r," + ",".join(["r"] * 22))
# -(64 + z) as fp16 in both halves: 0xD400 | z << 4
_MINUS_64 = tl.constexpr(-738143232)  # 0xD400D400 as int32


@triton.jit
def _int4_half_x_kernel(
    x_ptr, xh_ptr, xinv_ptr, K, groups, WORDS: tl.constexpr, GROUPS: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """x made ready for the packed-half int4 product (`_int4_half_sums`): xh (groups, 4, WORDS)
    int32, each an fp16 pair (low: feature p * WORDS + c of the group, high: (p + 4) * WORDS + c,
    the features nibbles p and p + 4 of the group's word c multiply), the group's x scaled by a
    power of two that puts its largest |x| in [128, 256) (bf16 values are exact in fp16 there,
    and sixteen products of levels below 16 stay below fp16's largest); xinv (groups,) fp32, the
    power of two that undoes it. A program takes GROUPS groups, as (GROUPS, 4 pairs, WORDS)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    g = tl.program_id(0) * GROUPS + tl.arange(0, GROUPS)
    inside = tl.arange(0, 4)[None, :, None] * WORDS + tl.arange(0, WORDS)[None, None, :]
    feats = g[:, None, None] * (8 * WORDS) + inside
    ok = feats < K
    lo = tl.load(x_ptr + feats, mask=ok, other=0.0).to(tl.float32)
    hi = tl.load(x_ptr + feats + 4 * WORDS, mask=ok, other=0.0).to(tl.float32)
    top = tl.maximum(tl.max(tl.max(tl.abs(lo), axis=2), axis=1),
                     tl.max(tl.max(tl.abs(hi), axis=2), axis=1))  # fmt: skip
    # top in [2^(e - 127), 2^(e - 126)) for its biased exponent e; 2^(134 - e) takes it to
    # [128, 256) (e kept where both powers are normal floats)
    e = tl.minimum(tl.maximum((top.to(tl.int32, bitcast=True) >> 23) & 0xFF, 8), 254)
    up = ((261 - e) << 23).to(tl.float32, bitcast=True)[:, None, None]
    lo16 = (lo * up).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hi16 = (hi * up).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
    tl.store(xh_ptr + g[:, None, None] * (4 * WORDS) + inside, lo16 | (hi16 << 16), mask=ok)
    tl.store(xinv_ptr + g, ((e - 7) << 23).to(tl.float32, bitcast=True), mask=g < groups)


@triton.jit
def _int4_products(w, xs_ptr, xsum_ptr, g, groups, WORDS: tl.constexpr, EVEN: tl.constexpr):
    """Over each word's eight nibbles, (sum of q x, sum of x), both times 2^-SHIFT:
    (BLOCK_N, TILE_GROUPS, WORDS) and (1, TILE_GROUPS, WORDS) fp32, from x as `_int4_x_kernel`
    leaves it. A nibble masked in place reads as the float q 2^(4p - 149) for the nibble at
    bits 4p..4p+3 (subnormal, or for p = 5 and q >= 8 the normal 2^-126 + (q - 8) 2^-129, the
    same value); x scaled by 2^(149 - 4p - SHIFT) makes the product q x 2^-SHIFT, exact inside
    the multiply-add: one logic instruction and one multiply-add a weight. Nibbles 0-5 are read
    in place, 6 and 7 after one shift of the word by 8 bits."""
    # nibble j multiplies xs at x_tile + j * WORDS, in the layout of w's tile
    cols = (g[:, None] * WORDS + tl.arange(0, WORDS)[None, :])[None, :, :]
    x_tile = xs_ptr + (g[:, None] * (8 * WORDS) + tl.arange(0, WORDS)[None, :])[None, :, :]
    g_ok = (g < groups)[None, :, None]
    part = tl.zeros(w.shape, dtype=tl.float32)
    for j in tl.static_range(8):
        if EVEN:
            x = tl.load(x_tile + j * WORDS)
        else:
            x = tl.load(x_tile + j * WORDS, mask=g_ok, other=0.0)
        if j < 6:
            level = (w & (15 << (4 * j))).to(tl.float32, bitcast=True)
        else:  # nibbles 6 and 7 at bits 16-23
            level = ((w >> 8) & (15 << (4 * (j - 2)))).to(tl.float32, bitcast=True)
        part += level * x
    if EVEN:
        xsum = tl.load(xsum_ptr + cols)
    else:
        xsum = tl.load(xsum_ptr + cols, mask=g_ok, other=0.0)
    return part, xsum


@triton.jit
def _int4_rows(
    xs_ptr, xsum_ptr, w_ptr, s_ptr, z_ptr, rows, rows_ok, words_per_row, groups,
    BLOCK_N: tl.constexpr, TILE_GROUPS: tl.constexpr, WORDS: tl.constexpr, EVEN: tl.constexpr,
    PDL: tl.constexpr, HALF: tl.constexpr, AHEAD: tl.constexpr,
):  # fmt: skip
    """W[rows] x for int4 W (N, K) in groups of 8 * WORDS features: (BLOCK_N,) fp32. A tile is
    (BLOCK_N, TILE_GROUPS, WORDS) words; nibble j of a group's words multiplies the group's
    features j * WORDS .. j * WORDS + WORDS - 1 (memfit.ops.quant.int4); a group's sums are
    scaled once a word. AHEAD: the next tile is read before the one in use is summed (past the
    end: EVEN reads the last one again, unused; else masked off). Under PDL the first tile is
    read before the wait either way (llama-3-8b's decode step on an H200: 2.151 ms against 2.210
    with the wait first where no tile is read ahead)."""
    rows64 = rows.to(tl.int64)
    w_rows = w_ptr + rows64[:, None, None] * words_per_row + tl.arange(0, WORDS)[None, None, :]
    s_rows = rows64[:, None] * groups
    g = tl.arange(0, TILE_GROUPS)
    if HALF:  # a sum for each thread's four words of a group
        acc = tl.zeros((BLOCK_N, TILE_GROUPS, WORDS // 4), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, TILE_GROUPS, WORDS), dtype=tl.float32)
    w, scale, zero = _int4_tile(w_rows, s_ptr, z_ptr, s_rows, g, rows_ok, groups, WORDS, EVEN)
    if PDL:
        gdc_wait()
    if AHEAD:
        for first in range(TILE_GROUPS, groups + TILE_GROUPS, TILE_GROUPS):
            next_g = (tl.minimum(first, groups - TILE_GROUPS) if EVEN else first) + tl.arange(
                0, TILE_GROUPS
            )  # fmt: skip
            w1, scale1, zero1 = _int4_tile(
                w_rows, s_ptr, z_ptr, s_rows, next_g, rows_ok, groups, WORDS, EVEN
            )  # fmt: skip
            acc += _int4_group_sums(w, scale, zero, xs_ptr, xsum_ptr, g, groups, WORDS, EVEN, HALF)
            w, scale, zero, g = w1, scale1, zero1, next_g
    else:  # each tile after the first read as it is summed
        acc += _int4_group_sums(w, scale, zero, xs_ptr, xsum_ptr, g, groups, WORDS, EVEN, HALF)
        for first in range(TILE_GROUPS, groups, TILE_GROUPS):
            tile_g = first + g
            w, scale, zero = _int4_tile(
                w_rows, s_ptr, z_ptr, s_rows, tile_g, rows_ok, groups, WORDS, EVEN
            )  # fmt: skip
            acc += _int4_group_sums(
                w, scale, zero, xs_ptr, xsum_ptr, tile_g, groups, WORDS, EVEN, HALF
            )  # fmt: skip
    y = tl.sum(tl.sum(acc, axis=2), axis=1)
    if not HALF:
        y = y * 2.0**SHIFT
    return y


@triton.jit
def _int4_group_sums(
    w, scale, zero, xs_ptr, xsum_ptr, g, groups, WORDS: tl.constexpr, EVEN: tl.constexpr,
    HALF: tl.constexpr,
):  # fmt: skip
    """scale (q - z) x summed over each word's nibbles, times 2^-SHIFT; HALF: over each thread's
    four words of a group, in packed halves (`_int4_half_sums`, x as `_int4_half_x_kernel`
    leaves it in xs_ptr and xsum_ptr)."""
    if HALF:
        sums = _int4_half_sums(w, scale, zero, xs_ptr, xsum_ptr, g, groups, WORDS, EVEN)
    else:
        part, xsum = _int4_products(w, xs_ptr, xsum_ptr, g, groups, WORDS, EVEN)
        sums = (part - zero.to(tl.float32)[:, :, None] * xsum) * scale[:, :, None]
    return sums


@triton.jit
def _quarters(t):
    """A (..., WORDS) tile whose WORDS a thread holds four at a time as four (..., WORDS / 4)
    tiles, one a word of the four (the same split for every tile, so they stay matched)."""
    a, b = tl.split(tl.reshape(t, (t.shape[0], t.shape[1], t.shape[2] // 4, 2, 2)))
    t0, t1 = tl.split(a)
    t2, t3 = tl.split(b)
    return t0, t1, t2, t3


@triton.jit
def _int4_half_x(xh_ptr, xinv_ptr, g, groups, WORDS: tl.constexpr, EVEN: tl.constexpr):
    """x's four pairs for groups g, (1, TILE_GROUPS, WORDS) int32 each, and xinv (TILE_GROUPS,)
    (`_int4_half_x_kernel`); zeros past the last group."""
    x_tile = xh_ptr + (g[:, None] * (4 * WORDS) + tl.arange(0, WORDS)[None, :])[None, :, :]
    g_ok, zero = (None, None) if EVEN else ((g < groups)[None, :, None], 0)
    x0 = tl.load(x_tile, mask=g_ok, other=zero)
    x1 = tl.load(x_tile + WORDS, mask=g_ok, other=zero)
    x2 = tl.load(x_tile + 2 * WORDS, mask=g_ok, other=zero)
    x3 = tl.load(x_tile + 3 * WORDS, mask=g_ok, other=zero)
    xinv = tl.load(xinv_ptr + g, mask=None if EVEN else g < groups, other=zero)
    return x0, x1, x2, x3, xinv


@triton.jit
def _int4_half_sums(
    w, scale, zero, xh_ptr, xinv_ptr, g, groups, WORDS: tl.constexpr, EVEN: tl.constexpr
):  # fmt: skip
    """scale (q - z) x summed over each thread's four words of a group, in packed halves (PTX,
    CUDA only): (BLOCK_N, TILE_GROUPS, WORDS / 4) fp32, from x as `_int4_half_x_kernel` leaves
    it. A pair of nibbles masked into the mantissas of (1024, 1024) (one lop3) reads as
    (1024 + q, 1024 + q') or, one nibble higher, (1024 + 16q, ...); one packed subtract (or
    multiply-add by 1/16) leaves the exact q - z, and one packed multiply-add accumulates it times
    x's pair: three instructions for two weights. The 32 products of the four words are summed
    in fp16 (below 61440: |q - z| < 16, |x| < 256), then widened, scaled by the group's scale
    and x's power of two in fp32."""
    x0, x1, x2, x3, xinv = _int4_half_x(xh_ptr, xinv_ptr, g, groups, WORDS, EVEN)
    w0, w1, w2, w3 = _quarters(w)
    a00, a01, a02, a03 = _quarters(x0)
    a10, a11, a12, a13 = _quarters(x1)
    a20, a21, a22, a23 = _quarters(x2)
    a30, a31, a32, a33 = _quarters(x3)
    z = zero.to(tl.int32) * 65537
    z_lo = (z | 0x64006400)[:, :, None]
    z_hi = ((z << 4) | _MINUS_64)[:, :, None]
    part = tl.inline_asm_elementwise(
        _HALF_ASM, _HALF_CONSTRAINTS,
        [w0, w1, w2, w3,
         a00, a10, a20, a30,  # word 0's four pairs of x
         a01, a11, a21, a31,
         a02, a12, a22, a32,
         a03, a13, a23, a33,
         z_lo, z_hi],
        dtype=tl.int32, is_pure=True, pack=1,
    ).to(tl.float32, bitcast=True)  # fmt: skip
    return part * (scale * xinv[None, :])[:, :, None]


@triton.jit
def _rows(
    x_ptr, xsum_ptr, w_ptr, s_ptr, z_ptr, rows, rows_ok, K, words_per_row, groups,
    BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WORDS: tl.constexpr,
    VEC: tl.constexpr, EVEN: tl.constexpr, PDL: tl.constexpr, HALF: tl.constexpr,
    AHEAD: tl.constexpr,
):  # fmt: skip
    if BITS == 8:
        y = _int8_rows(
            x_ptr, w_ptr, s_ptr, rows, rows_ok, K, BLOCK_N, BLOCK_K, VEC, EVEN, PDL
        )  # fmt: skip
    else:
        y = _int4_rows(
            x_ptr, xsum_ptr, w_ptr, s_ptr, z_ptr, rows, rows_ok, words_per_row, groups,
            BLOCK_N, BLOCK_K, WORDS, EVEN, PDL, HALF, AHEAD,
        )  # fmt: skip
    return y


@triton.jit
def _quant_gemv_kernel(
    x_ptr, xsum_ptr, w_ptr, s_ptr, z_ptr, b_ptr, r_ptr, y_ptr, N, K, words_per_row, groups,
    up_rows, BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WORDS: tl.constexpr,
    VEC: tl.constexpr, EVEN: tl.constexpr, HAS_BIAS: tl.constexpr,
    RESIDUAL: tl.constexpr, SWIGLU: tl.constexpr, ROUND_BF16_BY_HAND: tl.constexpr,
    PDL: tl.constexpr, HALF: tl.constexpr, AHEAD: tl.constexpr,
):  # fmt: skip
    """y[rows] for this program's BLOCK_N rows of N. int8: BLOCK_K features a tile (xsum_ptr
    unused); int4: BLOCK_K groups of 8 * WORDS features a tile, x and xsum as `_int4_x_kernel`
    leaves them. SWIGLU: W is (2N, K), gate rows then up rows (up_rows = N), and y = silu(gate)
    * up of the program's rows of each half; int4 takes the gate and up rows together, one of
    each in turn (BLOCK_N / 2 outputs a program, all their loads issued at once)."""
    if PDL:
        gdc_launch_dependents()
    if SWIGLU and BITS == 4:
        i = tl.arange(0, BLOCK_N)
        half = tl.program_id(0) * (BLOCK_N // 2) + i // 2
        both = _rows(
            x_ptr, xsum_ptr, w_ptr, s_ptr, z_ptr, half + (i % 2) * up_rows, half < N, K,
            words_per_row, groups, BITS, BLOCK_N, BLOCK_K, WORDS, VEC, EVEN, PDL, HALF, AHEAD,
        )  # fmt: skip
        y, up = tl.split(tl.reshape(both, (BLOCK_N // 2, 2)))
        rows = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    else:
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        y = _rows(
            x_ptr, xsum_ptr, w_ptr, s_ptr, z_ptr, rows, rows < N, K, words_per_row, groups,
            BITS, BLOCK_N, BLOCK_K, WORDS, VEC, EVEN, PDL, HALF, AHEAD,
        )  # fmt: skip
        up = y
        if SWIGLU:
            up = _rows(
                x_ptr, xsum_ptr, w_ptr, s_ptr, z_ptr, rows + up_rows, rows < N, K,
                words_per_row, groups, BITS, BLOCK_N, BLOCK_K, WORDS, VEC, EVEN, False, HALF,
                AHEAD,
            )  # fmt: skip
    _finish(
        y, up, b_ptr, r_ptr, y_ptr, rows, rows < N, up_rows, HAS_BIAS, RESIDUAL, SWIGLU,
        ROUND_BF16_BY_HAND,
    )  # fmt: skip


def _int4_x(x: Tensor, groups: int, pdl: bool, half: bool) -> tuple[Tensor, Tensor]:
    """x (K,) as the int4 product reads it: (xs (K,), xsum (K / 8,)), fp32 (`_int4_x_kernel`);
    half: (xh (K / 2,) int32, xinv (groups,) fp32) (`_int4_half_x_kernel`)."""
    k = x.shape[0]
    words = k // groups // 8
    per_program = max(1, 1024 // (8 * words))  # groups a program: about 1024 features
    if half:
        xh = torch.empty(k // 2, dtype=torch.int32, device=x.device)
        xinv = torch.empty(groups, dtype=torch.float32, device=x.device)
        launch(
            _int4_half_x_kernel, (triton.cdiv(groups, per_program),), x.device, x, xh, xinv, k,
            groups, WORDS=words, GROUPS=per_program, PDL=pdl, num_warps=4,
        )  # fmt: skip
        return xh, xinv
    xs = torch.empty(k, dtype=torch.float32, device=x.device)
    xsum = torch.empty(k // 8, dtype=torch.float32, device=x.device)
    launch(
        _int4_x_kernel, (triton.cdiv(groups, per_program),), x.device, x, xs, xsum, k, groups,
        WORDS=words, GROUPS=per_program, PDL=pdl, num_warps=4,
    )  # fmt: skip
    return xs, xsum


def gemv_supported(kind: str, shape: tuple[int, int]) -> bool:
    """Whether `quant_gemv` takes a weight of this kind and (N, K): int8 or int4."""
    return kind in ("int8", "int4")


def quant_gemv(
    x: Tensor, state: dict[str, Tensor], kind: str, shape: tuple[int, int],
    bias: Tensor | None = None, *, swiglu: bool = False, residual: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """x (..., K) of one row times W^T (+ bias) for W (N, K) = shape held quantized in `state`
    (quantize_int8's or quantize_int4's, contiguous, on x's device); x bf16 or fp16. swiglu: W
    is a fused gate/up projection and the result is swiglu of the product, (..., N / 2).
    residual: (..., N) of x's dtype, added to the result. Returns x's dtype."""
    k = shape[1]
    if not gemv_supported(kind, shape):
        raise ValueError(f"quant_gemv takes int8 or int4 weights, got {kind!r}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"quant_gemv computes in bf16 or fp16, got {x.dtype}")
    out = check_one_row("quant_gemv", x, shape, bias, swiglu, residual)
    scale = state["scale"]
    values = state["q"] if kind == "int8" else state["packed"]
    zero = state.get("zero", scale)
    groups = scale.shape[1] if kind == "int4" else 1
    interpret = x.device.type == "cpu"
    pdl = pdl_enabled(x.device)
    # int4 in packed halves (PTX: CUDA only) where a group holds a multiple of four words (a
    # thread's 16-byte load stays inside one group): groups of 32 features or more
    half = INT4_HALF and kind == "int4" and not interpret and (k // groups // 8) % 4 == 0
    block_n, block_k, warps, stages = (
        _INTERPRET[kind] if interpret else CONFIG["int4_half" if half else kind]
    )
    if half:  # features a tile -> groups a tile; half the tile and warps where K needs it
        if k % block_k and k % (block_k // 2) == 0 and warps > 1:
            block_k, warps = block_k // 2, warps // 2
        block_k = max(1, block_k // (k // groups))
    if kind == "int8" and k % block_k and k % 1024 == 0:
        block_k = min(block_k, 1024)  # a tile that divides K: no masked last tile
    per_program = block_n // 2 if swiglu and kind == "int4" else block_n
    y = torch.empty(*x.shape[:-1], out, dtype=x.dtype, device=x.device)
    x_in, xsum = x.reshape(k).contiguous(), scale
    if kind == "int4":  # x scaled and summed once for all the rows, by a small kernel before
        x_in, xsum = _int4_x(x_in, groups, pdl, half)
    launch(
        _quant_gemv_kernel, (triton.cdiv(out, per_program),), x.device,
        x_in, xsum, values, scale, zero, bias if bias is not None else scale,
        residual.reshape(out).contiguous() if residual is not None else scale, y, out, k, k // 8,
        groups, out if swiglu else 0, BITS=8 if kind == "int8" else 4, BLOCK_N=block_n,
        BLOCK_K=block_k, WORDS=k // groups // 8 if kind == "int4" else 1, VEC=INT8_VEC,
        EVEN=(k if kind == "int8" else groups) % block_k == 0, HAS_BIAS=bias is not None,
        RESIDUAL=residual is not None, SWIGLU=swiglu,
        ROUND_BF16_BY_HAND=interpret and x.dtype == torch.bfloat16, PDL=pdl, HALF=half,
        AHEAD=kind == "int4" and groups >= INT4_AHEAD_TILES * block_k, num_warps=warps,
        num_stages=stages,
    )  # fmt: skip
    return y
