"""The matrix-vector product of a batch-1 decode step, y = W x (+ b), in Triton, with the
SwiGLU before it and the residual add after it folded in.

At one token per step every linear layer reads its whole weight to make one row, so a decode
step is as fast as the weights stream from memory. cuBLAS serves a (1, K) x (K, N) product with
GEMM tiles of 8 or 64 rows of which one is used, and with a split-K reduction kernel for the
narrow ones. Here a program owns BLOCK_N output features, walks K in tiles of BLOCK_K with the
loads pipelined, and reduces its (BLOCK_N, BLOCK_K) fp32 partial sums once at the end: one
kernel, no split. Measured on an H100 with cold weights (rotated through more than the L2 holds),
llama-3.2-1b's qkv, out, gate_up, down and lm_head shapes take 6.4, 5.2, 23.8, 14.5 and 167 us
against cuBLAS's 7.1, 6.2, 24.1, 16.0 and 176 us; llama-3-8b's take 4-20% less than cuBLAS's.

Launched with programmatic dependent launch (`memfit.ops._triton.programmatic_launch`, the
engine's decode step), a program reads its first weight tile before it waits for the kernel
before it: the weights stream while the last kernel (a norm, the attention) still runs.

Fused around the product, for a decode layer's MLP (two launches fewer per layer):
- `swiglu`: W is the fused gate/up projection and a program owns the same features of both
  halves (rows j and N/2 + j), so it returns silu(gate) * up: each half rounded to the dtype as
  the product's output would be, the activation in fp32 and rounded once, the values of the
  product followed by `memfit.functional.swiglu`;
- `residual`: y = round(round(W x + b) + residual), the values of the product followed by a
  separate add.

Numerics: products and sums in fp32, one rounding to the output dtype, as cuBLAS does; only the
order of the sums differs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from memfit.ops._triton import (
    gdc_launch_dependents,
    gdc_wait,
    launch,
    pdl_enabled,
    round_to_bf16,
    tl,
    triton,
)

__all__ = ["gemv"]

# (BLOCK_N, BLOCK_K, num_warps, num_stages). With PDL the first tile is read before the wait, and
# one row per program with long tiles measured best: llama-3.2-1b's batch-1 decode step in its
# CUDA graph on an H100 took 1.04 ms, against 1.06 with 2x1024, 1.17 with 4x1024 and 1.21 for
# the plain launch (benchmarks/gemv_configs.py, results/gemv_configs.json).
BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES = 4, 128, 8, 3
PDL_CONFIG = (1, 1024, 4, 3)
_INTERPRET_BLOCK_K = 32


@triton.jit
def _round(x, DTYPE: tl.constexpr, ROUND_BF16_BY_HAND: tl.constexpr):
    """x (fp32) rounded to DTYPE and back to fp32."""
    if ROUND_BF16_BY_HAND:  # the interpreter's cast truncates
        return round_to_bf16(x).to(tl.float32)
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _load_w(ptrs, rows_ok, cols_ok, EVEN_K: tl.constexpr):
    """A (BLOCK_N, BLOCK_K) tile of weights."""
    if EVEN_K:
        return tl.load(ptrs, mask=rows_ok[:, None], other=0.0)
    return tl.load(ptrs, mask=rows_ok[:, None] & cols_ok[None, :], other=0.0)


@triton.jit
def _load_x(ptrs, cols_ok, EVEN_K: tl.constexpr):
    """BLOCK_K values of x, in fp32."""
    if EVEN_K:
        return tl.load(ptrs).to(tl.float32)
    return tl.load(ptrs, mask=cols_ok, other=0.0).to(tl.float32)


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    r_ptr,
    y_ptr,
    N,
    K,
    stride_w,
    up_offset,
    HAS_BIAS: tl.constexpr,
    RESIDUAL: tl.constexpr,
    SWIGLU: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    ROUND_BF16_BY_HAND: tl.constexpr,
    PDL: tl.constexpr,
):
    """y[rows] for this program's BLOCK_N rows of N. SWIGLU: W is (2N, K), gate rows then up
    rows, and y = silu(gate) * up of the program's rows of each half."""
    if PDL:
        gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_ok = rows < N
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    u_rows = w_rows + up_offset  # SWIGLU: the up rows, N * stride_w elements on
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    first = 0
    if PDL:
        # the first tile of weights before the wait: no kernel of the step writes them
        cols = tl.arange(0, BLOCK_K)
        cols_ok = cols < K
        w = _load_w(w_rows + cols[None, :], rows_ok, cols_ok, EVEN_K)
        if SWIGLU:
            u = _load_w(u_rows + cols[None, :], rows_ok, cols_ok, EVEN_K)
        gdc_wait()
        x = _load_x(x_ptr + cols, cols_ok, EVEN_K)
        acc += w.to(tl.float32) * x[None, :]
        if SWIGLU:
            acc_up += u.to(tl.float32) * x[None, :]
        first = BLOCK_K
    for start in range(first, K, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        cols_ok = cols < K
        x = _load_x(x_ptr + cols, cols_ok, EVEN_K)
        acc += _load_w(w_rows + cols[None, :], rows_ok, cols_ok, EVEN_K).to(tl.float32) * x[None, :]
        if SWIGLU:
            u = _load_w(u_rows + cols[None, :], rows_ok, cols_ok, EVEN_K)
            acc_up += u.to(tl.float32) * x[None, :]
    _finish(
        tl.sum(acc, axis=1), tl.sum(acc_up, axis=1), b_ptr, r_ptr, y_ptr, rows, rows_ok, N,
        HAS_BIAS, RESIDUAL, SWIGLU, ROUND_BF16_BY_HAND,
    )  # fmt: skip


@triton.jit
def _finish(
    y, up, b_ptr, r_ptr, y_ptr, rows, rows_ok, N, HAS_BIAS: tl.constexpr,
    RESIDUAL: tl.constexpr, SWIGLU: tl.constexpr, ROUND_BF16_BY_HAND: tl.constexpr,
):  # fmt: skip
    """A one-row product's end (also memfit.ops.quant.gemv's): y (and up, with SWIGLU) the fp32
    sums of the program's rows (of each half); the bias, silu(gate) * up, the residual, one
    rounding and the store."""
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=rows_ok, other=0.0).to(tl.float32)
    if SWIGLU:  # each half rounds as the product's output would, then silu(gate) * up
        if HAS_BIAS:
            up += tl.load(b_ptr + N + rows, mask=rows_ok, other=0.0).to(tl.float32)
        gate = _round(y, y_ptr.dtype.element_ty, ROUND_BF16_BY_HAND)
        up = _round(up, y_ptr.dtype.element_ty, ROUND_BF16_BY_HAND)
        y = gate * tl.sigmoid(gate) * up
    if RESIDUAL:  # the product rounds, then the add
        y = _round(y, y_ptr.dtype.element_ty, ROUND_BF16_BY_HAND)
        y += tl.load(r_ptr + rows, mask=rows_ok, other=0.0).to(tl.float32)
    if ROUND_BF16_BY_HAND:
        y = round_to_bf16(y)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rows_ok)


def check_one_row(
    name: str, x: Tensor, shape: tuple[int, int], bias: Tensor | None, swiglu: bool,
    residual: Tensor | None,
) -> int:  # fmt: skip
    """The checks of a one-row product's operands (`gemv`'s, memfit.ops.quant.gemv's) against
    W's (N, K) shape; returns the output's width (N, or N / 2 with swiglu)."""
    n, k = shape
    if x.numel() != k or x.shape[-1] != k:
        raise ValueError(f"{name} takes one row of {k} features, got x of shape {tuple(x.shape)}")
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype):
        raise ValueError(f"{name}'s bias must be ({n},) in {x.dtype}")
    if swiglu and n % 2:
        raise ValueError(f"{name} with swiglu needs an even number of rows (gate, up), got {n}")
    out = n // 2 if swiglu else n
    if residual is not None and (residual.numel() != out or residual.dtype != x.dtype):
        raise ValueError(f"{name}'s residual must hold {out} values in {x.dtype}")
    return out


def gemv(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    swiglu: bool = False,
    residual: Tensor | None = None,
) -> Tensor:
    """F.linear(x, weight, bias) for an x of one row: x (..., K) with x.numel() == K; weight
    (N, K) with unit stride along K; bias (N,) or None; one dtype. Returns (..., N) in x's dtype.
    swiglu: weight is a fused gate/up projection (gate rows, then up rows) and the result is
    swiglu of the product, (..., N / 2). residual: (..., N) of x's dtype, added to the result.
    Runs where Triton runs (the caller decides: memfit.functional.linear)."""
    n, k = weight.shape
    if weight.stride(1) != 1 or x.dtype != weight.dtype:
        raise ValueError(
            f"gemv needs weight with unit stride along K and x of its dtype, got stride "
            f"{weight.stride()} and {x.dtype} / {weight.dtype}"
        )
    out = check_one_row("gemv", x, (n, k), bias, swiglu, residual)
    y = torch.empty(*x.shape[:-1], out, dtype=x.dtype, device=x.device)
    interpret = x.device.type == "cpu"
    pdl = pdl_enabled(x.device)
    block_n, block_k, warps, stages = (
        PDL_CONFIG if pdl else (BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES)
    )
    if interpret:
        block_k, warps, stages = _INTERPRET_BLOCK_K, 1, 1
    launch(
        _gemv_kernel, (triton.cdiv(out, block_n),), x.device,
        x.reshape(k).contiguous(), weight, bias if bias is not None else weight,
        residual.reshape(out).contiguous() if residual is not None else weight, y, out, k,
        weight.stride(0), out * weight.stride(0), HAS_BIAS=bias is not None, RESIDUAL=residual is not None,
        SWIGLU=swiglu, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        ROUND_BF16_BY_HAND=interpret and x.dtype == torch.bfloat16, PDL=pdl,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y
