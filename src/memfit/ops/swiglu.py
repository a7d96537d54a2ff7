"""SwiGLU activation on a fused gate/up projection, as a memory-lean autograd Function.

Algorithm (Shazeer 2020, "GLU Variants Improve Transformer", eq. 5 / FFN_SwiGLU): the MLP of a
Llama block is down(silu(x W_gate) * (x W_up)). memfit computes x W_gate and x W_up with one
fused projection whose output gate_up is (..., 2 * ffn): the first half is the gate, the second
half is up. This op maps it to

    out = silu(gate) * up,        silu(g) = g * sigmoid(g)                       # (..., ffn)

and its backward, with s = sigmoid(gate):

    d_gate = d_out * up * s * (1 + gate * (1 - s))
    d_up   = d_out * silu(gate)

Memory: only gate_up is saved; sigmoid and silu are recomputed in backward. Eager autograd
saves gate, up and silu(gate) (1.5x gate_up's size, more when it upcasts). The gradient is
returned as one (..., 2 * ffn) tensor whose two halves are written in place, so the fused
projection's backward gets a single contiguous tensor and no torch.cat of two big halves.

Numerics: the elementwise math is done in fp32 (fp64 for fp64 inputs) and rounded once to the
input's dtype. The output keeps the input's dtype: under autocast gate_up is already bf16 or
fp16 (the output of an autocast matmul) and stays so; nothing is upcast for the next matmul.

Cautions: autocast does not change any op used here (no matmuls; the ops autocast runs in fp32
already get fp32 inputs), so the result is the same inside and outside torch.autocast.
"""

import torch
from torch import Tensor

__all__ = ["SwiGLUFunction", "swiglu"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for 16-bit inputs, fp64 for fp64 inputs (so that gradcheck works)."""
    return torch.promote_types(dtype, torch.float32)


class SwiGLUFunction(torch.autograd.Function):
    """out = silu(gate) * up for gate_up = [gate, up]; saves only gate_up."""

    @staticmethod
    def forward(ctx, gate_up: Tensor) -> Tensor:
        ffn = gate_up.shape[-1] // 2
        compute_dtype = _compute_dtype(gate_up.dtype)
        gate = gate_up[..., :ffn].to(compute_dtype)  # (..., ffn)
        up = gate_up[..., ffn:].to(compute_dtype)  # (..., ffn)
        out = torch.nn.functional.silu(gate).mul_(up)
        ctx.save_for_backward(gate_up)
        return out.to(gate_up.dtype)

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> Tensor:
        (gate_up,) = ctx.saved_tensors
        ffn = gate_up.shape[-1] // 2
        compute_dtype = _compute_dtype(gate_up.dtype)
        gate = gate_up[..., :ffn].to(compute_dtype)  # (..., ffn)
        up = gate_up[..., ffn:].to(compute_dtype)  # (..., ffn)
        grad_out = grad_out.to(compute_dtype)

        sig = torch.sigmoid(gate)
        grad_gate_up = torch.empty(gate_up.shape, dtype=gate_up.dtype, device=gate_up.device)
        # d_up = d_out * silu(gate); the copy into the half rounds to gate_up's dtype.
        grad_gate_up[..., ffn:] = grad_out * gate * sig
        # d silu(g) / dg = s + g * s * (1 - s) = s * (1 + g * (1 - s)).
        d_silu = (1.0 - sig).mul_(gate).add_(1.0).mul_(sig)
        grad_gate_up[..., :ffn] = d_silu.mul_(grad_out).mul_(up)
        return grad_gate_up


def swiglu(gate_up: Tensor) -> Tensor:
    """silu(gate) * up for the output of a fused gate/up projection.

    Args:
        gate_up: (..., 2 * ffn) floating-point tensor; [..., :ffn] is the gate and
            [..., ffn:] is up. May be non-contiguous.

    Returns:
        (..., ffn) tensor of gate_up's dtype. Differentiable; backward saves only gate_up.
    """
    if not gate_up.is_floating_point():
        raise ValueError(f"swiglu expects a floating-point gate_up, got dtype={gate_up.dtype}")
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2 != 0:
        raise ValueError(
            f"swiglu expects gate_up of shape (..., 2 * ffn) with an even last dimension, got "
            f"shape={tuple(gate_up.shape)}"
        )
    return SwiGLUFunction.apply(gate_up)
