"""Fused linear distillation loss: a student learns from a teacher's output distribution (Hinton
et al. 2015) without either model's (N, vocab) logits ever held whole.

For N rows (tokens) with student hidden states h_s (N, d_s) and output weight W_s (V, d_s), the
teacher's h_t (N, d_t) and W_t (V, d_t), targets y (N,) and a temperature T:

    s = h_s W_s^T,  t = h_t W_t^T                           (per chunk of rows, fp32)
    CE  = sum_n [logsumexp(s_n) - s_n[y_n]]                 (rows with y_n != ignore_index)
    KL  = sum_n T^2 KL(softmax(t_n / T) || softmax(s_n / T))
    JSD = sum_n T^2 [KL(p || m) + KL(q || m)] / 2,   p, q = softmax(t_n / T), softmax(s_n / T),
          m = (p + q) / 2
    loss = (1 - alpha) CE + alpha KL  (or JSD)

T^2 keeps the soft term's gradient on the scale of the hard one as T grows (Hinton et al.).
The distillation term counts the same rows as the cross-entropy (those with a target).

As `memfit.ops.cross_entropy` does for the cross-entropy alone, the rows are processed in chunks
of C: each chunk's student and teacher logits (C x V fp32 each) are computed, reduced to the
chunk's loss, and turned at once into the gradient of the student's logits, from which the
gradients of h_s and W_s are computed and kept; backward only scales them. Memory beyond the
inputs and the two gradients: a few C x V fp32 values per chunk (the logits, the log-softmaxes
and the gradient), whatever N is. The teacher gets no gradient.

Numerics, as `memfit.ops.cross_entropy`'s: the products run in the compute dtype (autocast's
when enabled, else hidden's), the logits come out of them in fp32 (where PyTorch can write them
so; else rounded once), the per-row work is fp32, and the two gradient products take the logits'
gradient rounded to the compute dtype, accumulating W_s's gradient in fp32. Each output weight is
cast to the compute dtype once (no copy when it is stored so: a frozen bf16 head).

The per-row work has two paths, as the cross-entropy's:
- Triton (`_distill_rows_kernel`, one program per row; CPU tensors inside
  `memfit.ops._triton.triton_on_cpu()`, for tests): an online max and sum of exponentials of the
  student's logits (at temperature 1 and at T) and of the teacher's in one pass over the row,
  then the row's loss and its gradient in a second (KL) or a second and third (JSD, whose
  gradient needs the row's sum of q u first); the gradient is written over the student's fp32
  logits, or into one bf16 buffer (bf16 compute). Three or four passes over the two rows'
  logits in all, where the plain path makes some twenty.
- plain PyTorch (`_chunk_loss_and_grad`): the reference for the kernel (KERNEL_ON_CUDA = False
  runs it on CUDA too). On an H100 at llama-3's vocabulary (benchmarks/distill.py) the kernel
  takes 0.42x the plain path's time and 0.38x its extra memory.

Gradients with respect to the student's logits (divided by the row's count later by the
caller, like the losses):
    d CE / d s  = softmax(s) - onehot(y)
    d KL / d s  = T (q - p)
    d JSD / d s = T q * (u - sum(q * u)),  u = log(q / m) / 2
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from memfit.ops._triton import HAS_TRITON, launch, round_to_bf16, tl, triton, use_triton_on
from memfit.ops.cross_entropy import (
    _accumulate_matmul,
    _autocast_disabled,
    _matmul_wide,
    row_targets,
)

IGNORE_INDEX = -100
# The row kernel on CUDA (its GPU twin: tests/ops/test_distill.py, `-k cuda`); False: the
# plain path. The CPU tests run the kernel under Triton's interpreter.
KERNEL_ON_CUDA = True
# vocabulary columns per step of the kernel's loops (half the cross-entropy kernel's: this one
# holds two rows' values per step)
_BLOCK_VOCAB = 4096


@triton.jit
def _log_mean_exp(log_p, log_q):
    """log((p + q) / 2) from log p and log q (finite)."""
    high = tl.maximum(log_p, log_q)
    return high + tl.log(1.0 + tl.exp(tl.minimum(log_p, log_q) - high)) - 0.6931471805599453


@triton.jit
def _store_grad(
    grad_ptr, columns, mask, s, lse_1, target, alpha, soft_grad, ROUND_BF16_BY_HAND: tl.constexpr
):
    """Write d loss / d s = (1 - alpha) (softmax(s) - onehot(target)) + alpha soft_grad."""
    hard = tl.exp(s - lse_1)
    hard = tl.where(columns == target, hard - 1.0, hard)
    grad = (1.0 - alpha) * hard + alpha * soft_grad
    if ROUND_BF16_BY_HAND:
        grad = round_to_bf16(grad)
    tl.store(grad_ptr + columns, grad.to(grad_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _distill_rows_kernel(
    s_ptr,
    stride_s,
    t_ptr,
    stride_t,
    grad_ptr,
    stride_grad,
    targets_ptr,
    losses_ptr,
    ignore_index,
    alpha,
    temperature,
    VOCAB_SIZE: tl.constexpr,
    JSD: tl.constexpr,
    SOFTENED: tl.constexpr,
    BLOCK_VOCAB: tl.constexpr,
    ROUND_BF16_BY_HAND: tl.constexpr,
):
    """Loss and d loss / d s of one row of the student's (s) and teacher's (t) fp32 logits, as
    `_chunk_loss_and_grad` computes them (the module docstring's formulas).

    Program n: rows n of s and t (C, vocab) (unit column stride), targets (C,) int64, losses
    (C,) fp32, row n of grad (C, vocab) in grad's dtype, which may be s itself (each element is
    read before the same thread overwrites it, and a pass that writes is the row's last).
    SOFTENED: temperature != 1 (the student's softened distribution is then a third
    normalizer). VOCAB_SIZE is a compile-time constant, as in the cross-entropy kernel."""
    row = tl.program_id(0).to(tl.int64)
    s_ptr += row * stride_s
    t_ptr += row * stride_t
    grad_ptr += row * stride_grad
    target = tl.load(targets_ptr + row)
    if target == ignore_index:  # no loss, zero gradient; the logits are not read
        tl.store(losses_ptr + row, 0.0)
        for start in range(0, VOCAB_SIZE, BLOCK_VOCAB):
            columns = start + tl.arange(0, BLOCK_VOCAB)
            zeros = tl.zeros([BLOCK_VOCAB], dtype=grad_ptr.dtype.element_ty)
            tl.store(grad_ptr + columns, zeros, mask=columns < VOCAB_SIZE)
        return
    inverse_t = 1.0 / temperature

    # Pass 1: running maxima and sums of exponentials (the cross-entropy kernel's online
    # softmax) of s, s / T and t / T. The first block holds a real logit of each.
    max_1 = float("-inf")
    sum_1 = 0.0
    max_q = float("-inf")
    sum_q = 0.0
    max_p = float("-inf")
    sum_p = 0.0
    for start in range(0, VOCAB_SIZE, BLOCK_VOCAB):
        columns = start + tl.arange(0, BLOCK_VOCAB)
        mask = columns < VOCAB_SIZE
        s = tl.load(s_ptr + columns, mask=mask, other=float("-inf"), eviction_policy="evict_last")
        t = tl.load(t_ptr + columns, mask=mask, other=float("-inf"), eviction_policy="evict_last")
        new_max = tl.maximum(max_1, tl.max(s, 0))
        sum_1 = sum_1 * tl.exp(max_1 - new_max) + tl.sum(tl.exp(s - new_max), 0)
        max_1 = new_max
        if SOFTENED:
            softened = s * inverse_t
            new_max = tl.maximum(max_q, tl.max(softened, 0))
            sum_q = sum_q * tl.exp(max_q - new_max) + tl.sum(tl.exp(softened - new_max), 0)
            max_q = new_max
        t = t * inverse_t
        new_max = tl.maximum(max_p, tl.max(t, 0))
        sum_p = sum_p * tl.exp(max_p - new_max) + tl.sum(tl.exp(t - new_max), 0)
        max_p = new_max
    lse_1 = max_1 + tl.log(sum_1)
    lse_q = lse_1
    if SOFTENED:
        lse_q = max_q + tl.log(sum_q)
    lse_p = max_p + tl.log(sum_p)
    cross_entropy = lse_1 - tl.load(s_ptr + target)

    # Pass 2: the soft term, KL(p || q) or the JSD's two KLs to m and the row's sum of q u; for
    # KL also the gradient, (1 - alpha) (softmax(s) - onehot) + alpha T (q - p).
    soft_sum = 0.0
    qu_sum = 0.0
    for start in range(0, VOCAB_SIZE, BLOCK_VOCAB):
        columns = start + tl.arange(0, BLOCK_VOCAB)
        mask = columns < VOCAB_SIZE
        s = tl.load(s_ptr + columns, mask=mask, other=0.0)
        t = tl.load(t_ptr + columns, mask=mask, other=0.0)
        log_q = s * inverse_t - lse_q
        log_p = t * inverse_t - lse_p
        q = tl.exp(log_q)
        p = tl.exp(log_p)
        if JSD:
            log_m = _log_mean_exp(log_p, log_q)
            term = 0.5 * (p * (log_p - log_m) + q * (log_q - log_m))
            soft_sum += tl.sum(tl.where(mask, term, 0.0), 0)
            qu_sum += tl.sum(tl.where(mask, 0.5 * q * (log_q - log_m), 0.0), 0)
        else:
            soft_sum += tl.sum(tl.where(mask, p * (log_p - log_q), 0.0), 0)
            _store_grad(
                grad_ptr, columns, mask, s, lse_1, target, alpha, temperature * (q - p),
                ROUND_BF16_BY_HAND,
            )  # fmt: skip
    loss = (1.0 - alpha) * cross_entropy + alpha * temperature * temperature * soft_sum
    tl.store(losses_ptr + row, loss)

    # Pass 3 (JSD): the gradient, the hard term's beside T q (u - sum(q u)),
    # u = (log q - log m) / 2.
    if JSD:
        for start in range(0, VOCAB_SIZE, BLOCK_VOCAB):
            columns = start + tl.arange(0, BLOCK_VOCAB)
            mask = columns < VOCAB_SIZE
            s = tl.load(s_ptr + columns, mask=mask, other=0.0)
            t = tl.load(t_ptr + columns, mask=mask, other=0.0)
            log_q = s * inverse_t - lse_q
            log_m = _log_mean_exp(t * inverse_t - lse_p, log_q)
            soft = temperature * tl.exp(log_q) * (0.5 * (log_q - log_m) - qu_sum)
            _store_grad(grad_ptr, columns, mask, s, lse_1, target, alpha, soft, ROUND_BF16_BY_HAND)


def _use_kernel(device: torch.device, compute_dtype: torch.dtype) -> bool:
    """Whether the chunks' row work runs `_distill_rows_kernel` (see KERNEL_ON_CUDA)."""
    if not HAS_TRITON or compute_dtype == torch.float64 or not use_triton_on(device):
        return False
    return device.type != "cuda" or KERNEL_ON_CUDA


def _kernel_loss_and_grad(
    s: Tensor, t: Tensor, y: Tensor, alpha: float, temperature: float, kind: str,
    ignore_index: int, grad: Tensor, row_losses: Tensor,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """`_chunk_loss_and_grad` by `_distill_rows_kernel`: the chunk's loss (fp32 scalar) and its
    gradient, written into `grad` ((C, V), fp32 or bf16; it may be s itself)."""
    rows, vocab = s.shape
    assert s.dtype == t.dtype == torch.float32 and s.stride(1) == t.stride(1) == 1
    assert grad.shape == s.shape and grad.stride(1) == 1
    block = min(_BLOCK_VOCAB, triton.next_power_of_2(max(vocab, 16)))
    losses = row_losses[:rows]
    launch(
        _distill_rows_kernel, (rows,), s.device, s, s.stride(0), t, t.stride(0), grad,
        grad.stride(0), y, losses, ignore_index, float(alpha), float(temperature),
        VOCAB_SIZE=vocab, JSD=kind == "jsd", SOFTENED=temperature != 1.0, BLOCK_VOCAB=block,
        ROUND_BF16_BY_HAND=s.device.type == "cpu" and grad.dtype == torch.bfloat16,
        num_warps=min(16, max(4, block // 512)),
    )  # fmt: skip
    return losses.sum(), grad


def _chunk_loss_and_grad(
    s: Tensor, t: Tensor, y: Tensor, alpha: float, temperature: float, kind: str,
    ignore_index: int,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Loss (fp32 scalar) and d loss / d s (C, V) of one chunk's fp32 logits."""
    keep = y != ignore_index
    log_q1 = torch.log_softmax(s, dim=-1)
    safe = torch.where(keep, y, 0)
    ce = -(log_q1.gather(1, safe[:, None])[:, 0] * keep).sum()
    grad = log_q1.exp() * keep[:, None]  # (ignored rows: no gradient at all)
    grad[torch.arange(len(y), device=y.device)[keep], y[keep]] -= 1
    grad = (1 - alpha) * grad
    log_q = log_q1 if temperature == 1 else torch.log_softmax(s / temperature, dim=-1)
    log_p = torch.log_softmax(t / temperature, dim=-1)
    q, p = log_q.exp(), log_p.exp()
    if kind == "kl":
        soft = (p * (log_p - log_q)).sum(dim=-1)
        soft_grad = temperature * (q - p)
    else:
        log_m = torch.logaddexp(log_p, log_q) - math.log(2.0)
        soft = 0.5 * ((p * (log_p - log_m)).sum(dim=-1) + (q * (log_q - log_m)).sum(dim=-1))
        u = 0.5 * (log_q - log_m)
        soft_grad = temperature * q * (u - (q * u).sum(dim=-1, keepdim=True))
    soft = temperature**2 * (soft * keep).sum()
    grad += alpha * soft_grad * keep[:, None]
    return (1 - alpha) * ce + alpha * soft, grad


class LinearDistillationFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden: Tensor, weight: Tensor, teacher_hidden: Tensor, teacher_weight: Tensor,
        targets: Tensor, alpha: float, temperature: float, kind: str, chunk_size: int,
        ignore_index: int, compute_dtype: torch.dtype,
    ) -> Tensor:  # fmt: skip
        wide = torch.float64 if compute_dtype == torch.float64 else torch.float32
        w = weight.to(compute_dtype)  # (as autocast casts it; a head in compute_dtype: no copy)
        tw = teacher_weight.to(compute_dtype)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=wide) if ctx.needs_input_grad[1] else None
        loss = torch.zeros((), dtype=wide, device=hidden.device)
        kernel = _use_kernel(hidden.device, compute_dtype)
        if kernel:  # one buffer of row losses; a bf16 gradient buffer reused by every chunk
            size = min(chunk_size, hidden.shape[0])
            row_losses = torch.empty(size, dtype=torch.float32, device=hidden.device)
            bf16_grad = None
            if compute_dtype == torch.bfloat16:
                bf16_grad = hidden.new_empty(size, weight.shape[0], dtype=compute_dtype)
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            h = hidden[rows].to(compute_dtype)
            s = _matmul_wide(h, w.T, wide)  # (C, V) logits, fp32 (fp64 for fp64 compute)
            t = _matmul_wide(teacher_hidden[rows].to(compute_dtype), tw.T, wide)
            if kernel:  # (the gradient over the student's logits, or into the bf16 buffer)
                grad = s if bf16_grad is None else bf16_grad[: s.shape[0]]
                chunk_loss, grad_s = _kernel_loss_and_grad(
                    s, t, targets[rows], alpha, temperature, kind, ignore_index, grad, row_losses
                )
            else:
                chunk_loss, grad_s = _chunk_loss_and_grad(
                    s, t, targets[rows], alpha, temperature, kind, ignore_index
                )
            del s, t
            loss += chunk_loss
            grad_s = grad_s.to(compute_dtype)  # (the gradient products in compute_dtype, as
            if grad_hidden is not None:  # an unfused autocast backward runs them)
                grad_hidden[rows] = (grad_s @ w).to(hidden.dtype)
            if grad_weight is not None:
                _accumulate_matmul(grad_weight, grad_s.T, h)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_loss.to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_loss.to(grad_weight.dtype)).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, *[None] * 9


def linear_distillation_loss(
    hidden: Tensor,
    weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    targets: Tensor,
    *,
    alpha: float = 0.5,
    temperature: float = 1.0,
    kind: Literal["kl", "jsd"] = "kl",
    chunk_size: int = 1024,
    ignore_index: int = IGNORE_INDEX,
) -> Tensor:
    """The summed loss of the module docstring (divide by the count of rows with a target).

    hidden (N, d) and weight (V, d): the student's final hidden states and output weight;
    teacher_hidden (N, d_t) and teacher_weight (V, d_t): the teacher's (no gradient flows to
    them); targets (N,) ids or ignore_index. alpha in [0, 1] weighs the distillation term
    against the cross-entropy; temperature > 0 softens both distributions."""
    n, vocab = hidden.shape[0], weight.shape[0]
    if hidden.ndim != 2 or teacher_hidden.ndim != 2 or targets.shape != (n,):
        raise ValueError(
            f"hidden (N, d), teacher_hidden (N, d_t) and targets (N,) expected, got "
            f"{tuple(hidden.shape)}, {tuple(teacher_hidden.shape)}, {tuple(targets.shape)}"
        )
    if teacher_hidden.shape[0] != n or teacher_weight.shape[0] != vocab:
        raise ValueError(
            f"the teacher must see the same {n} rows over the same vocabulary of {vocab}: got "
            f"teacher_hidden {tuple(teacher_hidden.shape)}, teacher_weight "
            f"{tuple(teacher_weight.shape)}"
        )
    if weight.shape[1] != hidden.shape[1] or teacher_weight.shape[1] != teacher_hidden.shape[1]:
        raise ValueError("each model's output weight must take its own hidden size")
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if kind not in ("kl", "jsd"):
        raise ValueError(f"kind must be 'kl' or 'jsd', got {kind!r}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f"targets must be integer token ids, got {targets.dtype}")
    targets = row_targets(targets, vocab, ignore_index, "targets must be")
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type) and hidden.dtype != torch.float64:
        compute_dtype = torch.get_autocast_dtype(device_type)
    else:
        compute_dtype = hidden.dtype
    with _autocast_disabled(device_type):
        return LinearDistillationFunction.apply(
            hidden, weight, teacher_hidden.detach(), teacher_weight.detach(), targets, alpha,
            temperature, kind, chunk_size, ignore_index, compute_dtype,
        )  # fmt: skip
