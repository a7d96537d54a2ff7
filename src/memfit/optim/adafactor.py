"""Adafactor: adaptive steps like Adam's with a factored second moment, so that a (rows, cols)
matrix keeps rows + cols statistics instead of rows x cols.

Reference: Shazeer and Stern 2018, "Adafactor: Adaptive Learning Rates with Sublinear Memory
Cost" (arXiv:1804.04235): Algorithm 4 (matrices) and 5 (vectors), with update clipping
(section 6), the increasing decay beta2_t (section 7.1) and relative step sizes (section 8).
Conventions of the published implementations (tensor2tensor, fairseq, Hugging Face): the
statistics are means rather than the paper's sums (V is the same), eps1 is added to g**2, the
parameter scaling also applies to a given lr, and the optional first moment averages the
clipped update.

Algorithm, step t of a parameter X with gradient G of shape (..., rows, cols):

    rho_t   = lr                                  (relative_step=False)
            = min(1e-2, 1 / sqrt(t))              (relative_step=True)
            = min(1e-6 * t, 1 / sqrt(t))          (relative_step=True, warmup_init=True)
    alpha_t = max(eps2, RMS(X_{t-1})) * rho_t     (scale_parameter=True; else rho_t)
    beta2_t = 1 - t ** decay_rate
    R_t = beta2_t * R_{t-1} + (1 - beta2_t) * mean over cols of (G**2 + eps1)    # (..., rows)
    C_t = beta2_t * C_{t-1} + (1 - beta2_t) * mean over rows of (G**2 + eps1)    # (..., cols)
    V_t = R_t C_t^T / mean(R_t)                   # (..., rows, cols), never materialized
    U_t = G / sqrt(V_t)
    U_t = U_t / max(1, RMS(U_t) / clip_threshold) # RMS over the whole tensor
    M_t = beta1 * M_{t-1} + (1 - beta1) * U_t;  U_t = M_t           (beta1 is not None)
    X_t = X_{t-1} - alpha_t * (U_t + weight_decay * X_{t-1})

A parameter of fewer than 2 dims (vectors, scalars) keeps the full second moment
V_t = beta2_t * V_{t-1} + (1 - beta2_t) * (G**2 + eps1). A tensor of more dims is a batch of
matrices over its last two dims (R and C per matrix, RMS(U) over the whole tensor).

Memory (`state_bytes`): 4 * (rows + cols) bytes per matrix of fp32 statistics (a 2048 x 2048
matrix: 16 KiB, 0.004 bytes per parameter; AdamW keeps 8), 4 bytes per element of a vector,
plus the momentum in the parameter's dtype when beta1 is set. The step counter is a CPU tensor,
so resume is exact and reading it never waits for the GPU.

Paths: on CUDA the fused Triton kernels of `memfit.ops.optim_factored` (four launches a step
for all the matrices of one shape and dtype, three passes over the gradient, no full-size
temporary; two launches per vector); elsewhere (CPU, and while
torch.compile traces) plain, vectorized PyTorch with the same formulas in the same order, which
is also the reference the kernels are tested against.

Numerics: statistics, u and the update in fp32; a bf16 or fp16 parameter (and its momentum) is
read, updated in fp32 and rounded once to nearest even. eps1 (1e-30) keeps R and C positive, so
a zero row of gradients gives u = 0, not NaN.

Cautions:
- With scale_parameter=True (the default, as in the references) the step is relative to the
  parameter's RMS: lr=1e-2 moves a matrix by about 1% of its RMS a step. For an absolute lr as
  with AdamW, pass scale_parameter=False. A zero-initialized parameter then moves by eps2 * lr.
- relative_step=True needs lr=None, and the group's lr stays None: torch's LR schedulers cannot
  drive it.
- R, C and RMS(U) depend on the whole tensor: ZeRO's flat shards cannot split these states.
- torch's load_state_dict casts every state to its parameter's dtype; `load_state_dict` here
  keeps the statistics fp32 and the step counter on the CPU.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from memfit.ops._triton import use_triton
from memfit.ops.optim_factored import (
    AdafactorStep,
    adafactor_factored_update,
    adafactor_full_update,
)
from memfit.optim.factored import FactoredOptimizer

__all__ = ["Adafactor", "state_bytes"]


def state_bytes(
    shape: Sequence[int], dtype: torch.dtype = torch.float32, *, beta1: float | None = None
) -> int:
    """Bytes of the tensor states Adafactor keeps for a parameter of `shape` and `dtype`:
    fp32 row and column statistics, 4 * (prod(shape[:-1]) + prod(shape[:-2]) * shape[-1]),
    for >= 2 dims; a full fp32 second moment, 4 * numel, for fewer; plus numel * itemsize for
    the momentum when beta1 is not None. The CPU step counter (4 bytes) is not counted."""
    shape = tuple(shape)
    numel = math.prod(shape)
    if len(shape) >= 2:
        statistics = 4 * (math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1])
    else:
        statistics = 4 * numel
    return statistics + (numel * dtype.itemsize if beta1 is not None else 0)


def _check_options(group: dict[str, Any]) -> None:
    """Raise ValueError naming the first bad option of a parameter group."""

    def bad(option: str, rule: str) -> ValueError:
        return ValueError(f"Adafactor: {option} must be {rule}, got {group[option]}")

    lr, relative_step = group["lr"], group["relative_step"]
    if relative_step and lr is not None:
        raise ValueError(
            f"Adafactor: lr must be None with relative_step=True (the step size is then "
            f"min(1e-2, 1/sqrt(t))), got lr={lr}; pass lr=None or relative_step=False"
        )
    if not relative_step and lr is None:
        raise ValueError("Adafactor: lr is None; pass a float lr, or relative_step=True")
    if lr is not None and not (isinstance(lr, (int, float)) and 0 <= lr < math.inf):
        raise bad("lr", "a float >= 0")
    eps = group["eps"]
    if not (isinstance(eps, Sequence) and len(eps) == 2):
        raise bad("eps", "a pair (eps1, eps2)")
    if not (isinstance(eps[0], (int, float)) and 0 < eps[0] < math.inf):
        raise ValueError(f"Adafactor: eps[0] (eps1, added to g**2) must be > 0, got {eps[0]}")
    if not (isinstance(eps[1], (int, float)) and 0 <= eps[1] < math.inf):
        raise ValueError(
            f"Adafactor: eps[1] (eps2, the least parameter scale) must be >= 0, got {eps[1]}"
        )
    if not (isinstance(group["clip_threshold"], (int, float)) and group["clip_threshold"] > 0):
        raise bad("clip_threshold", "> 0 (math.inf: no clipping)")
    if not (isinstance(group["decay_rate"], (int, float)) and -math.inf < group["decay_rate"] <= 0):
        raise bad("decay_rate", "<= 0 (beta2_t = 1 - t**decay_rate; the paper's -0.8)")
    beta1 = group["beta1"]
    if beta1 is not None and not (isinstance(beta1, (int, float)) and 0 <= beta1 < 1):
        raise bad("beta1", "None (no first moment) or in [0, 1)")
    if not (
        isinstance(group["weight_decay"], (int, float)) and 0 <= group["weight_decay"] < math.inf
    ):
        raise bad("weight_decay", ">= 0")
    for option in ("scale_parameter", "relative_step", "warmup_init"):
        if not isinstance(group[option], bool):
            raise bad(option, "True or False")
    if group["warmup_init"] and not relative_step:
        raise ValueError("Adafactor: warmup_init=True needs relative_step=True")


def _relative_lr(group: dict[str, Any], step: float) -> float:
    """rho_t: the given lr, or the relative step size of the paper's section 8."""
    if not group["relative_step"]:
        return group["lr"]
    cap = 1e-6 * step if group["warmup_init"] else 1e-2
    return min(cap, 1.0 / math.sqrt(step))


class Adafactor(FactoredOptimizer):
    """Adafactor (Shazeer and Stern 2018; see the module docstring for the algorithm).

    params: parameters or parameter groups (float32, bfloat16 or float16). lr: the step size
    rho (relative to the parameter's RMS when scale_parameter), or None with relative_step.
    eps: (eps1 added to g**2, eps2 the least parameter scale). clip_threshold: d of the update
    clipping (math.inf: none). decay_rate: beta2_t = 1 - t**decay_rate. beta1: the first
    moment's decay, or None for none (its state costs a parameter-sized tensor). weight_decay:
    decoupled, multiplied by the step size. scale_parameter, relative_step, warmup_init: as in
    the paper's section 8 (see the module docstring).

    State per parameter: "step" (CPU fp32 scalar tensor); "row" (..., rows) and "col"
    (..., cols) fp32 for >= 2 dims, else "sq" (the parameter's shape, fp32); "momentum" (the
    parameter's shape and dtype) when beta1 is not None. `Adafactor.state_bytes(shape, dtype,
    beta1=...)` counts them.
    """

    state_bytes = staticmethod(state_bytes)

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | None = None,
        *,
        eps: tuple[float, float] = (1e-30, 1e-3),
        clip_threshold: float = 1.0,
        decay_rate: float = -0.8,
        beta1: float | None = None,
        weight_decay: float = 0.0,
        scale_parameter: bool = True,
        relative_step: bool = False,
        warmup_init: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr,
            eps=eps,
            clip_threshold=clip_threshold,
            decay_rate=decay_rate,
            beta1=beta1,
            weight_decay=weight_decay,
            scale_parameter=scale_parameter,
            relative_step=relative_step,
            warmup_init=warmup_init,
        )
        _check_options(defaults)
        super().__init__(params, defaults)

    check_options = staticmethod(_check_options)

    def init_state(self, param: Tensor, state: dict[str, Tensor]) -> None:
        if param.dim() >= 2:  # the statistics: (..., rows) and (..., cols)
            state["row"] = param.new_zeros(param.shape[:-1], dtype=torch.float32)
            state["col"] = param.new_zeros(param.shape[:-2] + param.shape[-1:], dtype=torch.float32)
        else:
            state["sq"] = param.new_zeros(param.shape, dtype=torch.float32)

    def has_momentum(self, group: dict[str, Any]) -> bool:
        return group["beta1"] is not None

    def together_key(self, param: Tensor, step: float) -> tuple:
        return (step, param.shape[-2:], param.dtype)

    def update_together(self, params: list[Tensor], group: dict[str, Any], step: float) -> None:
        states = [self.state[p] for p in params]
        adafactor_factored_update(
            params,
            [p.grad.contiguous() for p in params],
            [s["row"] for s in states],
            [s["col"] for s in states],
            self.momenta(params, group),
            self._options(group, step),
        )

    @staticmethod
    def _options(group: dict[str, Any], step: float) -> AdafactorStep:
        eps1, eps2 = group["eps"]
        beta1 = group["beta1"]
        return AdafactorStep(
            relative_lr=_relative_lr(group, step),
            beta2=1.0 - step ** group["decay_rate"],
            eps1=eps1,
            eps2=eps2,
            clip_threshold=group["clip_threshold"],
            beta1=beta1 if beta1 is not None else 0.0,
            weight_decay=group["weight_decay"],
            scale_parameter=group["scale_parameter"],
        )

    def update_alone(self, param: Tensor, group: dict[str, Any], step: float) -> None:
        """The torch path, or the kernels for a vector or a matrix that is not contiguous."""
        state, grad = self.state[param], param.grad
        options = self._options(group, step)
        momentum = state["momentum"] if group["beta1"] is not None else None
        if not use_triton(param):
            _update_torch(param, grad, state, momentum, options)
            return
        target = param if param.is_contiguous() else param.contiguous()
        grad = grad.contiguous()
        if "row" in state:
            moment = [momentum] if momentum is not None else None
            adafactor_factored_update(
                [target], [grad], [state["row"]], [state["col"]], moment, options
            )
        else:
            adafactor_full_update(target, grad, state["sq"], momentum, options)
        if target is not param:
            param.copy_(target)


def _update_torch(
    param: Tensor,
    grad: Tensor,
    state: dict[str, Tensor],
    momentum: Tensor | None,
    options: AdafactorStep,
) -> None:
    """One step in plain PyTorch: the formulas of the kernels, in their order."""
    beta2, eps1, beta1 = options.beta2, options.eps1, options.beta1
    clip_threshold, relative_lr = options.clip_threshold, options.relative_lr
    grad32 = grad.float()
    if "row" in state:
        row, col = state["row"], state["col"]
        square = grad32 * grad32  # (..., rows, cols)
        row.mul_(beta2).add_(square.mean(-1) + eps1, alpha=1.0 - beta2)  # (..., rows)
        col.mul_(beta2).add_(square.mean(-2) + eps1, alpha=1.0 - beta2)  # (..., cols)
        row_factor = torch.rsqrt(row / row.mean(-1, keepdim=True))  # (..., rows)
        update = grad32 * row_factor.unsqueeze(-1) * torch.rsqrt(col).unsqueeze(-2)
    else:
        second_moment = state["sq"]
        second_moment.mul_(beta2).add_(grad32 * grad32 + eps1, alpha=1.0 - beta2)
        update = grad32 * torch.rsqrt(second_moment)
    if math.isfinite(clip_threshold):
        update_rms = update.square().mean().sqrt()
        update = update / (update_rms / clip_threshold).clamp_min(1.0)
    if momentum is not None:
        momentum.copy_(beta1 * momentum.float() + (1.0 - beta1) * update)
        update = momentum.float()
    param32 = param.float()
    lr = relative_lr
    if options.scale_parameter:  # a 0-dim tensor: no wait for the GPU
        lr = param32.square().mean().sqrt().clamp_min(options.eps2) * relative_lr
    param.copy_(param32 - lr * (update + options.weight_decay * param32))
