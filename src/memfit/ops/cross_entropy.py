"""Fused linear + cross-entropy loss that never materializes the (N, vocab) logits.

Algorithm: the fused linear cross-entropy of Liger-Kernel (Hsu et al. 2024, "Liger Kernel:
Efficient Triton Kernels for LLM Training", arXiv:2410.10989; `LigerFusedLinearCrossEntropy`),
here in plain PyTorch (a Triton kernel comes later). The loss of a language model head is

    loss = sum over rows n with targets[n] != ignore_index of
           logsumexp(logits[n]) - logits[n, targets[n]],     logits = hidden @ weight.T

The N rows are processed in chunks of C rows. For each chunk, the (C, vocab) fp32 logits are
computed, reduced to the chunk's loss and, when gradients are needed, turned at once into
their gradient grad_logits = softmax(logits) - onehot(targets) (zero rows where ignored), from
which

    grad_hidden[chunk] = grad_logits @ weight        # (C, h)
    grad_weight       += grad_logits.T @ hidden[chunk]  # (vocab, h), fp32 accumulator

So the gradients are computed in the forward and saved; backward only scales them by the
incoming scalar gradient. Nothing is recomputed: the FLOPs are those of an unfused lm_head
plus loss (2 N h V forward, 4 N h V for the two gradient matmuls).

Memory: at any time one chunk's logits (C x vocab fp32, about 256 MiB by default) plus, for a
bf16 or fp16 matmul, one low-precision copy of them, and the weight cast to compute_dtype (as
autocast would cast it); instead of the saved (N, vocab) logits of an unfused head, it keeps
grad_hidden (N, h) and an fp32 grad_weight (vocab, h) until backward.
Backward scales those two buffers in place and hands them to autograd instead of allocating
another (vocab, h) fp32 tensor, so a second backward through the same graph (retain_graph=True,
torch.autograd.gradcheck) raises a RuntimeError saying so.

Numerics:
- The matmuls run in compute_dtype: by default the autocast dtype when autocast is enabled
  for hidden's device type, else hidden's dtype. hidden chunks and weight are cast to it
  explicitly, with autocast disabled inside.
- Logits come out of the matmul with fp32 accumulation; on CUDA they are written in fp32
  directly (torch.mm(..., out_dtype=torch.float32)) where PyTorch supports it, elsewhere the
  matmul rounds them to compute_dtype first, exactly as an unfused autocast lm_head does.
  logsumexp, softmax and the loss sum are fp32 (fp64 when compute_dtype is fp64).
- bf16: grad_logits is rounded to bf16 for the two gradient matmuls (as in an unfused autocast
  backward); grad_hidden is stored in bf16 and grad_weight accumulated in fp32 (on CUDA by
  torch.addmm(..., out_dtype=torch.float32); elsewhere each chunk's bf16 product is added).
- fp16: the gradient matmuls run in fp32 (at fp32 matmul speed) and grad_hidden is stored in
  fp32. fp16's range cannot hold the small softmax values (anything below 6e-8 flushes to
  zero, below 6e-5 loses precision) and the dynamic loss scale is only applied in backward,
  after they are computed.
- The loss is returned as a SUM over non-ignored rows (fp32 scalar); the caller divides by its
  token count, which may span several micro-batches.

Cautions: no label smoothing, no z-loss, no soft targets. Targets out of [0, vocab) that are
not ignore_index raise a ValueError; checking it costs one host-device synchronization. Speed:
each chunk reads and writes the whole fp32 grad_weight (vocab x h x 4 bytes, 2 GiB for a
128k x 4096 head) and makes several elementwise passes over its logits, so small chunks are
memory-bound and this plain-PyTorch version is slower than an unfused head; it buys memory.
"""

import contextlib
import functools

import torch
from torch import Tensor

__all__ = ["LinearCrossEntropyFunction", "linear_cross_entropy"]

# Default chunk: as many rows as make one chunk's fp32 logits about this many bytes.
_CHUNK_LOGITS_BYTES = 256 * 2**20
_COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@functools.cache
def _matmul_has_out_dtype(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch.mm/addmm take out_dtype=float32 for `dtype` inputs on this device type.

    PyTorch implements aten::mm.dtype and aten::addmm.dtype (low-precision inputs, fp32
    output, fp32 accumulation) only for some backends; probe once per (device, dtype).
    """
    try:
        a = torch.zeros(16, 16, dtype=dtype, device=device_type)
        accumulator = torch.zeros(16, 16, dtype=torch.float32, device=device_type)
        torch.mm(a, a, out_dtype=torch.float32)
        torch.addmm(accumulator, a, a, out_dtype=torch.float32, out=accumulator)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


def _matmul_wide(a: Tensor, b: Tensor, out_dtype: torch.dtype) -> Tensor:
    """a @ b returned in out_dtype (fp32/fp64); without rounding to a's dtype where possible."""
    if a.dtype == out_dtype:
        return a @ b
    if _matmul_has_out_dtype(a.device.type, a.dtype):
        return torch.mm(a, b, out_dtype=out_dtype)
    return (a @ b).to(out_dtype)


def _accumulate_matmul(accumulator: Tensor, a: Tensor, b: Tensor) -> None:
    """accumulator += a @ b, accumulator fp32/fp64, a and b possibly of a lower precision."""
    if a.dtype == accumulator.dtype:
        accumulator.addmm_(a, b)
    elif _matmul_has_out_dtype(a.device.type, a.dtype):
        torch.addmm(accumulator, a, b, out_dtype=accumulator.dtype, out=accumulator)
    else:
        # The product is rounded to a's dtype once per chunk before the fp32 sum, as an
        # unfused backward rounds the whole grad_weight once.
        accumulator.add_(a @ b)


def _autocast_disabled(device_type: str) -> contextlib.AbstractContextManager:
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type=device_type, enabled=False)
    return contextlib.nullcontext()


def _chunked_loss_and_grads(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    ignore_index: int,
    chunk_size: int,
    compute_dtype: torch.dtype,
    need_grad_hidden: bool,
    need_grad_weight: bool,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The loss sum and, if asked, its gradients; see the module docstring.

    hidden (N, h), weight (V, h), targets (N,) int64. Returns (loss: 0-dim fp32 or fp64,
    grad_hidden: (N, h) or None, grad_weight: (V, h) fp32/fp64 or None).
    """
    num_rows, hidden_size = hidden.shape
    vocab_size = weight.shape[0]
    device = hidden.device
    accumulate_dtype = torch.float64 if compute_dtype == torch.float64 else torch.float32
    # fp16 cannot represent small softmax values: its gradient matmuls run in fp32.
    grad_dtype = accumulate_dtype if compute_dtype == torch.float16 else compute_dtype

    weight_compute = weight.to(compute_dtype)  # (V, h); no copy when dtypes agree
    weight_grad = weight.to(grad_dtype)  # (V, h)
    loss = torch.zeros((), dtype=accumulate_dtype, device=device)
    grad_hidden = grad_weight = None
    if need_grad_hidden:
        grad_hidden = torch.empty((num_rows, hidden_size), dtype=grad_dtype, device=device)
    if need_grad_weight:
        grad_weight = torch.zeros((vocab_size, hidden_size), dtype=accumulate_dtype, device=device)

    for start in range(0, num_rows, chunk_size):
        end = min(start + chunk_size, num_rows)
        hidden_chunk = hidden[start:end]  # (C, h)
        target_chunk = targets[start:end]  # (C,)
        valid = target_chunk != ignore_index  # (C,)
        safe_targets = torch.where(valid, target_chunk, 0)[:, None]  # (C, 1)

        logits = _matmul_wide(hidden_chunk.to(compute_dtype), weight_compute.T, accumulate_dtype)
        target_logits = logits.gather(1, safe_targets).squeeze(1)  # (C,)
        # logsumexp by hand, reusing the logits buffer for exp(logits - max): no second
        # (C, V) temporary, and the buffer becomes the softmax below.
        row_max = logits.amax(dim=1, keepdim=True)  # (C, 1)
        exp_shifted = logits.sub_(row_max).exp_()  # (C, V)
        sum_exp = exp_shifted.sum(dim=1, keepdim=True)  # (C, 1)
        logsumexp = (row_max + sum_exp.log()).squeeze(1)  # (C,)
        loss += torch.where(valid, logsumexp - target_logits, 0.0).sum()
        if not (need_grad_hidden or need_grad_weight):
            continue

        # d loss / d logits = softmax - onehot(target); zero for ignored rows.
        grad_logits = exp_shifted.div_(sum_exp).mul_(valid[:, None])  # (C, V)
        grad_logits.scatter_add_(1, safe_targets, -valid[:, None].to(accumulate_dtype))
        grad_logits = grad_logits.to(grad_dtype)
        if grad_hidden is not None:
            torch.mm(grad_logits, weight_grad, out=grad_hidden[start:end])  # (C, h)
        if grad_weight is not None:
            # (V, C) @ (C, h) -> (V, h)
            _accumulate_matmul(grad_weight, grad_logits.T, hidden_chunk.to(grad_dtype))
    return loss, grad_hidden, grad_weight


def _scale_saved_grad(grad: Tensor | None, grad_loss: Tensor, dtype: torch.dtype) -> Tensor | None:
    """grad * grad_loss in the wider of grad's and dtype's precisions, returned in dtype."""
    if grad is None:
        return None
    if torch.promote_types(grad.dtype, dtype) == grad.dtype:
        # In place: the buffer is ours and not needed after this backward.
        return grad.mul_(grad_loss).to(dtype)
    return grad.to(dtype).mul_(grad_loss)


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Sum of cross-entropy of hidden @ weight.T; gradients computed chunkwise in forward."""

    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        ignore_index: int,
        chunk_size: int,
        compute_dtype: torch.dtype,
    ) -> Tensor:
        with _autocast_disabled(hidden.device.type):
            loss, grad_hidden, grad_weight = _chunked_loss_and_grads(
                hidden,
                weight,
                targets,
                ignore_index,
                chunk_size,
                compute_dtype,
                need_grad_hidden=ctx.needs_input_grad[0],
                need_grad_weight=ctx.needs_input_grad[1],
            )
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.hidden_dtype, ctx.weight_dtype = hidden.dtype, weight.dtype
        ctx.backward_done = False
        return loss

    @staticmethod
    def backward(
        ctx, grad_loss: Tensor
    ) -> tuple[Tensor | None, Tensor | None, None, None, None, None]:
        if ctx.backward_done:
            raise RuntimeError(
                "linear_cross_entropy supports one backward per forward: its backward scales "
                "the gradients saved by the forward in place (retain_graph=True cannot reuse "
                "them); call linear_cross_entropy again for a second backward"
            )
        ctx.backward_done = True
        grad_hidden, grad_weight = ctx.saved_tensors
        grad_hidden = _scale_saved_grad(grad_hidden, grad_loss, ctx.hidden_dtype)
        grad_weight = _scale_saved_grad(grad_weight, grad_loss, ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    compute_dtype: torch.dtype | None = None,
) -> Tensor:
    """Summed cross-entropy of logits = hidden @ weight.T against targets, without the logits.

    Args:
        hidden: (N, h) final hidden states (flatten batch and sequence first).
        weight: (V, h) the lm_head (or tied embedding) weight, typically an fp32 master.
        targets: (N,) integer class ids in [0, V), or ignore_index for rows to skip.
        ignore_index: target value whose rows contribute no loss and no gradient.
        chunk_size: rows per chunk; default: as many as make one chunk's fp32 logits about
            256 MiB (at least 1, at most N). Any value gives the same result up to rounding.
        compute_dtype: dtype of the matmuls; default: the autocast dtype if autocast is
            enabled for hidden's device type, else hidden's dtype. One of fp16, bf16, fp32
            (fp64 is accepted, for testing).

    Returns:
        0-dim fp32 tensor (fp64 when compute_dtype is fp64): the loss summed over the
        non-ignored rows (0 if all are ignored). Differentiable in hidden and weight; when
        gradients are needed they are computed during this call (see the module docstring).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"linear_cross_entropy expects hidden (N, h) and weight (V, h) with the same h, got "
            f"hidden.shape={tuple(hidden.shape)} and weight.shape={tuple(weight.shape)}"
        )
    if not hidden.is_floating_point() or not weight.is_floating_point():
        raise ValueError(
            f"linear_cross_entropy expects floating-point hidden and weight, got "
            f"hidden.dtype={hidden.dtype} and weight.dtype={weight.dtype}"
        )
    num_rows, vocab_size = hidden.shape[0], weight.shape[0]
    if (
        targets.dim() != 1
        or targets.shape[0] != num_rows
        or targets.is_floating_point()
        or targets.is_complex()
        or targets.dtype == torch.bool
    ):
        raise ValueError(
            f"linear_cross_entropy expects integer targets of shape (N,)=({num_rows},) for "
            f"hidden.shape={tuple(hidden.shape)}, got targets.shape={tuple(targets.shape)} "
            f"and targets.dtype={targets.dtype}"
        )
    if not (hidden.device == weight.device == targets.device):
        raise ValueError(
            f"linear_cross_entropy expects hidden, weight and targets on one device, got "
            f"{hidden.device}, {weight.device} and {targets.device}"
        )
    if chunk_size is None:
        chunk_size = max(1, min(num_rows, _CHUNK_LOGITS_BYTES // (4 * max(vocab_size, 1))))
    elif isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"linear_cross_entropy expects chunk_size >= 1, got {chunk_size!r}")
    device_type = hidden.device.type
    if compute_dtype is None:
        autocast_on = torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(
            device_type
        )
        compute_dtype = torch.get_autocast_dtype(device_type) if autocast_on else hidden.dtype
    if compute_dtype not in _COMPUTE_DTYPES:
        raise ValueError(
            f"linear_cross_entropy expects compute_dtype in {list(_COMPUTE_DTYPES)}, got "
            f"{compute_dtype}"
        )
    targets = targets.long()
    out_of_range = (targets != ignore_index) & ((targets < 0) | (targets >= vocab_size))
    if out_of_range.any():  # one host-device sync
        raise ValueError(
            f"linear_cross_entropy expects targets in [0, {vocab_size}) or "
            f"ignore_index={ignore_index}, got target {targets[out_of_range][0].item()}"
        )

    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    if not needs_grad:
        with _autocast_disabled(device_type):
            loss, _, _ = _chunked_loss_and_grads(
                hidden, weight, targets, ignore_index, chunk_size, compute_dtype, False, False
            )
        return loss
    return LinearCrossEntropyFunction.apply(
        hidden, weight, targets, ignore_index, chunk_size, compute_dtype
    )
