"""SwiGLU on a fused gate/up projection, as a memory-lean autograd Function: Triton kernels on
CUDA, plain PyTorch elsewhere.

Algorithm (Shazeer 2020, "GLU Variants Improve Transformer", eq. 5 / FFN_SwiGLU): the MLP of a
Llama block is down(silu(x W_gate) * (x W_up)). memfit computes x W_gate and x W_up with one
fused projection whose output gate_up is (..., 2 * ffn): the first half is the gate, the second
half is up. This op maps it to

    out = silu(gate) * up,        silu(g) = g * sigmoid(g)                       # (..., ffn)

and its backward, with s = sigmoid(gate):

    d_gate = d_out * up * s * (1 + gate * (1 - s))
    d_up   = d_out * silu(gate)

Two paths compute exactly this, and `SwiGLUFunction` picks one per call:

- Triton (CUDA tensors; CPU tensors inside `memfit.ops._triton.triton_on_cpu()`, run by Triton's
  interpreter, so
  that CI tests the kernels without a GPU). A 2-D grid over (rows, blocks of 1024 columns):
  the forward kernel reads gate and up once from the two halves of each gate_up row (rows may
  have any stride, e.g. when gate_up is a slice of a wider projection) and writes out; the
  backward kernel reads gate, up and d_out once and writes both halves of d_gate_up. Each
  element is touched once: 3 element transfers forward, 5 backward, the minimum.
- Plain PyTorch: everywhere else (CPU, fp64, no triton installed, e.g. on macOS) and while
  torch.compile traces, so that Inductor sees ordinary ops and fuses them itself. It is also the
  reference the kernels are tested against.

Memory: only gate_up is saved; sigmoid and silu are recomputed in backward. Eager autograd
saves gate, up and silu(gate) (1.5x gate_up's size, more when it upcasts). The gradient is
returned as one (..., 2 * ffn) tensor whose two halves are written in place, so the fused
projection's backward gets a single contiguous tensor and no torch.cat of two big halves.

Numerics: the elementwise math is done in fp32 (fp64 for fp64 inputs, PyTorch path only) and
rounded once to the input's dtype. The output keeps the input's dtype: under autocast gate_up is
already bf16 or fp16 (the output of an autocast matmul) and stays so; nothing is upcast for the
next matmul. The two paths differ only in the last bits of exp (the GPU's is approximate).

Cautions: autocast does not change any op used here (no matmuls; the ops autocast runs in fp32
already get fp32 inputs), so the result is the same inside and outside torch.autocast.
"""

import torch
from torch import Tensor

from memfit.ops._triton import (
    HAS_TRITON,
    gdc_launch_dependents,
    gdc_wait,
    launch,
    pdl_enabled,
    promoted_dtype,
    rows_view,
    tl,
    triton,
    use_triton,
)

__all__ = ["SwiGLUFunction", "swiglu", "swiglu_backward", "swiglu_forward"]

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ---------------------------------------------------------------------------------------------
# Kernels. Program (i, j) owns a (BLOCK_ROWS, BLOCK) tile: rows [i * BLOCK_ROWS, ...) and
# columns [j * BLOCK, ...) of out; BLOCK_ROWS is 1 unless ffn is small. In gate_up's rows, gate
# is at columns [0, ffn) and up at [ffn, 2 * ffn). Columns are
# contiguous, so loads and stores vectorize (16 bytes per thread when ffn and the row strides
# are multiples of 8 elements, as they are for real models). The row index is int64 so that
# row * stride cannot overflow.
# ---------------------------------------------------------------------------------------------


@triton.jit
def _tile_indices(rows, ffn, BLOCK_ROWS, BLOCK):
    """This program's (BLOCK_ROWS, BLOCK) tile: row and column indices and the in-bounds mask."""
    row_index = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    col_index = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (row_index < rows)[:, None] & (col_index < ffn)[None, :]  # (BLOCK_ROWS, BLOCK)
    return row_index, col_index, mask


@triton.jit
def _load_gate_up(gate_up_ptr, row_index, col_index, mask, stride_gate_up_row, ffn):
    """gate and up of a tile in fp32: a row of gate_up holds gate, then up, ffn columns each."""
    gate_ptrs = gate_up_ptr + row_index[:, None] * stride_gate_up_row + col_index[None, :]
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + ffn, mask=mask, other=0.0).to(tl.float32)
    return gate, up


@triton.jit(do_not_specialize=["rows"])
def _swiglu_forward_kernel(
    gate_up_ptr,
    out_ptr,
    rows,
    ffn,
    stride_gate_up_row,
    stride_out_row,
    BLOCK_ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # launched early (the engine's programmatic_launch): wait for the kernel before
        gdc_launch_dependents()
        gdc_wait()
    row_index, col_index, mask = _tile_indices(rows, ffn, BLOCK_ROWS, BLOCK)
    gate, up = _load_gate_up(gate_up_ptr, row_index, col_index, mask, stride_gate_up_row, ffn)

    out = gate * tl.sigmoid(gate) * up
    out_ptrs = out_ptr + row_index[:, None] * stride_out_row + col_index[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_backward_kernel(
    grad_out_ptr,
    gate_up_ptr,
    grad_gate_up_ptr,
    rows,
    ffn,
    stride_grad_out_row,
    stride_gate_up_row,
    stride_grad_gate_up_row,
    BLOCK_ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row_index, col_index, mask = _tile_indices(rows, ffn, BLOCK_ROWS, BLOCK)
    gate, up = _load_gate_up(gate_up_ptr, row_index, col_index, mask, stride_gate_up_row, ffn)
    grad_out_ptrs = grad_out_ptr + row_index[:, None] * stride_grad_out_row + col_index[None, :]
    grad_out = tl.load(grad_out_ptrs, mask=mask, other=0.0).to(tl.float32)

    sig = tl.sigmoid(gate)
    grad_up = grad_out * gate * sig  # d_out * silu(gate)
    # d silu(g) / dg = s + g * s * (1 - s) = s * (1 + g * (1 - s)).
    grad_gate = ((1.0 - sig) * gate + 1.0) * sig * grad_out * up

    grad_gate_ptrs = (
        grad_gate_up_ptr + row_index[:, None] * stride_grad_gate_up_row + col_index[None, :]
    )
    dtype = grad_gate_up_ptr.dtype.element_ty
    tl.store(grad_gate_ptrs, grad_gate.to(dtype), mask=mask)
    tl.store(grad_gate_ptrs + ffn, grad_up.to(dtype), mask=mask)


# ---------------------------------------------------------------------------------------------
# Launchers: validate, allocate, grid.
# ---------------------------------------------------------------------------------------------


def _tile(rows: int, ffn: int) -> tuple[int, int, int]:
    """(BLOCK_ROWS, BLOCK, num_warps): 1024 elements over 4 warps, 8 per thread (16 bytes in
    bf16); one row of 1024 columns for real models, several rows when ffn is small."""
    block = min(1024, triton.next_power_of_2(ffn))
    block_rows = min(1024 // block, triton.next_power_of_2(rows))
    return block_rows, block, 4


def _validate_gate_up(name: str, gate_up2d: Tensor) -> None:
    if not HAS_TRITON:
        raise RuntimeError(f"{name} needs triton; use swiglu(), which falls back to PyTorch")
    if gate_up2d.dim() != 2 or gate_up2d.stride(1) != 1 or gate_up2d.shape[1] % 2 != 0:
        raise ValueError(
            f"{name} expects a 2-D gate_up of shape (rows, 2 * ffn) with contiguous rows, got "
            f"shape={tuple(gate_up2d.shape)} and stride={gate_up2d.stride()}; reshape with "
            f"gate_up.reshape(-1, 2 * ffn) and call .contiguous()"
        )
    if gate_up2d.dtype not in _KERNEL_DTYPES:
        raise ValueError(
            f"{name} takes fp32, bf16 or fp16, got dtype={gate_up2d.dtype}; use swiglu() for "
            f"other dtypes"
        )
    if gate_up2d.numel() == 0:
        raise ValueError(f"{name} needs a non-empty gate_up, got shape={tuple(gate_up2d.shape)}")


def swiglu_forward(gate_up2d: Tensor) -> Tensor:
    """Triton forward. gate_up2d: (rows, 2 * ffn) with stride(1) == 1 (any row stride).

    Returns out (rows, ffn), contiguous, in gate_up2d's dtype.
    """
    _validate_gate_up("swiglu_forward", gate_up2d)
    rows, ffn = gate_up2d.shape[0], gate_up2d.shape[1] // 2
    out = torch.empty((rows, ffn), dtype=gate_up2d.dtype, device=gate_up2d.device)
    block_rows, block, num_warps = _tile(rows, ffn)
    launch(
        _swiglu_forward_kernel,
        (triton.cdiv(rows, block_rows), triton.cdiv(ffn, block)),
        gate_up2d.device,
        gate_up2d,
        out,
        rows,
        ffn,
        gate_up2d.stride(0),
        out.stride(0),
        BLOCK_ROWS=block_rows,
        BLOCK=block,
        PDL=pdl_enabled(gate_up2d.device),
        num_warps=num_warps,
    )
    return out


def swiglu_backward(grad_out2d: Tensor, gate_up2d: Tensor) -> Tensor:
    """Triton backward. grad_out2d: (rows, ffn), gate_up2d: (rows, 2 * ffn), both with
    stride(1) == 1 (any row stride).

    Returns grad_gate_up (rows, 2 * ffn), contiguous, in gate_up2d's dtype.
    """
    _validate_gate_up("swiglu_backward", gate_up2d)
    rows, ffn = gate_up2d.shape[0], gate_up2d.shape[1] // 2
    if grad_out2d.shape != (rows, ffn) or grad_out2d.stride(1) != 1:
        raise ValueError(
            f"swiglu_backward expects grad_out of shape ({rows}, {ffn}) with contiguous rows, "
            f"got shape={tuple(grad_out2d.shape)} and stride={grad_out2d.stride()}"
        )
    grad_gate_up = torch.empty((rows, 2 * ffn), dtype=gate_up2d.dtype, device=gate_up2d.device)
    block_rows, block, num_warps = _tile(rows, ffn)
    launch(
        _swiglu_backward_kernel,
        (triton.cdiv(rows, block_rows), triton.cdiv(ffn, block)),
        gate_up2d.device,
        grad_out2d,
        gate_up2d,
        grad_gate_up,
        rows,
        ffn,
        grad_out2d.stride(0),
        gate_up2d.stride(0),
        grad_gate_up.stride(0),
        BLOCK_ROWS=block_rows,
        BLOCK=block,
        num_warps=num_warps,
    )
    return grad_gate_up


# ---------------------------------------------------------------------------------------------
# Autograd Function: dispatch between the Triton kernels and the plain-PyTorch path.
# ---------------------------------------------------------------------------------------------


def _use_triton(gate_up: Tensor) -> bool:
    """The Triton kernels where `memfit.ops._triton.use_triton` says so and the dtype and size suit
    them; else the PyTorch path."""
    if gate_up.dtype not in _KERNEL_DTYPES or gate_up.numel() == 0:
        return False  # fp64 (gradcheck) stays on the PyTorch path
    return use_triton(gate_up)


class SwiGLUFunction(torch.autograd.Function):
    """out = silu(gate) * up for gate_up = [gate, up]; saves only gate_up."""

    @staticmethod
    def forward(ctx, gate_up: Tensor) -> Tensor:
        ffn = gate_up.shape[-1] // 2
        ctx.used_triton = _use_triton(gate_up)
        # gate_up itself is saved, not a 2-D copy of it (if reshape had to copy): no new memory.
        ctx.save_for_backward(gate_up)
        if ctx.used_triton:
            out2d = swiglu_forward(rows_view(gate_up))  # (rows, ffn)
            return out2d.view(*gate_up.shape[:-1], ffn)

        compute_dtype = promoted_dtype(gate_up.dtype)
        gate = gate_up[..., :ffn].to(compute_dtype)  # (..., ffn)
        up = gate_up[..., ffn:].to(compute_dtype)  # (..., ffn)
        out = torch.nn.functional.silu(gate).mul_(up)
        return out.to(gate_up.dtype)

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> Tensor:
        (gate_up,) = ctx.saved_tensors
        if ctx.used_triton:
            grad_gate_up2d = swiglu_backward(rows_view(grad_out), rows_view(gate_up))
            return grad_gate_up2d.view(gate_up.shape)  # (..., 2 * ffn)

        ffn = gate_up.shape[-1] // 2
        compute_dtype = promoted_dtype(gate_up.dtype)
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

    Runs the Triton kernels on CUDA (and on CPU inside `triton_on_cpu()`), plain PyTorch
    otherwise and while torch.compile traces; see the module docstring.

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
    if not (torch.is_grad_enabled() and gate_up.requires_grad) and _use_triton(gate_up):
        out2d = swiglu_forward(rows_view(gate_up))  # inference: no autograd bookkeeping
        return out2d.view(*gate_up.shape[:-1], gate_up.shape[-1] // 2)
    return SwiGLUFunction.apply(gate_up)
