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
cast to the compute dtype once (no copy when it is stored so: a frozen bf16 head). The per-row
work is plain PyTorch (a few passes over each chunk's logits); a Triton kernel for it, as the
cross-entropy has, is the next step.

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

from memfit.ops.cross_entropy import _accumulate_matmul, _autocast_disabled, _matmul_wide

IGNORE_INDEX = -100


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
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            h = hidden[rows].to(compute_dtype)
            s = _matmul_wide(h, w.T, wide)  # (C, V) logits, fp32 (fp64 for fp64 compute)
            t = _matmul_wide(teacher_hidden[rows].to(compute_dtype), tw.T, wide)
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
