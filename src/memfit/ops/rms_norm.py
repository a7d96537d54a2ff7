"""RMSNorm as a memory-lean autograd Function: single-pass Triton kernels, plain PyTorch elsewhere.

Algorithm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization", eq. 4):

    rstd = 1 / sqrt(mean(x**2, over hidden) + eps)      # (..., 1)
    y    = x * rstd * weight                            # (..., hidden)

Backward, with xhat = x * rstd and g = dy * weight:

    dx      = rstd * (g - xhat * mean(g * xhat, over hidden))
    dweight = sum over all leading dims of dy * xhat

Two paths compute exactly this, and `RMSNormFunction` picks one per call:

- Triton (CUDA tensors; CPU tensors inside `memfit.ops._triton.triton_on_cpu()`, run by Triton's
  interpreter, so
  that CI tests the kernels without a GPU). The forward kernel reads a block of rows once and
  writes y and rstd; the backward kernel reads x, dy and rstd once and writes dx. dweight is
  reduced without atomics, so it is deterministic: a fixed grid of persistent programs (about
  16 warps per SM) each loops over its rows and accumulates a (hidden,) fp32 partial sum in
  registers, and the (programs, hidden) partials are summed by torch afterwards. Hidden sizes
  up to 32768 are fused (the whole row lives in registers); larger ones take the PyTorch path.
- Plain PyTorch: everywhere else (CPU, fp64, no triton installed, e.g. on macOS) and while
  torch.compile traces, so that Inductor sees ordinary ops and fuses them itself. It is also the
  reference the kernels are tested against.

Memory: the Function saves only x (in its own dtype) and rstd (fp32, one value per row), plus a
reference to the weight parameter (no new memory), and recomputes xhat in backward. Eager
autograd on the same fp32 formula (Hugging Face's LlamaRMSNorm) saves an fp32 copy of x and
more: for a bf16 model that is at least 4 extra bytes per element, per norm, twice per layer.

Numerics: everything is computed in fp32 (fp64 when x is fp64, PyTorch path only), whatever x's
dtype, and the result is rounded once to x's dtype. The two paths differ only in the order of
fp32 sums (and, on GPU, in the last bits of rsqrt and division). The output dtype is x's dtype
even when weight is an fp32 master weight; Hugging Face's LlamaRMSNorm instead rounds xhat to
x's dtype and then multiplies by the weight, which returns fp32 for an fp32 weight. The two agree
to within one rounding of x's dtype. dweight is reduced in fp32 and cast to weight's dtype.

Cautions: autocast does not change any op used here (there are no matmuls, and the ops that
autocast runs in fp32 already get fp32 inputs), so the Function gives the same result inside
and outside torch.autocast. The weight is saved with save_for_backward rather than stashed on
ctx so that an in-place update of it before backward is caught by autograd's version check.
"""

import functools

import torch
from torch import Tensor

from memfit.ops._triton import (
    HAS_TRITON,
    gdc_launch_dependents,
    gdc_wait,
    launch,
    pdl_enabled,
    promoted_dtype,
    round_to_bf16,
    rows_view,
    tl,
    triton,
    use_triton,
)

__all__ = ["RMSNormFunction", "add_rms_norm", "rms_norm", "rms_norm_backward", "rms_norm_forward"]

# Rows up to this size are normalized in registers in one pass (32 warps x 32 fp32 values per
# thread per tensor at the limit); longer rows take the PyTorch path.
MAX_FUSED_HIDDEN = 32768
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ---------------------------------------------------------------------------------------------
# Kernels. Each program owns a (BLOCK_ROWS, BLOCK_HIDDEN) tile: one row for hidden > 2048,
# several rows for smaller hidden so that a program still moves a few KiB. Columns are contiguous
# (stride 1); rows have a stride. Row indices are int64 so that row * stride cannot overflow.
# ---------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["rows"])
def _rms_norm_forward_kernel(
    x_ptr,
    weight_ptr,
    y_ptr,
    rstd_ptr,
    branch_ptr,
    sum_ptr,
    rows,
    hidden,
    stride_x_row,
    stride_y_row,
    stride_branch_row,
    stride_sum_row,
    eps,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_HIDDEN: tl.constexpr,
    RESIDUAL: tl.constexpr,
    ROUND_BF16_BY_HAND: tl.constexpr,
    PDL: tl.constexpr,
):
    """RESIDUAL: x is first replaced by x + branch, rounded to x's dtype (as torch's add
    rounds) and stored to sum; the norm is then that of the stored sum. PDL: launched early
    (programmatic dependent launch), it waits for the kernel before before it reads."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    row_index = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    col_index = tl.arange(0, BLOCK_HIDDEN)
    row_mask = row_index < rows
    col_mask = col_index < hidden
    mask = row_mask[:, None] & col_mask[None, :]  # (BLOCK_ROWS, BLOCK_HIDDEN)

    x_ptrs = x_ptr + row_index[:, None] * stride_x_row + col_index[None, :]
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    if RESIDUAL:
        b_ptrs = branch_ptr + row_index[:, None] * stride_branch_row + col_index[None, :]
        x += tl.load(b_ptrs, mask=mask, other=0.0).to(tl.float32)
        if ROUND_BF16_BY_HAND:
            x = round_to_bf16(x)
        x_sum = x.to(sum_ptr.dtype.element_ty)
        s_ptrs = sum_ptr + row_index[:, None] * stride_sum_row + col_index[None, :]
        tl.store(s_ptrs, x_sum, mask=mask)
        x = x_sum.to(tl.float32)
    weight = tl.load(weight_ptr + col_index, mask=col_mask, other=0.0).to(tl.float32)

    # Masked columns load as 0, so the sum is over the hidden real ones.
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / hidden + eps)  # (BLOCK_ROWS,)
    y = x * rstd[:, None] * weight[None, :]  # same order as the PyTorch path: (x * rstd) * w

    y_ptrs = y_ptr + row_index[:, None] * stride_y_row + col_index[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row_index, rstd, mask=row_mask)


@triton.jit
def _rms_norm_backward_kernel(
    grad_y_ptr,
    x_ptr,
    weight_ptr,
    rstd_ptr,
    grad_x_ptr,
    grad_weight_partial_ptr,
    rows,
    hidden,
    stride_grad_y_row,
    stride_x_row,
    stride_grad_x_row,
    row_blocks,
    num_programs,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_HIDDEN: tl.constexpr,
    COMPUTE_GRAD_X: tl.constexpr,
    COMPUTE_GRAD_WEIGHT: tl.constexpr,
):
    # Persistent: program p handles row blocks p, p + num_programs, ... and keeps its share of
    # dweight in registers; it writes one (hidden,) fp32 partial at the end (no atomics).
    program = tl.program_id(0)
    col_index = tl.arange(0, BLOCK_HIDDEN)
    col_mask = col_index < hidden
    weight = tl.load(weight_ptr + col_index, mask=col_mask, other=0.0).to(tl.float32)
    grad_weight_acc = tl.zeros((BLOCK_ROWS, BLOCK_HIDDEN), dtype=tl.float32)

    # A while loop rather than range(program, row_blocks, num_programs): Triton 3.6's
    # interpreter cannot take tensors as range bounds under NumPy >= 2.3.
    row_block = program
    while row_block < row_blocks:
        row_index = (row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
        row_mask = row_index < rows
        mask = row_mask[:, None] & col_mask[None, :]  # (BLOCK_ROWS, BLOCK_HIDDEN)

        x_ptrs = x_ptr + row_index[:, None] * stride_x_row + col_index[None, :]
        grad_y_ptrs = grad_y_ptr + row_index[:, None] * stride_grad_y_row + col_index[None, :]
        x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
        grad_y = tl.load(grad_y_ptrs, mask=mask, other=0.0).to(tl.float32)
        # Masked rows get rstd = 0, hence xhat = 0: they add nothing to dweight.
        rstd = tl.load(rstd_ptr + row_index, mask=row_mask, other=0.0)  # (BLOCK_ROWS,)
        x_hat = x * rstd[:, None]

        if COMPUTE_GRAD_X:
            g = grad_y * weight[None, :]
            # d(xhat)/dx = rstd * (I - xhat xhat^T / hidden): remove g's component along xhat.
            row_dot = tl.sum(g * x_hat, axis=1) / hidden  # (BLOCK_ROWS,)
            grad_x = (g - x_hat * row_dot[:, None]) * rstd[:, None]
            grad_x_ptrs = grad_x_ptr + row_index[:, None] * stride_grad_x_row + col_index[None, :]
            tl.store(grad_x_ptrs, grad_x.to(grad_x_ptr.dtype.element_ty), mask=mask)
        if COMPUTE_GRAD_WEIGHT:
            grad_weight_acc += grad_y * x_hat
        row_block += num_programs

    if COMPUTE_GRAD_WEIGHT:
        grad_weight_partial = tl.sum(grad_weight_acc, axis=0)  # (BLOCK_HIDDEN,)
        tl.store(
            grad_weight_partial_ptr + program * hidden + col_index,
            grad_weight_partial,
            mask=col_mask,
        )


# ---------------------------------------------------------------------------------------------
# Launchers: validate, allocate, grid.
# ---------------------------------------------------------------------------------------------


def _tile(rows: int, hidden: int) -> tuple[int, int, int]:
    """(BLOCK_ROWS, BLOCK_HIDDEN, num_warps): at least 4096 elements per tile, 512 per warp."""
    block_hidden = triton.next_power_of_2(hidden)
    block_rows = min(max(1, 4096 // block_hidden), triton.next_power_of_2(rows))
    num_warps = min(max(block_rows * block_hidden // 512, 4), 32)
    return block_rows, block_hidden, num_warps


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _backward_programs(device: torch.device, num_warps: int) -> int:
    """Persistent programs in the backward grid: about 16 warps per SM, which measured best on an
    H100 at hidden 2048 (more programs mean more (hidden,) partials for the final sum to read
    back, and no faster loop). A few on CPU (the interpreter), so that tests see programs
    looping over several tiles."""
    if device.type != "cuda":
        return 4
    return max(1, 16 // num_warps) * _sm_count(device.index or 0)


def _validate_kernel_inputs(name: str, x2d: Tensor, weight: Tensor) -> None:
    if not HAS_TRITON:
        raise RuntimeError(f"{name} needs triton; use rms_norm(), which falls back to PyTorch")
    if x2d.dim() != 2 or x2d.stride(1) != 1:
        raise ValueError(
            f"{name} expects a 2-D x with contiguous rows, got shape={tuple(x2d.shape)} and "
            f"stride={x2d.stride()}; reshape with x.reshape(-1, hidden) and call .contiguous()"
        )
    rows, hidden = x2d.shape
    if weight.shape != (hidden,) or x2d.device != weight.device:
        raise ValueError(
            f"{name} expects weight of shape ({hidden},) on {x2d.device}, got "
            f"shape={tuple(weight.shape)} on {weight.device}"
        )
    if x2d.dtype not in _KERNEL_DTYPES or weight.dtype not in _KERNEL_DTYPES:
        raise ValueError(
            f"{name} takes fp32, bf16 or fp16 tensors, got x.dtype={x2d.dtype} and "
            f"weight.dtype={weight.dtype}; use rms_norm() for other dtypes"
        )
    if not 0 < hidden <= MAX_FUSED_HIDDEN or rows == 0:
        raise ValueError(
            f"{name} takes 1 <= hidden <= {MAX_FUSED_HIDDEN} and rows >= 1, got rows={rows} and "
            f"hidden={hidden}; use rms_norm(), which falls back to PyTorch"
        )


def rms_norm_forward(x2d: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Triton forward. x2d: (rows, hidden) with stride(1) == 1; weight: (hidden,).

    Returns y (rows, hidden) in x2d's dtype and rstd (rows,) fp32.
    """
    _validate_kernel_inputs("rms_norm_forward", x2d, weight)
    rows, hidden = x2d.shape
    weight = weight.contiguous()
    y = torch.empty((rows, hidden), dtype=x2d.dtype, device=x2d.device)
    rstd = torch.empty((rows,), dtype=torch.float32, device=x2d.device)
    _launch_forward(x2d, weight, eps, y, rstd)
    return y, rstd


def _launch_forward(x2d, weight, eps, y, rstd, branch=None, total=None) -> None:
    """The forward kernel; with PDL inside the engine's `programmatic_launch` (no gradient)."""
    rows, hidden = x2d.shape
    block_rows, block_hidden, num_warps = _tile(rows, hidden)
    residual = branch is not None
    branch, total = (branch, total) if residual else (x2d, x2d)
    launch(
        _rms_norm_forward_kernel, (triton.cdiv(rows, block_rows),), x2d.device,
        x2d, weight, y, rstd, branch, total, rows, hidden, x2d.stride(0), y.stride(0),
        branch.stride(0), total.stride(0), eps,
        BLOCK_ROWS=block_rows, BLOCK_HIDDEN=block_hidden, RESIDUAL=residual,
        ROUND_BF16_BY_HAND=x2d.device.type == "cpu" and x2d.dtype == torch.bfloat16,
        PDL=pdl_enabled(x2d.device), num_warps=num_warps,
    )  # fmt: skip


def add_rms_norm(x: Tensor, branch: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """A residual add and the RMSNorm after it, `s = x + branch; return rms_norm(s), s`, in one
    kernel where Triton runs and no gradient is needed (inference: a decode layer's two adds
    are two launches fewer); the two ops otherwise. x, branch: (..., hidden) of one dtype and
    shape. The same values either way: s is rounded to x's dtype before it is normalized."""
    if x.shape != branch.shape or x.dtype != branch.dtype:
        raise ValueError(
            f"add_rms_norm expects x and branch of one shape and dtype, got {tuple(x.shape)} "
            f"{x.dtype} and {tuple(branch.shape)} {branch.dtype}"
        )
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (x, branch, weight))
    if grad or not _use_triton(x, weight):
        total = x + branch
        return rms_norm(total, weight, eps), total
    x2d, b2d = rows_view(x), rows_view(branch)
    total = torch.empty(x2d.shape, dtype=x.dtype, device=x.device)
    y = torch.empty_like(total)
    rstd = torch.empty(x2d.shape[0], dtype=torch.float32, device=x.device)
    _launch_forward(x2d, weight.contiguous(), eps, y, rstd, b2d, total)
    return y.view(x.shape), total.view(x.shape)


def rms_norm_backward(
    grad_y2d: Tensor,
    x2d: Tensor,
    weight: Tensor,
    rstd: Tensor,
    *,
    compute_grad_x: bool = True,
    compute_grad_weight: bool = True,
) -> tuple[Tensor | None, Tensor | None]:
    """Triton backward. grad_y2d, x2d: (rows, hidden) with stride(1) == 1; weight: (hidden,);
    rstd: (rows,) fp32 from `rms_norm_forward`.

    Returns grad_x (rows, hidden) in x2d's dtype and grad_weight (hidden,) in weight's dtype,
    each None when not asked for.
    """
    _validate_kernel_inputs("rms_norm_backward", x2d, weight)
    rows, hidden = x2d.shape
    if grad_y2d.shape != x2d.shape or grad_y2d.stride(1) != 1:
        raise ValueError(
            f"rms_norm_backward expects grad_y of shape {tuple(x2d.shape)} with contiguous "
            f"rows, got shape={tuple(grad_y2d.shape)} and stride={grad_y2d.stride()}"
        )
    if rstd.shape != (rows,) or rstd.dtype != torch.float32 or not rstd.is_contiguous():
        raise ValueError(
            f"rms_norm_backward expects a contiguous fp32 rstd of shape ({rows},), got "
            f"shape={tuple(rstd.shape)} and dtype={rstd.dtype}"
        )
    weight = weight.contiguous()
    block_rows, block_hidden, num_warps = _tile(rows, hidden)
    row_blocks = triton.cdiv(rows, block_rows)
    num_programs = min(row_blocks, _backward_programs(x2d.device, num_warps))

    grad_x = partials = None
    if compute_grad_x:
        grad_x = torch.empty((rows, hidden), dtype=x2d.dtype, device=x2d.device)
    if compute_grad_weight:
        partials = torch.empty((num_programs, hidden), dtype=torch.float32, device=x2d.device)
    launch(
        _rms_norm_backward_kernel,
        (num_programs,),
        x2d.device,
        grad_y2d,
        x2d,
        weight,
        rstd,
        grad_x if compute_grad_x else x2d,  # never written when not asked for
        partials if compute_grad_weight else rstd,  # never written when not asked for
        rows,
        hidden,
        grad_y2d.stride(0),
        x2d.stride(0),
        grad_x.stride(0) if compute_grad_x else 0,
        row_blocks,
        num_programs,
        BLOCK_ROWS=block_rows,
        BLOCK_HIDDEN=block_hidden,
        COMPUTE_GRAD_X=compute_grad_x,
        COMPUTE_GRAD_WEIGHT=compute_grad_weight,
        num_warps=num_warps,
    )
    grad_weight = partials.sum(dim=0).to(weight.dtype) if compute_grad_weight else None
    return grad_x, grad_weight


# ---------------------------------------------------------------------------------------------
# Autograd Function: dispatch between the Triton kernels and the plain-PyTorch path.
# ---------------------------------------------------------------------------------------------


def _use_triton(x: Tensor, weight: Tensor) -> bool:
    """The Triton kernels where `memfit.ops._triton.use_triton` says so and the dtype and size suit
    them; else the PyTorch path."""
    if x.dtype not in _KERNEL_DTYPES or weight.dtype not in _KERNEL_DTYPES:
        return False  # fp64 (gradcheck) stays on the PyTorch path
    if x.numel() == 0 or x.shape[-1] > MAX_FUSED_HIDDEN:
        return False
    return use_triton(x)


class RMSNormFunction(torch.autograd.Function):
    """y = x * rsqrt(mean(x**2) + eps) * weight, saving x, rstd and the weight reference."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        ctx.used_triton = _use_triton(x, weight)
        if ctx.used_triton:
            y2d, rstd = rms_norm_forward(rows_view(x), weight, eps)  # (rows, hidden), (rows,)
            # x itself is saved, not its 2-D copy (if reshape had to copy): no new memory.
            ctx.save_for_backward(x, weight, rstd)
            return y2d.view(x.shape)

        compute_dtype = promoted_dtype(x.dtype)
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
        if ctx.used_triton:
            grad_x2d, grad_weight = rms_norm_backward(
                rows_view(grad_y),
                rows_view(x),
                weight,
                rstd,
                compute_grad_x=ctx.needs_input_grad[0],
                compute_grad_weight=ctx.needs_input_grad[1],
            )
            grad_x = grad_x2d.view(x.shape) if grad_x2d is not None else None
            return grad_x, grad_weight, None

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

    Runs the Triton kernels on CUDA (and on CPU inside `triton_on_cpu()`), plain PyTorch
    otherwise and while torch.compile traces; see the module docstring.

    Args:
        x: (..., hidden) activations, fp32, bf16 or fp16 (fp64 is accepted, for testing).
            May be non-contiguous.
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
    if not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        if _use_triton(x, weight):  # inference: the kernel without autograd's bookkeeping
            return rms_norm_forward(rows_view(x), weight, float(eps))[0].view(x.shape)
    return RMSNormFunction.apply(x, weight, float(eps))
