"""The matrix-vector product of a batch-1 decode step, y = W x (+ b), in Triton.

At one token per step every linear layer reads its whole weight to make one row, so a decode
step is as fast as the weights stream from memory. cuBLAS serves a (1, K) x (K, N) product with
GEMM tiles of 8 or 64 rows of which one is used, and with a split-K reduction kernel for the
narrow ones. Here a program owns BLOCK_N = 4 output features, walks K in tiles of 128 with the
loads pipelined, and reduces its (4, 128) fp32 partial sums once at the end: one kernel, no
split. Measured on an H100 with cold weights (rotated through more than the L2 holds), llama-3.2-1b's
qkv, out, gate_up, down and lm_head shapes take 6.4, 5.2, 23.8, 14.5 and 167 us against
cuBLAS's 7.1, 6.2, 24.1, 16.0 and 176 us; llama-3-8b's take 4-20% less than cuBLAS's.

Fused into it, for the decode step of a layer (memfit.models.llama.Block): the RMSNorm before
qkv and gate_up (each program reduces the row's K values itself, from L2), SwiGLU before down
(its gate and up halves read tile by tile), and the residual add after out and down. A layer is
then four products, the cache write and the attention: seven kernels instead of eleven.

Numerics: products and sums in fp32, one rounding to the output dtype, as cuBLAS does; only the
order of the sums differs. A fused norm or SwiGLU is rounded to the dtype before the product,
and a fused residual added to the rounded product, as the unfused ops would see them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from memfit.ops._triton import launch, round_to_bf16, tl, triton

__all__ = ["gemv"]

BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES = 4, 128, 8, 3
_INTERPRET_BLOCK_K = 32


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    norm_ptr,
    residual_ptr,
    y_ptr,
    N,
    K,
    stride_w,
    eps,
    HAS_BIAS: tl.constexpr,
    NORM: tl.constexpr,
    SWIGLU: tl.constexpr,
    RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    ROUND_BF16_BY_HAND: tl.constexpr,
):
    """y = W p(x) (+ b) (+ residual). p: x itself; NORM: rms_norm(x) * norm weight; SWIGLU:
    silu(gate) * up of x = [gate | up] (2K wide). p(x) is rounded to x's dtype, as the unfused
    op's output would be; with RESIDUAL, W p(x) (+ b) is rounded before the residual is added,
    as the unfused add would see it."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_ok = rows < N
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    dtype = y_ptr.dtype.element_ty
    rstd = 0.0
    if NORM:  # every program reduces the row itself: K values from L2, beside the weights
        squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            v = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
            squares += v * v
        rstd = tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        if EVEN_K:
            x = tl.load(x_ptr + cols).to(tl.float32)
            w = tl.load(w_rows + cols[None, :], mask=rows_ok[:, None], other=0.0)
        else:
            cols_ok = cols < K
            x = tl.load(x_ptr + cols, mask=cols_ok, other=0.0).to(tl.float32)
            w = tl.load(w_rows + cols[None, :], mask=rows_ok[:, None] & cols_ok[None, :], other=0.0)
        if NORM:
            x = x * rstd * tl.load(norm_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
        if SWIGLU:
            up = tl.load(x_ptr + K + cols, mask=cols < K, other=0.0).to(tl.float32)
            x = x * tl.sigmoid(x) * up
        if NORM or SWIGLU:
            x = _round(x, dtype, ROUND_BF16_BY_HAND).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=rows_ok, other=0.0).to(tl.float32)
    if RESIDUAL:
        y = _round(y, dtype, ROUND_BF16_BY_HAND).to(tl.float32)
        y += tl.load(residual_ptr + rows, mask=rows_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, _round(y, dtype, ROUND_BF16_BY_HAND), mask=rows_ok)


@triton.jit
def _round(x, dtype: tl.constexpr, BY_HAND: tl.constexpr):
    """fp32 -> dtype, to nearest even (by hand for bf16 under the interpreter, which truncates)."""
    if BY_HAND:
        return round_to_bf16(x)
    return x.to(dtype)


def gemv(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    norm: tuple[Tensor, float] | None = None,
    swiglu: bool = False,
    residual: Tensor | None = None,
) -> Tensor:
    """F.linear(p(x), weight, bias) (+ residual) for an x of one row, in one kernel. p: x
    itself; with `norm=(w, eps)`, rms_norm(x, w, eps); with `swiglu`, silu(gate) * up of x =
    [gate | up] (x twice as wide as weight's K). x: (..., K or 2K) with one row; weight (N, K)
    with unit stride along K; bias and residual: N values or None; one dtype (the norm weight
    any float dtype). Returns (..., N) in x's dtype. Runs where Triton runs (the caller decides:
    memfit.functional.linear)."""
    n, k = weight.shape
    width = 2 * k if swiglu else k
    if x.numel() != width or x.shape[-1] != width or (norm is not None and swiglu):
        raise ValueError(
            f"gemv takes one row of {width} features (norm or swiglu, not both), got x of shape "
            f"{tuple(x.shape)}"
        )
    if weight.stride(1) != 1 or x.dtype != weight.dtype:
        raise ValueError(
            f"gemv needs weight with unit stride along K and x of its dtype, got stride "
            f"{weight.stride()} and {x.dtype} / {weight.dtype}"
        )
    for name, extra in (("bias", bias), ("residual", residual)):
        if extra is not None and (extra.numel() != n or extra.dtype != x.dtype):
            raise ValueError(f"gemv's {name} must hold {n} values in {x.dtype}")
    if norm is not None and norm[0].shape != (k,):
        raise ValueError(f"gemv's norm weight must be ({k},), got {tuple(norm[0].shape)}")
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    interpret = x.device.type == "cpu"
    block_k = _INTERPRET_BLOCK_K if interpret else BLOCK_K
    launch(
        _gemv_kernel, (triton.cdiv(n, BLOCK_N),), x.device,
        x.reshape(width).contiguous(), weight, bias if bias is not None else weight,
        norm[0].contiguous() if norm is not None else weight,
        residual.reshape(n) if residual is not None else weight, y, n, k, weight.stride(0),
        float(norm[1]) if norm is not None else 0.0,
        HAS_BIAS=bias is not None, NORM=norm is not None, SWIGLU=swiglu,
        RESIDUAL=residual is not None, BLOCK_N=BLOCK_N, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        ROUND_BF16_BY_HAND=interpret and x.dtype == torch.bfloat16,
        num_warps=1 if interpret else NUM_WARPS, num_stages=1 if interpret else NUM_STAGES,
    )  # fmt: skip
    return y
