"""Rotary position embedding (RoPE) as a memory-lean autograd Function, plus its cos/sin tables.

Algorithm (Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary Position Embedding",
section 3.4.2), in Hugging Face Llama's non-interleaved "rotate_half" layout: head_dim is split
into halves x1 = x[..., :d/2] and x2 = x[..., d/2:], and pair i is (x1[i], x2[i]) rotated by
the angle position * inv_freq[i]:

    out = x * cos + rotate_half(x) * sin,       rotate_half(x) = cat(-x2, x1)
    inv_freq[i] = 1 / theta ** (2i / d),        cos = cos(cat(freqs, freqs)), same for sin

Backward: the map is a rotation (orthogonal), so the gradient is the rotation by the negative
angle, i.e. the transpose: dx = dy * cos + rotate_half^T(dy * sin) with
rotate_half^T(v) = cat(v2, -v1). The code writes out the transpose for arbitrary cos and sin
tables, so it is exact even for tables whose two halves differ.

Two paths compute the same thing:
- Triton (CUDA tensors; CPU tensors inside `memfit.ops._triton.triton_on_cpu()`, for tests; never while
  torch.compile traces, so that Inductor fuses the plain path into its neighbours): one kernel,
  `_rotary_kernel`, does forward (TRANSPOSE=False) and backward (TRANSPOSE=True) in one pass.
  A program rotates a block of (token, head) rows: it reads x with its real strides (a view
  into a fused qkv projection is read in place, not copied), reads its tokens' cos/sin rows
  (from HBM once; its other heads' reads of them hit L1), and writes a contiguous output. `apply_rotary_qk` rotates
  queries and keys in one launch (the grid's second axis covers q's head blocks, then k's).
- plain PyTorch (everything else): a few elementwise passes; the reference for the kernel.
The two agree bit for bit: both compute x1 * c1 - x2 * s1 as two fp32 products and one fp32
difference (the kernel is compiled without FMA contraction) and round once to x's dtype.
Measured on an H100, x (4, 2048, 16, 128) bf16 a view of a fused qkv: forward 31 us and
backward 30 us (2.2 TB/s of reads and writes), q and k in one launch 54 us (2.5 TB/s; a clone
moves 2.4 TB/s), the plain path 336 us (0.2 TB/s).

Memory: only cos and sin are saved (tables of (seq, head_dim), shared by every layer), never a
tensor of x's size. Eager autograd saves x-sized products.

Numerics: computed in fp32 (fp64 for fp64 inputs) and rounded once to x's dtype. Hugging Face
casts cos and sin to x's dtype and computes in bf16 under autocast; in fp32 the two agree
bit for bit, in bf16 memfit's result is the more accurate one.

`rotary_cos_sin` builds the tables exactly as Hugging Face's LlamaRotaryEmbedding does
(inv_freq in fp32 on the CPU, then positions.float() * inv_freq on the target device), so a
model using them reproduces LlamaForCausalLM's logits. Supported rope_scaling types: None /
"default", and "llama3" (Llama 3.1's frequency-dependent interpolation, HF
`_compute_llama3_parameters`).

Cautions: apply_rotary is not differentiable in cos and sin (they are constants of the model);
passing tables that require grad raises. Autocast does not change any op used here. The kernel
reads head_dim with unit stride: an x whose last dimension is strided (rare; not a qkv view)
is copied first. Outputs and input gradients are contiguous (batch, seq, heads, head_dim).
"""

import functools
import json
import math

import torch
from torch import Tensor

from memfit.ops._triton import (
    HAS_TRITON,
    launch,
    promoted_dtype,
    round_to_bf16,
    tl,
    triton,
    use_triton_on,
)

__all__ = [
    "RotaryFunction",
    "RotaryQKFunction",
    "apply_rotary",
    "apply_rotary_qk",
    "rotary_cos_sin",
]

_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# Elements of each half of head_dim that one program rotates (BLOCK_TOKENS * BLOCK_HEADS *
# BLOCK_HALF): 8 KiB of bf16 reads per program, the fastest of 1024-8192 on an H100.
_ROTARY_BLOCK_ELEMENTS = 2048


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    cos_ptr,
    sin_ptr,
    num_tokens,
    seq_len,
    q_heads,
    k_heads,
    q_head_blocks,
    stride_q_batch,
    stride_q_seq,
    stride_q_head,
    stride_k_batch,
    stride_k_seq,
    stride_k_head,
    stride_table_batch,
    stride_table_seq,
    HALF: tl.constexpr,
    TRANSPOSE: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    ROUND_BF16_BY_HAND: tl.constexpr,
):
    """Rotate a (BLOCK_TOKENS, BLOCK_HEADS, head_dim) block of q or of k.

    Program (token block, head block); head blocks [0, q_head_blocks) are q's, the rest k's.
    Inputs: (batch, seq, heads, 2 * HALF) with unit stride along the last dim; tables:
    (batch or broadcast, seq, 2 * HALF) with unit stride along the last dim (stride_table_batch
    0 for a (seq, head_dim) table); outputs contiguous (batch * seq, heads, 2 * HALF).
    Computes in the tables' dtype; stores in the outputs' dtype.
    """
    token_block = tl.program_id(0)
    head_block = tl.program_id(1)
    # Pick the tensor of this program: scalar selects, so one compiled kernel serves both.
    is_q = head_block < q_head_blocks
    in_ptr = tl.where(is_q, q_ptr, k_ptr)
    out_ptr = tl.where(is_q, q_out_ptr, k_out_ptr)
    num_heads = tl.where(is_q, q_heads, k_heads)
    stride_batch = tl.where(is_q, stride_q_batch, stride_k_batch)
    stride_seq = tl.where(is_q, stride_q_seq, stride_k_seq)
    stride_head = tl.where(is_q, stride_q_head, stride_k_head)
    head_block = tl.where(is_q, head_block, head_block - q_head_blocks)

    # int64 offsets: a long sequence's qkv can exceed 2**31 elements.
    tokens = token_block.to(tl.int64) * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
    heads = head_block * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
    dims = tl.arange(0, BLOCK_HALF)
    batch_index = tokens // seq_len
    seq_index = tokens - batch_index * seq_len

    token_mask = (tokens < num_tokens)[:, None, None]
    dim_mask = (dims < HALF)[None, None, :]
    mask = token_mask & (heads < num_heads)[None, :, None] & dim_mask  # (T, H, D/2)

    in_offsets = (
        (batch_index * stride_batch + seq_index * stride_seq)[:, None, None]
        + (heads * stride_head)[None, :, None]
        + dims[None, None, :]
    )
    out_rows = (tokens * num_heads)[:, None, None] + heads[None, :, None]  # (T, H, 1)
    out_offsets = out_rows * (2 * HALF) + dims[None, None, :]
    # Each token's table row, loaded for every head of the block (repeats hit L1): loading it
    # once as (T, 1, D/2) would make the compiler broadcast it through shared memory instead.
    table_offsets = (
        (batch_index * stride_table_batch + seq_index * stride_table_seq)[:, None, None]
        + (heads * 0)[None, :, None]
        + dims[None, None, :]
    )

    cos1 = tl.load(cos_ptr + table_offsets, mask=mask, other=0.0)
    cos2 = tl.load(cos_ptr + table_offsets + HALF, mask=mask, other=0.0)
    sin1 = tl.load(sin_ptr + table_offsets, mask=mask, other=0.0)
    sin2 = tl.load(sin_ptr + table_offsets + HALF, mask=mask, other=0.0)
    x1 = tl.load(in_ptr + in_offsets, mask=mask, other=0.0).to(cos1.dtype)
    x2 = tl.load(in_ptr + in_offsets + HALF, mask=mask, other=0.0).to(cos1.dtype)
    if TRANSPOSE:  # dx = dy * cos + rotate_half^T(dy * sin), rotate_half^T(v) = cat(v2, -v1)
        out1 = x1 * cos1 + x2 * sin2
        out2 = x2 * cos2 - x1 * sin1
    else:  # out = x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1)
        out1 = x1 * cos1 - x2 * sin1
        out2 = x2 * cos2 + x1 * sin2
    if ROUND_BF16_BY_HAND:
        out1, out2 = round_to_bf16(out1), round_to_bf16(out2)
    out_dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + out_offsets, out1.to(out_dtype), mask=mask)
    tl.store(out_ptr + out_offsets + HALF, out2.to(out_dtype), mask=mask)


def _use_triton(device: torch.device) -> bool:
    """Whether a call on `device` runs the Triton kernels (see `memfit.ops._triton`)."""
    return HAS_TRITON and use_triton_on(device)


def _table_strides(table: Tensor) -> tuple[int, int]:
    """(batch, seq) strides of a (seq, head_dim) or (batch, seq, head_dim) table; batch 0 for 2-D."""
    if table.dim() == 2:
        return 0, table.stride(0)
    return table.stride(0), table.stride(1)


def _launch_rotary(
    inputs: tuple[Tensor, ...], cos: Tensor, sin: Tensor, *, transpose: bool, out_dtype: torch.dtype
) -> tuple[Tensor, ...]:
    """Rotate one or two tensors (q, or q and k) by the same tables in one kernel launch.

    inputs: 1 or 2 tensors (batch, seq, heads_i, head_dim) of one dtype, batch, seq and
    head_dim (validated by the entry points), any strides. cos, sin: (seq, head_dim) or
    (batch, seq, head_dim) in the compute dtype. transpose: False for the forward rotation,
    True for its transpose (the backward). Returns contiguous (batch, seq, heads_i, head_dim)
    tensors of out_dtype.
    """
    assert len(inputs) in (1, 2) and cos.shape == sin.shape and cos.dtype == sin.dtype
    # The kernel reads head_dim with unit stride; a view into qkv already has it.
    inputs = tuple(x if x.stride(-1) == 1 else x.contiguous() for x in inputs)
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    if len(inputs) == 2 and any(x.numel() == 0 for x in inputs):  # e.g. zero kv heads
        return tuple(
            _launch_rotary((x,), cos, sin, transpose=transpose, out_dtype=out_dtype)[0]
            for x in inputs
        )
    outputs = tuple(torch.empty(x.shape, dtype=out_dtype, device=x.device) for x in inputs)
    if inputs[0].numel() == 0:
        return outputs
    q, k = inputs[0], inputs[-1]
    q_out, k_out = outputs[0], outputs[-1]
    batch, seq, q_heads, head_dim = q.shape
    half = head_dim // 2
    num_tokens = batch * seq

    block_half = triton.next_power_of_2(half)
    block_heads = min(
        triton.next_power_of_2(min(x.shape[2] for x in inputs)),
        max(1, _ROTARY_BLOCK_ELEMENTS // block_half),
    )
    block_tokens = min(
        triton.next_power_of_2(num_tokens),
        max(1, _ROTARY_BLOCK_ELEMENTS // (block_heads * block_half)),
    )
    num_warps = min(4, max(1, block_tokens * block_heads * block_half // 512))
    q_head_blocks = triton.cdiv(q_heads, block_heads)
    k_head_blocks = triton.cdiv(k.shape[2], block_heads) if len(inputs) == 2 else 0
    grid = (triton.cdiv(num_tokens, block_tokens), q_head_blocks + k_head_blocks)
    launch(
        _rotary_kernel,
        grid,
        q.device,
        q,
        k,
        q_out,
        k_out,
        cos,
        sin,
        num_tokens,
        seq,
        q_heads,
        k.shape[2],
        q_head_blocks,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        *_table_strides(cos),
        HALF=half,
        TRANSPOSE=transpose,
        BLOCK_TOKENS=block_tokens,
        BLOCK_HEADS=block_heads,
        BLOCK_HALF=block_half,
        ROUND_BF16_BY_HAND=q.device.type == "cpu" and out_dtype == torch.bfloat16,
        num_warps=num_warps,
        # No FMA contraction: x1 * c1 - x2 * s1 rounds each product, as the plain path does,
        # so the two paths agree bit for bit (the kernel is memory-bound: FMAs would not help).
        enable_fp_fusion=False,
    )
    return outputs


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, out_dtype: torch.dtype) -> Tensor:
    """out = x * cos + rotate_half(x) * sin, computed in cos's dtype, returned in out_dtype.

    x: (batch, seq, heads, head_dim), any strides; cos, sin: (seq, head_dim) or
    (batch, seq, head_dim), wide dtype.
    """
    half = x.shape[-1] // 2
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # (..., seq, 1, head_dim): over heads
    x1 = x[..., :half].to(cos.dtype)  # (batch, seq, heads, half)
    x2 = x[..., half:].to(cos.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    # The writes into out's halves round to out_dtype once.
    out[..., :half] = x1 * cos[..., :half] - x2 * sin[..., :half]
    out[..., half:] = x2 * cos[..., half:] + x1 * sin[..., half:]
    return out


def _rotate_transposed(dy: Tensor, cos: Tensor, sin: Tensor, out_dtype: torch.dtype) -> Tensor:
    """dx = dy * cos + rotate_half^T(dy * sin), rotate_half^T(v) = cat(v2, -v1).

    The exact transpose of `_rotate` for any cos and sin (rotation by -angle for RoPE tables).
    """
    half = dy.shape[-1] // 2
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # (..., seq, 1, head_dim): over heads
    dy1 = dy[..., :half].to(cos.dtype)  # (batch, seq, heads, half)
    dy2 = dy[..., half:].to(cos.dtype)
    dx = torch.empty(dy.shape, dtype=out_dtype, device=dy.device)
    dx[..., :half] = dy1 * cos[..., :half] + dy2 * sin[..., half:]
    dx[..., half:] = dy2 * cos[..., half:] - dy1 * sin[..., :half]
    return dx


def _rotary_forward(ctx, inputs: tuple[Tensor, ...], cos: Tensor, sin: Tensor) -> tuple:
    """Shared forward of the two Functions: save the tables, rotate every input."""
    compute_dtype = promoted_dtype(inputs[0].dtype)
    cos, sin = cos.to(compute_dtype), sin.to(compute_dtype)  # no copy for fp32 tables
    ctx.save_for_backward(cos, sin)
    ctx.x_dtype = inputs[0].dtype
    if _use_triton(inputs[0].device):
        return _launch_rotary(inputs, cos, sin, transpose=False, out_dtype=ctx.x_dtype)
    return tuple(_rotate(x, cos, sin, ctx.x_dtype) for x in inputs)


def _rotary_backward(ctx, grads: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    cos, sin = ctx.saved_tensors
    if _use_triton(grads[0].device):
        return _launch_rotary(grads, cos, sin, transpose=True, out_dtype=ctx.x_dtype)
    return tuple(_rotate_transposed(dy, cos, sin, ctx.x_dtype) for dy in grads)


class RotaryFunction(torch.autograd.Function):
    """RoPE in the rotate_half layout; saves only cos and sin."""

    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        (out,) = _rotary_forward(ctx, (x,), cos, sin)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor, None, None]:
        (grad_x,) = _rotary_backward(ctx, (grad_out,))
        return grad_x, None, None


class RotaryQKFunction(torch.autograd.Function):
    """RoPE of queries and keys by the same tables, one kernel launch each way."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        return _rotary_forward(ctx, (q, k), cos, sin)

    @staticmethod
    def backward(ctx, grad_q_out: Tensor, grad_k_out: Tensor) -> tuple[Tensor, Tensor, None, None]:
        grad_q, grad_k = _rotary_backward(ctx, (grad_q_out, grad_k_out))
        return grad_q, grad_k, None, None


def _check_rotary_inputs(function: str, x: Tensor, cos: Tensor, sin: Tensor) -> None:
    if not (x.is_floating_point() and cos.is_floating_point() and sin.is_floating_point()):
        raise ValueError(
            f"{function} expects floating-point x, cos and sin, got x.dtype={x.dtype}, "
            f"cos.dtype={cos.dtype}, sin.dtype={sin.dtype}"
        )
    if x.dim() != 4 or x.shape[-1] % 2 != 0:
        raise ValueError(
            f"{function} expects x of shape (batch, seq, heads, head_dim) with an even "
            f"head_dim, got x.shape={tuple(x.shape)}"
        )
    batch, seq, _, head_dim = x.shape
    allowed = [(seq, head_dim), (batch, seq, head_dim)]
    if cos.shape != sin.shape or tuple(cos.shape) not in allowed:
        raise ValueError(
            f"{function} expects cos and sin of shape (seq, head_dim)={allowed[0]} or "
            f"(batch, seq, head_dim)={allowed[1]} for x.shape={tuple(x.shape)}, got "
            f"cos.shape={tuple(cos.shape)} and sin.shape={tuple(sin.shape)}"
        )
    if cos.device != x.device or sin.device != x.device:
        raise ValueError(
            f"{function} expects x, cos and sin on one device, got x on {x.device}, cos on "
            f"{cos.device}, sin on {sin.device}"
        )
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        raise ValueError(
            f"{function} is not differentiable in cos and sin, but they require grad; build "
            "them under torch.no_grad() or pass cos.detach() and sin.detach()"
        )


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the query or key heads x by their positions' angles (HF rotate_half layout).

    Args:
        x: (batch, seq, heads, head_dim) queries or keys, head_dim even. May be a
            non-contiguous view (e.g. a slice of a fused qkv projection): it is read in place.
        cos, sin: (seq, head_dim), or (batch, seq, head_dim) for per-row positions; usually
            fp32 from `rotary_cos_sin`. Must not require grad.

    Returns:
        (batch, seq, heads, head_dim) contiguous tensor of x's dtype. Differentiable in x.
    """
    _check_rotary_inputs("apply_rotary", x, cos, sin)
    return RotaryFunction.apply(x, cos, sin)


def apply_rotary_qk(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Rotate queries and keys by the same tables; on the Triton path, in one kernel launch.

    Same result as (apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)), bit for bit.

    Args:
        q: (batch, seq, heads_q, head_dim) queries; k: (batch, seq, heads_kv, head_dim) keys of
            the same dtype. Either may be a non-contiguous view (e.g. of a fused qkv output).
        cos, sin: (seq, head_dim) or (batch, seq, head_dim), as for `apply_rotary`.

    Returns:
        (q_rotated, k_rotated): contiguous tensors of q's shape and of k's shape, q's dtype.
        Differentiable in q and k.
    """
    _check_rotary_inputs("apply_rotary_qk", q, cos, sin)
    if k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3] or q.dtype != k.dtype:
        raise ValueError(
            f"apply_rotary_qk expects q and k with the same batch, seq, head_dim and dtype, got "
            f"q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)}, q.dtype={q.dtype}, "
            f"k.dtype={k.dtype}; rotate them with two apply_rotary calls otherwise"
        )
    _check_rotary_inputs("apply_rotary_qk", k, cos, sin)
    return RotaryQKFunction.apply(q, k, cos, sin)


def _inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> Tensor:
    """(head_dim // 2,) fp32 inverse frequencies on the CPU, op for op as Hugging Face."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    rope_type = "default" if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if rope_type in ("default", None):
        return inv_freq
    if rope_type != "llama3":
        raise ValueError(
            f"rotary_cos_sin supports rope_type None, 'default' and 'llama3', got "
            f"rope_type={rope_type!r} (scaling={scaling})"
        )
    missing = [key for key in _LLAMA3_KEYS if key not in scaling]
    if missing:
        raise ValueError(
            f"rotary_cos_sin: a 'llama3' rope_scaling needs the keys {list(_LLAMA3_KEYS)}, "
            f"missing {missing} in scaling={scaling}"
        )
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    if not high_freq_factor > low_freq_factor:
        raise ValueError(
            f"rotary_cos_sin: a 'llama3' rope_scaling needs high_freq_factor > low_freq_factor, "
            f"got high_freq_factor={high_freq_factor} and low_freq_factor={low_freq_factor}"
        )
    # Llama 3.1 (HF _compute_llama3_parameters): keep short wavelengths, divide long ones by
    # factor, interpolate smoothly in between. Same ops in the same order as HF.
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    smoothed_inv_freq = (
        1 - smooth_factor
    ) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


@functools.cache
def _device_inverse_frequencies(head_dim: int, theta: float, scaling: str, device) -> Tensor:
    """The inverse frequencies on `device` (scaling: the rope_scaling dict as JSON), made once:
    no host-to-device copy per forward (a copy from host memory is not allowed while a CUDA graph
    captures a decode step)."""
    return _inverse_frequencies(head_dim, theta, json.loads(scaling)).to(device)


def rotary_cos_sin(
    positions: Tensor | int,
    head_dim: int,
    theta: float,
    scaling: dict | None = None,
    device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor]:
    """cos and sin tables for `apply_rotary`, matching Hugging Face's LlamaRotaryEmbedding.

    Args:
        positions: an int n for positions arange(n), or an integer tensor of positions of
            shape (seq,) or (batch, seq).
        head_dim: the attention head dimension (even).
        theta: the RoPE base (config rope_theta, e.g. 10000.0 or 500000.0).
        scaling: None, or a Hugging Face rope_scaling dict; supported rope_type values are
            "default" and "llama3" (keys factor, low_freq_factor, high_freq_factor,
            original_max_position_embeddings). Other keys, such as rope_theta, are ignored.
        device: where to build the tables; default: positions' device, or the CPU for an int.

    Returns:
        (cos, sin), fp32, each (seq, head_dim), or (batch, seq, head_dim) for 2-D positions.
    """
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0:
        raise ValueError(f"rotary_cos_sin expects a positive int head_dim, got {head_dim!r}")
    if head_dim % 2 != 0:
        raise ValueError(f"rotary_cos_sin expects an even head_dim, got head_dim={head_dim}")
    if not theta > 0:
        raise ValueError(f"rotary_cos_sin expects theta > 0, got theta={theta}")
    if scaling is not None and not isinstance(scaling, dict):
        raise ValueError(f"rotary_cos_sin expects scaling to be None or a dict, got {scaling!r}")
    if isinstance(positions, Tensor):
        if positions.dim() not in (1, 2) or positions.is_floating_point() or positions.is_complex():
            raise ValueError(
                f"rotary_cos_sin expects integer positions of shape (seq,) or (batch, seq), got "
                f"shape={tuple(positions.shape)} and dtype={positions.dtype}"
            )
        device = positions.device if device is None else torch.device(device)
        positions = positions.to(device)
    elif isinstance(positions, int) and not isinstance(positions, bool) and positions >= 0:
        device = torch.device("cpu") if device is None else torch.device(device)
        positions = torch.arange(positions, device=device)
    else:
        raise ValueError(
            f"rotary_cos_sin expects positions to be an int >= 0 or an integer tensor, got "
            f"{positions!r}"
        )

    if torch.compiler.is_compiling():  # traced into the graph: no cache to consult
        inv_freq = _inverse_frequencies(head_dim, float(theta), scaling).to(device)
    else:
        inv_freq = _device_inverse_frequencies(
            head_dim, float(theta), json.dumps(scaling, sort_keys=True), device
        )  # (head_dim / 2,)
    freqs = positions[..., None].float() * inv_freq  # (..., seq, head_dim / 2)
    angles = torch.cat((freqs, freqs), dim=-1)  # (..., seq, head_dim)
    return angles.cos(), angles.sin()
