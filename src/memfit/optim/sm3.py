"""SM3: Adagrad-like adaptive steps whose squared-gradient sums are kept per row and per column
of a matrix (rows + cols accumulators instead of rows x cols).

Reference: Anil, Gupta, Koren and Singer 2019, "Memory-Efficient Adaptive Optimization"
(arXiv:1901.11150), SM3-II, with the rows and the columns of a matrix as its cover sets (the
paper's choice for matrices) and the momentum of the paper's experiments as in the authors'
published implementation: an exponential average of the preconditioned gradient.

Algorithm, step t of a parameter X with gradient G, seen as a (rows, cols) matrix:

    nu_ij = min(row_acc_i, col_acc_j) + G_ij**2    # (rows, cols), never stored
    U_ij  = G_ij / sqrt(nu_ij + eps)                # 0 where nu_ij + eps == 0 (then G_ij == 0)
    row_acc_i = max_j nu_ij;  col_acc_j = max_i nu_ij
    M_t = beta1 * M_{t-1} + (1 - beta1) * U_t;  U_t = M_t      (beta1 > 0)
    X_t = X_{t-1} - lr * (U_t + weight_decay * X_{t-1})

Every nu_ij is at least the sum of G_ij**2 over the steps so far (the covers' maxima bound it),
so the step is never larger than diagonal Adagrad's. A vector (or a scalar) has one cover per
element: acc = acc + G**2, diagonal Adagrad. A tensor of more than 2 dims is covered as the
(prod(shape[:-1]), shape[-1]) matrix of its last dim; the paper's one cover per dim would keep
sum(shape) accumulators instead (memfit's models have none: their weights are matrices).

Memory (`state_bytes`): 4 * (rows + cols) bytes of fp32 accumulators per matrix (a 2048 x 2048
matrix: 16 KiB, 0.004 bytes per parameter), 4 bytes per element of a vector, plus the momentum in
the parameter's dtype when beta1 > 0 (the paper's experiments use 0.9: then the state is about
half of AdamW's for fp32 parameters). The step counter is a CPU tensor.

Paths: on CUDA the fused Triton kernels of `memfit.ops.optim_factored` (one pass over the
gradient and the parameter, then a tiny kernel for the new accumulators, each one launch for
all the matrices of one shape and dtype); elsewhere (CPU, and
while torch.compile traces) plain, vectorized PyTorch with the same formulas, which is also the
reference the kernels are tested against.

Numerics: accumulators and the update in fp32; a bf16 or fp16 parameter (and its momentum) is
updated in fp32 and rounded once to nearest even. The accumulators only grow (SM3-II has no
decay), so SM3's effective step shrinks like Adagrad's: the paper pairs it with a warmup and no
decay of lr.

Cautions: the covers span whole tensors, so ZeRO's flat shards cannot split these states.
torch's load_state_dict casts every state to its parameter's dtype; `load_state_dict` here keeps
the accumulators fp32 and the step counter on the CPU.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from memfit.ops._triton import use_triton
from memfit.ops.optim_factored import sm3_matrix_update, sm3_vector_update
from memfit.optim.factored import FactoredOptimizer

__all__ = ["SM3", "state_bytes"]


def state_bytes(
    shape: Sequence[int], dtype: torch.dtype = torch.float32, *, beta1: float = 0.9
) -> int:
    """Bytes of the tensor states SM3 keeps for a parameter of `shape` and `dtype`: fp32 row
    and column accumulators, 4 * (prod(shape[:-1]) + shape[-1]), for >= 2 dims; one fp32
    accumulator per element, 4 * numel, for fewer; plus numel * itemsize for the momentum when
    beta1 > 0. The CPU step counter (4 bytes) is not counted."""
    shape = tuple(shape)
    numel = math.prod(shape)
    accumulators = 4 * (math.prod(shape[:-1]) + shape[-1]) if len(shape) >= 2 else 4 * numel
    return accumulators + (numel * dtype.itemsize if beta1 > 0 else 0)


def _check_options(group: dict[str, Any]) -> None:
    """Raise ValueError naming the first bad option of a parameter group."""

    def number_in(option: str, low: float, high: float, rule: str) -> None:
        value = group[option]
        if not (isinstance(value, (int, float)) and low <= value < high):
            raise ValueError(f"SM3: {option} must be {rule}, got {value}")

    number_in("lr", 0, math.inf, "a float >= 0")
    number_in("beta1", 0, 1, "in [0, 1) (0: no momentum)")
    number_in("eps", 0, math.inf, ">= 0")
    number_in("weight_decay", 0, math.inf, ">= 0")


class SM3(FactoredOptimizer):
    """SM3-II (Anil et al. 2019; see the module docstring for the algorithm).

    params: parameters or parameter groups (float32, bfloat16 or float16). lr: the step size.
    beta1: the momentum's decay (0: none; 0.9 as in the paper's experiments; its state costs a
    parameter-sized tensor). eps: added to nu under the square root (0: a safe divide).
    weight_decay: decoupled, multiplied by lr.

    State per parameter: "step" (CPU fp32 scalar tensor); "row_acc" (shape[:-1]) and "col_acc"
    (shape[-1],) fp32 for >= 2 dims, else "acc" (the parameter's shape, fp32); "momentum" (the
    parameter's shape and dtype) when beta1 > 0. `SM3.state_bytes(shape, dtype, beta1=...)`
    counts them.
    """

    state_bytes = staticmethod(state_bytes)

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 0.1,
        *,
        beta1: float = 0.9,
        eps: float = 0.0,
        weight_decay: float = 0.0,
    ) -> None:
        defaults = dict(lr=lr, beta1=beta1, eps=eps, weight_decay=weight_decay)
        _check_options(defaults)
        super().__init__(params, defaults)

    check_options = staticmethod(_check_options)

    def init_state(self, param: Tensor, state: dict[str, Tensor]) -> None:
        if param.dim() >= 2:
            state["row_acc"] = param.new_zeros(param.shape[:-1], dtype=torch.float32)
            state["col_acc"] = param.new_zeros(param.shape[-1:], dtype=torch.float32)
        else:
            state["acc"] = param.new_zeros(param.shape, dtype=torch.float32)

    def has_momentum(self, group: dict[str, Any]) -> bool:
        return group["beta1"] > 0

    def together_key(self, param: Tensor, step: float) -> tuple:
        return (step, param.numel() // param.shape[-1], param.shape[-1], param.dtype)

    @staticmethod
    def _options(group: dict[str, Any]) -> dict[str, float]:
        return dict(
            lr=group["lr"], eps=group["eps"], beta1=group["beta1"],
            weight_decay=group["weight_decay"],
        )  # fmt: skip

    def update_together(self, params: list[Tensor], group: dict[str, Any], step: float) -> None:
        states = [self.state[p] for p in params]
        sm3_matrix_update(
            params,
            [p.grad.contiguous() for p in params],
            [s["row_acc"].view(-1) for s in states],  # (rows,): all leading dims
            [s["col_acc"] for s in states],
            self.momenta(params, group),
            **self._options(group),
        )

    def update_alone(self, param: Tensor, group: dict[str, Any], step: float) -> None:
        """The torch path, or the kernels for a vector or a matrix that is not contiguous."""
        state, grad = self.state[param], param.grad
        momentum = state["momentum"] if self.has_momentum(group) else None
        if not use_triton(param):
            _update_torch(param, grad, state, momentum, **self._options(group))
            return
        target = param if param.is_contiguous() else param.contiguous()
        grad = grad.contiguous()
        if "row_acc" in state:
            sm3_matrix_update(
                [target], [grad], [state["row_acc"].view(-1)], [state["col_acc"]],
                [momentum] if momentum is not None else None, **self._options(group),
            )  # fmt: skip
        else:
            sm3_vector_update(target, grad, state["acc"], momentum, **self._options(group))
        if target is not param:
            param.copy_(target)


def _update_torch(
    param: Tensor,
    grad: Tensor,
    state: dict[str, Tensor],
    momentum: Tensor | None,
    *,
    lr: float,
    eps: float,
    beta1: float,
    weight_decay: float,
) -> None:
    """One step in plain PyTorch: the formulas of the kernels, in their order."""
    grad32 = grad.float()
    if "row_acc" in state:
        row_acc, col_acc = state["row_acc"], state["col_acc"]  # (...,), (cols,)
        nu = torch.minimum(row_acc.unsqueeze(-1), col_acc) + grad32 * grad32  # (..., cols)
        row_acc.copy_(nu.amax(-1))
        col_acc.copy_(nu.reshape(-1, nu.shape[-1]).amax(0))
    else:
        nu = state["acc"].add_(grad32 * grad32)
    denominator = nu + eps
    update = grad32 / torch.where(denominator > 0, denominator, 1.0).sqrt()
    if momentum is not None:
        momentum.copy_(beta1 * momentum.float() + (1.0 - beta1) * update)
        update = momentum.float()
    param32 = param.float()
    param.copy_(param32 - lr * (update + weight_decay * param32))
