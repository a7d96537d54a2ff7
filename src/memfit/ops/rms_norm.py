"""RMSNorm as a memory-lean autograd Function (plain PyTorch; a Triton kernel comes later).

Algorithm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization", eq. 4):

    rstd = 1 / sqrt(mean(x**2, over hidden) + eps)      # (..., 1)
    y    = x * rstd * weight                            # (..., hidden)

Backward, with xhat = x * rstd and g = dy * weight:

    dx      = rstd * (g - xhat * mean(g * xhat, over hidden))
    dweight = sum over all leading dims of dy * xhat

Memory: the Function saves only x (in its own dtype) and rstd (fp32, one value per row), plus a
reference to the weight parameter (no new memory), and recomputes xhat in backward. Eager
autograd on the same fp32 formula (Hugging Face's LlamaRMSNorm) saves an fp32 copy of x and
more: for a bf16 model that is at least 4 extra bytes per element, per norm, twice per layer.

Numerics: everything is computed in fp32 (fp64 when x is fp64), whatever x's dtype, and the
result is rounded once to x's dtype. The output dtype is x's dtype even when weight is an fp32
master weight; Hugging Face's LlamaRMSNorm instead rounds xhat to x's dtype and then multiplies
by the weight, which returns fp32 for an fp32 weight. The two agree to within one rounding of
x's dtype. dweight is reduced in fp32 and cast to weight's dtype.

Cautions: autocast does not change any op used here (there are no matmuls, and the ops that
autocast runs in fp32 already get fp32 inputs), so the Function gives the same result inside
and outside torch.autocast. The weight is saved with save_for_backward rather than stashed on
ctx so that an in-place update of it before backward is caught by autograd's version check.
"""

import torch
from torch import Tensor

__all__ = ["RMSNormFunction", "rms_norm"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for 16-bit inputs, fp64 for fp64 inputs (so that gradcheck works)."""
    return torch.promote_types(dtype, torch.float32)


class RMSNormFunction(torch.autograd.Function):
    """y = x * rsqrt(mean(x**2) + eps) * weight, saving x, rstd and the weight reference."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        compute_dtype = _compute_dtype(x.dtype)
        x_wide = x.to(compute_dtype)  # (..., hidden); no copy when x is already wide
        rstd = torch.rsqrt(x_wide.square().mean(dim=-1, keepdim=True) + eps)  # (..., 1)
        y = x_wide * rstd
        y.mul_(weight.to(compute_dtype))
        # weight is saved too (dx needs it), but it is the parameter itself: no new memory.
        ctx.save_for_backward(x, weight, rstd)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_y: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x, weight, rstd = ctx.saved_tensors
        compute_dtype = rstd.dtype
        xhat = x.to(compute_dtype) * rstd  # (..., hidden)
        grad_y_wide = grad_y.to(compute_dtype)

        grad_x = grad_weight = None
        if ctx.needs_input_grad[0]:
            g = grad_y_wide * weight.to(compute_dtype)  # (..., hidden)
            # d(xhat)/dx = rstd * (I - xhat xhat^T / hidden): remove g's component along xhat.
            row_dot = (g * xhat).mean(dim=-1, keepdim=True)  # (..., 1)
            grad_x = g.sub_(xhat * row_dot).mul_(rstd).to(x.dtype)
        if ctx.needs_input_grad[1]:
            grad_weight = (grad_y_wide * xhat).reshape(-1, xhat.shape[-1]).sum(dim=0)  # (hidden,)
            grad_weight = grad_weight.to(weight.dtype)
        return grad_x, grad_weight, None


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMS-normalize x over its last dimension and scale by weight.

    Args:
        x: (..., hidden) activations, fp32, bf16 or fp16 (fp64 is accepted, for testing).
        weight: (hidden,) scale, usually an fp32 master weight.
        eps: added to mean(x**2) before the square root; must be >= 0.

    Returns:
        (..., hidden) tensor of x's dtype (not promoted to weight's dtype). Differentiable in
        x and weight; for backward it keeps only x and a per-row fp32 rstd (and the weight).
    """
    if not x.is_floating_point() or not weight.is_floating_point():
        raise ValueError(
            f"rms_norm expects floating-point x and weight, got x.dtype={x.dtype} and "
            f"weight.dtype={weight.dtype}"
        )
    if x.dim() < 1 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"rms_norm expects x of shape (..., hidden) and weight of shape (hidden,), got "
            f"x.shape={tuple(x.shape)} and weight.shape={tuple(weight.shape)}"
        )
    if x.device != weight.device:
        raise ValueError(
            f"rms_norm expects x and weight on one device, got x on {x.device} and weight on "
            f"{weight.device}"
        )
    if not eps >= 0:  # also rejects NaN
        raise ValueError(f"rms_norm expects eps >= 0, got eps={eps}")
    return RMSNormFunction.apply(x, weight, float(eps))
