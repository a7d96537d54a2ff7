"""Fused linear + cross-entropy loss that never materializes the (N, vocab) logits.

Algorithm: the fused linear cross-entropy of Liger-Kernel (Hsu et al. 2024, "Liger Kernel:
Efficient Triton Kernels for LLM Training", arXiv:2410.10989; `LigerFusedLinearCrossEntropy`).
The loss of a language model head is

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

Two paths share the chunking and the matmuls (cuBLAS through torch.mm / addmm) and differ in
the per-chunk elementwise work:
- Triton (CUDA tensors; CPU tensors inside `memfit.ops._triton.triton_on_cpu()`, for tests; never while
  torch.compile traces; fp16/bf16/fp32 compute): one kernel launch per chunk,
  `_cross_entropy_rows_kernel`, one program per row, two passes over the row's logits: an
  online max and sum of exponentials over blocks of the vocabulary, giving the row's
  logsumexp and loss; then grad_logits, written over the fp32 logits in place (fp16/fp32
  compute) or into one bf16 buffer reused by every chunk (bf16 compute). The logits buffer is
  also allocated once. Row losses go to an (N,) buffer summed once at the end.
- plain PyTorch (CPU, fp64 compute, torch.compile): max, exp, sum, log, gather, divide, mask,
  scatter and cast, each a pass over the (C, vocab) logits; the reference for the kernel.

Memory: at any time one chunk's logits (C x vocab fp32, about 512 MiB by default) plus, for a
bf16 matmul, one bf16 copy of its gradient, and the weight cast to compute_dtype (as
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
  logsumexp, softmax and the loss sum are fp32 (fp64 when compute_dtype is fp64). On the GPU
  the kernel's exp is the hardware exp2 approximation (relative error about 1e-6 for the
  arguments that matter), far below bf16's resolution; the loss sum's order differs from the
  plain path's (per row, then one sum), within fp32 rounding.
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
128k x 4096 head), so small chunks make the gradient matmul memory-bound; the default chunk
(see `_default_chunk_size`) trades that against the chunk's memory. Measured on an H100
(h=2048, V=32000, bf16 autocast, forward + backward, N=8192 / 16384): the Triton path takes
6.0 / 11.6 ms at a peak of 1.1 / 1.2 GiB, an unfused head with fp32-upcast logits 8.7 / 17.1
ms at 3.1 / 6.0 GiB, the plain path (256 MiB chunks) 10.4 / 20.5 ms: its elementwise passes
cost more than the unfused head's, so on CUDA it only serves torch.compile, which fuses them.
"""

import contextlib
import functools

import torch
from torch import Tensor

from memfit.ops._triton import HAS_TRITON, launch, round_to_bf16, tl, triton, use_triton_on

__all__ = ["LinearCrossEntropyFunction", "linear_cross_entropy"]

# Default chunk: as many rows as make one chunk's fp32 logits about this many bytes. Measured
# on an H100 (bf16 autocast, h=2048, forward + backward, Triton path), 512 MiB is the knee.
# Budgets of 256 / 512 / 1024 MiB: N=8192, V=32000: 6.3 / 6.0 / 5.9 ms at peaks of 0.8 / 1.1 /
# 1.9 GiB; N=8192, V=128256: 34.6 / 27.0 / 24.0 ms at 1.9 / 2.2 / 3.0 GiB (128 MiB: 7.4 and
# 53.7 ms). An unfused head: 8.7 ms at 3.1 GiB and 34.9 ms at 12.2 GiB.
_CHUNK_LOGITS_BYTES = 512 * 2**20
_COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Vocabulary columns per step of the kernel's loops (32 KiB of fp32 logits, 16 warps): the
# fastest of 1024-8192 columns on an H100 (3.5 TB/s effective at (4096, 32000): pass 2 reads
# partly from L2).
_BLOCK_VOCAB = 8192


@triton.jit
def _cross_entropy_rows_kernel(
    logits_ptr,
    stride_logits_row,
    grad_ptr,
    stride_grad_row,
    targets_ptr,
    losses_ptr,
    ignore_index,
    VOCAB_SIZE: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    BLOCK_VOCAB: tl.constexpr,
    ROUND_BF16_BY_HAND: tl.constexpr,
):
    """Loss and grad_logits = softmax - onehot(target) of one row of fp32 logits.

    Program n: row n of logits (C, vocab) (unit column stride), targets (C,) int64, losses (C,)
    fp32; with WRITE_GRAD, row n of grad (C, vocab) in grad's dtype, which may be the logits
    buffer itself (each element is read before it is overwritten, by the same thread).
    VOCAB_SIZE is a compile-time constant (one compile per vocabulary): the loops have a known
    trip count, and Triton 3.6's interpreter cannot loop to a bound passed at run time.
    """
    row = tl.program_id(0).to(tl.int64)
    logits_ptr += row * stride_logits_row
    grad_ptr += row * stride_grad_row
    target = tl.load(targets_ptr + row)
    if target == ignore_index:  # no loss, zero gradient; the logits are not even read
        tl.store(losses_ptr + row, 0.0)
        if WRITE_GRAD:
            for start in range(0, VOCAB_SIZE, BLOCK_VOCAB):
                columns = start + tl.arange(0, BLOCK_VOCAB)
                zeros = tl.zeros([BLOCK_VOCAB], dtype=grad_ptr.dtype.element_ty)
                tl.store(grad_ptr + columns, zeros, mask=columns < VOCAB_SIZE)
        return

    # Pass 1: running max m and sum of exp(logit - m) over blocks of the vocabulary (Milakov &
    # Gimelshein 2018, "Online normalizer calculation for softmax"). The first block holds at
    # least one real logit, so m is finite after it and exp(-inf - m) = 0 for the padding.
    row_max = float("-inf")
    sum_exp = 0.0
    for start in range(0, VOCAB_SIZE, BLOCK_VOCAB):
        columns = start + tl.arange(0, BLOCK_VOCAB)
        logits = tl.load(
            logits_ptr + columns,
            mask=columns < VOCAB_SIZE,
            other=float("-inf"),
            eviction_policy="evict_last",  # read again by pass 2: keep it in L2
        )
        new_max = tl.maximum(row_max, tl.max(logits, 0))
        sum_exp = sum_exp * tl.exp(row_max - new_max) + tl.sum(tl.exp(logits - new_max), 0)
        row_max = new_max
    target_logit = tl.load(logits_ptr + target)
    tl.store(losses_ptr + row, row_max + tl.log(sum_exp) - target_logit)

    # Pass 2: d loss / d logits = exp(logit - m) / sum - [column == target].
    if WRITE_GRAD:
        for start in range(0, VOCAB_SIZE, BLOCK_VOCAB):
            columns = start + tl.arange(0, BLOCK_VOCAB)
            mask = columns < VOCAB_SIZE
            logits = tl.load(
                logits_ptr + columns, mask=mask, other=float("-inf"), eviction_policy="evict_first"
            )
            grad = tl.exp(logits - row_max) / sum_exp
            grad = tl.where(columns == target, grad - 1.0, grad)
            if ROUND_BF16_BY_HAND:
                grad = round_to_bf16(grad)
            tl.store(grad_ptr + columns, grad.to(grad_ptr.dtype.element_ty), mask=mask)


def _use_triton(device: torch.device) -> bool:
    """Whether a call on `device` runs the Triton kernels (see `memfit.ops._triton`)."""
    return HAS_TRITON and use_triton_on(device)


def _launch_cross_entropy_rows(
    logits: Tensor,
    targets: Tensor,
    ignore_index: int,
    row_losses: Tensor,
    grad_logits: Tensor | None,
) -> None:
    """Per-row losses and, if grad_logits is given, the gradient of the chunk's logits.

    logits: (C, vocab) fp32 with unit column stride; targets: (C,) int64 in [0, vocab) or
    ignore_index (validated by the caller); row_losses: (C,) fp32, written; grad_logits: None,
    or (C, vocab) fp32 or bf16 with unit column stride, written (it may be logits itself).
    """
    rows, vocab_size = logits.shape
    assert logits.dtype == row_losses.dtype == torch.float32 and logits.stride(1) == 1
    assert grad_logits is None or (grad_logits.shape == logits.shape and grad_logits.stride(1) == 1)
    if rows == 0:
        return
    block_vocab = min(_BLOCK_VOCAB, triton.next_power_of_2(max(vocab_size, 16)))
    grad = logits if grad_logits is None else grad_logits  # any pointer when not written
    launch(
        _cross_entropy_rows_kernel,
        (rows,),
        logits.device,
        logits,
        logits.stride(0),
        grad,
        grad.stride(0),
        targets,
        row_losses,
        ignore_index,
        VOCAB_SIZE=vocab_size,
        WRITE_GRAD=grad_logits is not None,
        BLOCK_VOCAB=block_vocab,
        ROUND_BF16_BY_HAND=logits.device.type == "cpu" and grad.dtype == torch.bfloat16,
        num_warps=min(16, max(4, block_vocab // 512)),
    )


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


@functools.cache
def _mm_into_has_out_dtype(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch.mm(..., out_dtype=float32, out=...) works for `dtype` inputs here."""
    try:
        a = torch.zeros(16, 16, dtype=dtype, device=device_type)
        torch.mm(a, a, out_dtype=torch.float32, out=torch.empty(16, 16, device=device_type))
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


def _matmul_into(out: Tensor, a: Tensor, b: Tensor) -> None:
    """out = a @ b, out fp32 (a preallocated buffer), a and b possibly of a lower precision.

    Same numerics as `_matmul_wide`; without a temporary where PyTorch allows.
    """
    if a.dtype == out.dtype:
        torch.mm(a, b, out=out)
    elif _mm_into_has_out_dtype(a.device.type, a.dtype):
        torch.mm(a, b, out_dtype=out.dtype, out=out)
    else:
        out.copy_(_matmul_wide(a, b, out.dtype))


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


def row_targets(targets: Tensor, vocab_size: int, ignore_index: int, who: str) -> Tensor:
    """`targets` as the row kernels read them: int64 with unit stride, each in [0, vocab_size)
    or ignore_index (else ValueError, whose message starts with `who`; one host-device sync).
    While a CUDA graph is captured the check cannot read the device, and is the capturer's:
    memfit.train.graphs checks each step's targets on the host before it replays."""
    targets = targets.long().contiguous()
    if targets.is_cuda and torch.cuda.is_current_stream_capturing():
        return targets
    bad = out_of_range_target(targets, vocab_size, ignore_index)
    if bad is not None:
        raise ValueError(
            f"{who} in [0, {vocab_size}) or ignore_index={ignore_index}, got target {bad}"
        )
    return targets


def out_of_range_target(targets: Tensor, vocab_size: int, ignore_index: int) -> int | None:
    """The first target outside [0, vocab_size) that is not ignore_index, or None."""
    out_of_range = (targets != ignore_index) & ((targets < 0) | (targets >= vocab_size))
    if out_of_range.any():
        return int(targets[out_of_range][0].item())
    return None


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


def _chunked_loss_and_grads_triton(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    ignore_index: int,
    chunk_size: int,
    compute_dtype: torch.dtype,
    need_grad_hidden: bool,
    need_grad_weight: bool,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """`_chunked_loss_and_grads` with the per-chunk elementwise work in one Triton kernel.

    Same arguments and results; compute_dtype fp16, bf16 or fp32 (the kernel works in fp32).
    """
    num_rows, hidden_size = hidden.shape
    vocab_size = weight.shape[0]
    device = hidden.device
    # fp16 cannot represent small softmax values: its gradient matmuls run in fp32.
    grad_dtype = torch.float32 if compute_dtype == torch.float16 else compute_dtype
    need_grad_logits = need_grad_hidden or need_grad_weight

    weight_compute = weight.to(compute_dtype)  # (V, h); no copy when dtypes agree
    # (V, h); one cast of an fp32 master weight serves both bf16 matmuls
    weight_grad = weight_compute if grad_dtype == compute_dtype else weight.to(grad_dtype)
    row_losses = torch.empty(num_rows, dtype=torch.float32, device=device)
    grad_hidden = grad_weight = None
    if need_grad_hidden:
        grad_hidden = torch.empty((num_rows, hidden_size), dtype=grad_dtype, device=device)
    if need_grad_weight:
        grad_weight = torch.zeros((vocab_size, hidden_size), dtype=torch.float32, device=device)

    # One buffer for every chunk's logits; fp32 gradients overwrite the logits in place,
    # bf16 ones go to a second buffer, also reused by every chunk.
    chunk_rows = min(chunk_size, num_rows)
    logits_buffer = torch.empty((chunk_rows, vocab_size), dtype=torch.float32, device=device)
    grad_buffer = None
    if need_grad_logits:
        grad_buffer = logits_buffer
        if grad_dtype != torch.float32:
            grad_buffer = torch.empty((chunk_rows, vocab_size), dtype=grad_dtype, device=device)

    for start in range(0, num_rows, chunk_size):
        end = min(start + chunk_size, num_rows)
        hidden_chunk = hidden[start:end]  # (C, h)
        logits = logits_buffer[: end - start]  # (C, V)
        _matmul_into(logits, hidden_chunk.to(compute_dtype), weight_compute.T)
        grad_logits = grad_buffer[: end - start] if need_grad_logits else None  # (C, V)
        _launch_cross_entropy_rows(
            logits, targets[start:end], ignore_index, row_losses[start:end], grad_logits
        )
        if grad_hidden is not None:
            torch.mm(grad_logits, weight_grad, out=grad_hidden[start:end])  # (C, h)
        if grad_weight is not None:
            # (V, C) @ (C, h) -> (V, h)
            _accumulate_matmul(grad_weight, grad_logits.T, hidden_chunk.to(grad_dtype))
    return row_losses.sum(), grad_hidden, grad_weight


def _loss_and_grads(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    ignore_index: int,
    chunk_size: int,
    compute_dtype: torch.dtype,
    need_grad_hidden: bool,
    need_grad_weight: bool,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The Triton chunk loop where it applies (see the module docstring), else the plain one."""
    use_triton = compute_dtype != torch.float64 and _use_triton(hidden.device)
    chunk_loop = _chunked_loss_and_grads_triton if use_triton else _chunked_loss_and_grads
    return chunk_loop(
        hidden,
        weight,
        targets,
        ignore_index,
        chunk_size,
        compute_dtype,
        need_grad_hidden,
        need_grad_weight,
    )


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
            loss, grad_hidden, grad_weight = _loss_and_grads(
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


def _default_chunk_size(num_rows: int, vocab_size: int) -> int:
    """Rows per chunk: as many as fit one chunk's fp32 logits in _CHUNK_LOGITS_BYTES, rounded
    down to a multiple of 256 (whole matmul tiles) when that many fit; at least 1, at most N.

    Larger chunks mean fewer read-modify-writes of the fp32 grad_weight accumulator (vocab x h
    x 8 bytes per chunk) and fuller matmuls; smaller ones less memory.
    """
    rows = _CHUNK_LOGITS_BYTES // (4 * max(vocab_size, 1))
    if rows >= 256:
        rows -= rows % 256
    return max(1, min(num_rows, rows))


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
            512 MiB, rounded down to a multiple of 256 rows (at least 1, at most N). Any
            value gives the same result up to rounding.
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
        chunk_size = _default_chunk_size(num_rows, vocab_size)
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
    targets = row_targets(targets, vocab_size, ignore_index, "linear_cross_entropy expects targets")

    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    if not needs_grad:
        with _autocast_disabled(device_type):
            loss, _, _ = _loss_and_grads(
                hidden,
                weight,
                targets,
                ignore_index,
                chunk_size,
                compute_dtype,
                need_grad_hidden=False,
                need_grad_weight=False,
            )
        return loss
    return LinearCrossEntropyFunction.apply(
        hidden, weight, targets, ignore_index, chunk_size, compute_dtype
    )
