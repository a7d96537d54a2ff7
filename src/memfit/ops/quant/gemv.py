"""The matrix-vector product of a batch-1 decode step over a weight-only quantized W (int8 per
row, or int4 in groups, asymmetric: memfit.ops.quant), y = W x (+ b), with the SwiGLU before it
and the residual add after it folded in as memfit.ops.gemv does for bf16 weights.

At one token per step the product streams W once, so its time is W's bytes over the memory's
bandwidth: 1 byte a weight for int8 and 0.54 (4 bits and a group's scale and zero) for int4,
against 2 for bf16. Each weight becomes fp32 without a conversion instruction: its integer is
put into the low mantissa bits of 2^23 (one logic instruction, after a shift for int4) and 2^23
is subtracted together with the zero point (int4) or with the 128 that made int8 unsigned, one
floating-point instruction; then one multiply-add with x.

- int8 (`quantize_int8`, a scale per row): a program owns BLOCK_N rows and walks K in tiles of
  BLOCK_K features; a row's sum is scaled once at the end.
- int4 (`quantize_int4`, groups of 8 * WORDS features, eight levels a 32-bit word interleaved
  in the group): a tile is (BLOCK_N rows, BLOCK_K groups, WORDS words); nibble j of a group's
  words holds its features j * WORDS .. j * WORDS + WORDS - 1, so each of the eight nibble
  positions multiplies a contiguous slice of x. A group's partial sums are scaled once a word.

A few rows a program and long tiles along K keep enough loads in flight per SM to stream W at
the memory's bandwidth on narrow layers too (a decode step's out and down projections have few
rows and long rows).

Numerics: x widened to fp32, every weight exact in fp32 ((q - z) or q), products and sums in
fp32, scales applied in fp32, one rounding to the output dtype: more exact than multiplying by
the weight dequantized to bf16 (the reference that `dequantize` then F.linear computes), whose
error against an fp32 product the tests bound it by. The swiglu and residual folds round each
half and the product as the separate ops would (memfit.ops.gemv).

Under programmatic dependent launch (the engine's decode step) a program signals its
dependents at once and waits for the kernel before it before reading anything.
"""

from __future__ import annotations

import torch
from torch import Tensor

from memfit.ops._triton import gdc_launch_dependents, gdc_wait, launch, pdl_enabled, tl, triton
from memfit.ops.gemv import _finish, check_one_row

__all__ = ["quant_gemv", "gemv_supported"]

# int8: (BLOCK_N, BLOCK_K, num_warps, num_stages); int4: (BLOCK_N, groups a tile, num_warps,
# num_stages). The fastest of a sweep on an H100 over llama-3-8b's four layers together
# (results/quant_decode.json): int8 94.6 us, int4 82.2 us, against 155 us for bf16.
CONFIG = {"int8": (1, 1024, 4, 3), "int4": (8, 8, 8, 3)}
_INTERPRET = {"int8": (4, 32, 1, 1), "int4": (4, 2, 1, 1)}


@triton.jit
def _int8_tile(w_rows, x_ptr, start, rows_ok, K, BLOCK_K: tl.constexpr, EVEN: tl.constexpr):
    """(int8 tile at `start`, its x in fp32); past K zeros (EVEN: K a multiple of BLOCK_K, and
    a start past the end reads the last tile again, never used)."""
    if EVEN:
        start = tl.multiple_of(tl.minimum(start, K - BLOCK_K), BLOCK_K)
    cols = start + tl.arange(0, BLOCK_K)
    if EVEN:
        q = tl.load(w_rows + cols[None, :], mask=rows_ok[:, None], other=0)
        x = tl.load(x_ptr + cols)
    else:
        q = tl.load(w_rows + cols[None, :], mask=rows_ok[:, None] & (cols < K)[None, :], other=0)
        x = tl.load(x_ptr + cols, mask=cols < K, other=0.0)
    return q, x.to(tl.float32)


@triton.jit
def _int8_rows(
    x_ptr, w_ptr, s_ptr, rows, rows_ok, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN: tl.constexpr,
):  # fmt: skip
    """W[rows] x for int8 W (N, K) with a scale per row: (BLOCK_N,) fp32. The next tile is
    loaded before the current one is used, so that its loads are in flight meanwhile."""
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * K
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    q, x = _int8_tile(w_rows, x_ptr, 0, rows_ok, K, BLOCK_K, EVEN)
    for start in range(BLOCK_K, K + BLOCK_K, BLOCK_K):
        q_next, x_next = _int8_tile(w_rows, x_ptr, start, rows_ok, K, BLOCK_K, EVEN)
        # the byte, its sign bit flipped (q + 128), in the mantissa of 2^23
        bits = (q.to(tl.int32) & 0xFF) ^ 0x4B000080
        acc += (bits.to(tl.float32, bitcast=True) - 8388736.0) * x[None, :]  # - (2^23 + 128)
        q, x = q_next, x_next
    return tl.sum(acc, axis=1) * tl.load(s_ptr + rows, mask=rows_ok, other=0.0)


@triton.jit
def _int4_tile(
    w_rows, s_ptr, z_ptr, s_rows, first, rows_ok, groups, TILE_GROUPS: tl.constexpr,
    WORDS: tl.constexpr, EVEN: tl.constexpr,
):  # fmt: skip
    """The (BLOCK_N, TILE_GROUPS, WORDS) words of the groups from `first` and their scales and
    zero points (plus 2^23), (BLOCK_N, TILE_GROUPS); past the last group zeros (EVEN: the
    groups a multiple of TILE_GROUPS, and a tile past the end reads the last one again, never
    used)."""
    if EVEN:
        first = tl.multiple_of(tl.minimum(first, groups - TILE_GROUPS), TILE_GROUPS)
    g = first + tl.arange(0, TILE_GROUPS)
    if EVEN:
        ok = rows_ok[:, None] & (g >= 0)[None, :]
    else:
        ok = rows_ok[:, None] & (g < groups)[None, :]
    w = tl.load(w_rows + g[None, :, None] * WORDS, mask=ok[:, :, None], other=0)
    scale = tl.load(s_ptr + s_rows + g[None, :], mask=ok, other=0.0)
    zero = tl.load(z_ptr + s_rows + g[None, :], mask=ok, other=0).to(tl.float32) + 8388608.0
    return w, scale, zero


@triton.jit
def _int4_rows(
    x_ptr, w_ptr, s_ptr, z_ptr, rows, rows_ok, words_per_row, groups, BLOCK_N: tl.constexpr,
    TILE_GROUPS: tl.constexpr, WORDS: tl.constexpr, EVEN: tl.constexpr,
):  # fmt: skip
    """W[rows] x for int4 W (N, K) in groups of 8 * WORDS features: (BLOCK_N,) fp32. A tile is
    (BLOCK_N, TILE_GROUPS, WORDS) words; nibble j of a group's words multiplies the group's
    features j * WORDS .. j * WORDS + WORDS - 1 (memfit.ops.quant.int4). The next tile is
    loaded before the current one is used."""
    rows64 = rows.to(tl.int64)
    words = tl.arange(0, WORDS)
    w_rows = w_ptr + rows64[:, None, None] * words_per_row + words[None, None, :]
    s_rows = rows64[:, None] * groups
    acc = tl.zeros((BLOCK_N, TILE_GROUPS, WORDS), dtype=tl.float32)
    w, scale, zero = _int4_tile(
        w_rows, s_ptr, z_ptr, s_rows, 0, rows_ok, groups, TILE_GROUPS, WORDS, EVEN
    )
    for first in range(TILE_GROUPS, groups + TILE_GROUPS, TILE_GROUPS):
        w_next, scale_next, zero_next = _int4_tile(
            w_rows, s_ptr, z_ptr, s_rows, first, rows_ok, groups, TILE_GROUPS, WORDS, EVEN,
        )  # fmt: skip
        g = first - TILE_GROUPS + tl.arange(0, TILE_GROUPS)
        x_tile = x_ptr + g[:, None] * (8 * WORDS) + words[None, :]
        part = tl.zeros((BLOCK_N, TILE_GROUPS, WORDS), dtype=tl.float32)
        for j in tl.static_range(8):
            if EVEN:
                x = tl.load(x_tile + j * WORDS).to(tl.float32)
            else:
                x = tl.load(x_tile + j * WORDS, mask=(g < groups)[:, None], other=0.0)
                x = x.to(tl.float32)
            bits = ((w >> (4 * j)) & 0xF) | 0x4B000000  # the level in the mantissa of 2^23
            # minus 2^23 and the zero point at once
            part += (bits.to(tl.float32, bitcast=True) - zero[:, :, None]) * x[None, :, :]
        acc += part * scale[:, :, None]
        w, scale, zero = w_next, scale_next, zero_next
    return tl.sum(tl.sum(acc, axis=2), axis=1)


@triton.jit
def _rows(
    x_ptr, w_ptr, s_ptr, z_ptr, rows, rows_ok, K, words_per_row, groups, BITS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WORDS: tl.constexpr, EVEN: tl.constexpr,
):  # fmt: skip
    if BITS == 8:
        y = _int8_rows(x_ptr, w_ptr, s_ptr, rows, rows_ok, K, BLOCK_N, BLOCK_K, EVEN)
    else:
        y = _int4_rows(
            x_ptr, w_ptr, s_ptr, z_ptr, rows, rows_ok, words_per_row, groups, BLOCK_N,
            BLOCK_K, WORDS, EVEN,
        )  # fmt: skip
    return y


@triton.jit
def _quant_gemv_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, r_ptr, y_ptr, N, K, words_per_row, groups, up_rows,
    BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WORDS: tl.constexpr,
    EVEN: tl.constexpr, HAS_BIAS: tl.constexpr, RESIDUAL: tl.constexpr, SWIGLU: tl.constexpr,
    ROUND_BF16_BY_HAND: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """y[rows] for this program's BLOCK_N rows of N. int8: BLOCK_K features a tile; int4:
    BLOCK_K groups of 8 * WORDS features a tile. SWIGLU: W is (2N, K), gate rows then up rows
    (up_rows = N), and y = silu(gate) * up of the program's rows of each half."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_ok = rows < N
    y = _rows(
        x_ptr, w_ptr, s_ptr, z_ptr, rows, rows_ok, K, words_per_row, groups, BITS, BLOCK_N,
        BLOCK_K, WORDS, EVEN,
    )  # fmt: skip
    up = y
    if SWIGLU:
        up = _rows(
            x_ptr, w_ptr, s_ptr, z_ptr, rows + up_rows, rows_ok, K, words_per_row, groups, BITS,
            BLOCK_N, BLOCK_K, WORDS, EVEN,
        )  # fmt: skip
    _finish(
        y, up, b_ptr, r_ptr, y_ptr, rows, rows_ok, up_rows, HAS_BIAS, RESIDUAL, SWIGLU,
        ROUND_BF16_BY_HAND,
    )  # fmt: skip


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
    block_n, block_k, warps, stages = (_INTERPRET if interpret else CONFIG)[kind]
    pdl = pdl_enabled(x.device)
    y = torch.empty(*x.shape[:-1], out, dtype=x.dtype, device=x.device)
    launch(
        _quant_gemv_kernel, (triton.cdiv(out, block_n),), x.device,
        x.reshape(k).contiguous(), values, scale, zero, bias if bias is not None else scale,
        residual.reshape(out).contiguous() if residual is not None else scale, y, out, k, k // 8,
        groups, out if swiglu else 0, BITS=8 if kind == "int8" else 4, BLOCK_N=block_n,
        BLOCK_K=block_k, WORDS=k // groups // 8 if kind == "int4" else 1,
        EVEN=(k if kind == "int8" else groups) % block_k == 0, HAS_BIAS=bias is not None,
        RESIDUAL=residual is not None, SWIGLU=swiglu,
        ROUND_BF16_BY_HAND=interpret and x.dtype == torch.bfloat16, PDL=pdl, num_warps=warps,
        num_stages=stages,
    )  # fmt: skip
    return y
