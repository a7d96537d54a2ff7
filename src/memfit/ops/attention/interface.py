"""The public FlashAttention functions: input validation (the errors users see), the
torch.library ops (opaque to torch.compile, visible by name to selective activation
checkpointing), the eager autograd Function, and `flash_attention` / `flash_attention_varlen`."""

import math

import torch
from torch import Tensor

import memfit.ops._triton as _triton
from memfit.ops._triton import HAS_TRITON
from memfit.ops.attention.launch import _backward, _forward, _shape
from memfit.ops.attention.tiles import NO_LIMIT

SUPPORTED_HEAD_DIMS = "multiples of 8 from 16 to 256 (32, 64, 96, 128 and 256 among them)"

# --------------------------------------------------------------------------------------------
# torch.library ops: opaque to torch.compile (the block around them still compiles), visible to
# selective activation checkpointing by name, differentiable through register_autograd.
# --------------------------------------------------------------------------------------------

_FWD_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, "
    "SymInt max_seqlen_q, SymInt max_seqlen_k, int left, int right, float softmax_scale) "
    "-> (Tensor, Tensor)"
)
_BWD_SCHEMA = (
    "(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? cu_seqlens_q, "
    "Tensor? cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, int left, int right, "
    "float softmax_scale) -> (Tensor, Tensor, Tensor)"
)


def _forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *args):
    batch, heads, _, _ = _shape(q, k, cu_seqlens_q)
    lse_shape = (heads, q.shape[0]) if cu_seqlens_q is not None else (batch, heads, q.shape[1])
    return q.new_empty(q.shape), q.new_empty(lse_shape, dtype=torch.float32)


def _backward_fake(dout, q, k, v, *args):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, left, right, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
    ctx.args = (max_seqlen_q, max_seqlen_k, left, right, scale)
    ctx.mark_non_differentiable(lse)


def _saved_backward(ctx, dout, backward) -> tuple:
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    dq, dk, dv = backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None, None


def _autograd_backward(ctx, dout, dlse):
    return _saved_backward(ctx, dout, torch.ops.memfit.flash_attn_backward)


def _define_ops() -> None:
    if hasattr(torch.ops.memfit, "flash_attn_forward"):  # module imported twice (tests)
        return
    fwd = torch.library.custom_op(
        "memfit::flash_attn_forward", mutates_args=(), schema=_FWD_SCHEMA
    )(_forward)
    fwd.register_fake(_forward_fake)
    fwd.register_autograd(_autograd_backward, setup_context=_setup_context)
    bwd = torch.library.custom_op(
        "memfit::flash_attn_backward", mutates_args=(), schema=_BWD_SCHEMA
    )(_backward)
    bwd.register_fake(_backward_fake)


_define_ops()


class _FlashAttention(torch.autograd.Function):
    """The same forward and backward as the ops above, called directly: the eager fast path.
    torch.library's Python wrappers cost ~1 ms of host time per forward+backward on torch 2.11
    (more than the kernels at 1-2k tokens); this costs what the launches cost."""

    @staticmethod
    def forward(ctx, *inputs):
        output = _forward(*inputs)
        _setup_context(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx, dout, dlse):
        return _saved_backward(ctx, dout, _backward)


def _attend(q, k, v, cu_seqlens_q, cu_seqlens_k, *args) -> tuple[Tensor, Tensor]:
    """(out, lse) through the registered op where something must see it (torch.compile, a
    dispatch mode such as selective checkpointing or fake tensors, tensor subclasses), else
    through _FlashAttention."""
    direct = (
        not torch.compiler.is_compiling()
        and torch._C._len_torch_dispatch_stack() == 0
        and type(q) is Tensor
        and type(k) is Tensor
        and type(v) is Tensor
    )
    if direct:
        return _FlashAttention.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, *args)
    return torch.ops.memfit.flash_attn_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, *args)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    softmax_scale: float | None = None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Exact attention softmax(q k^T * scale + mask) v without the (seqlen_q, seqlen_k) matrix.

    q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim),
    heads_q a multiple of heads_kv (GQA/MQA: K and V are read per group, never repeated); fp16
    or bf16, on CUDA. Returns out like q, and with return_lse=True also the fp32 log-sum-exp of
    each row's scores, (batch, heads_q, seqlen_q) (-inf for a row that sees no key; not
    differentiable).

    causal: query i sees keys up to i + seqlen_k - seqlen_q (aligned bottom-right).
    window=(left, right): the query at aligned position p sees keys p-left .. p+right (None or -1
    for no limit on that side); with causal, right is 0. Mistral's sliding window W is
    window=(W - 1, 0). softmax_scale defaults to head_dim ** -0.5.
    """
    _check(q, k, v, packed=False)
    left, right = _window(window, causal)
    scale = _scale(softmax_scale, q.shape[-1])
    q, k, v = _unit_stride(q), _unit_stride(k), _unit_stride(v)
    out, lse = _attend(q, k, v, None, None, q.shape[1], k.shape[1], left, right, scale)
    return (out, lse) if return_lse else out


def flash_attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    *,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    softmax_scale: float | None = None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """`flash_attention` over packed sequences of different lengths; no token attends across a
    boundary.

    q: (total_q, heads_q, head_dim), k, v: (total_k, heads_kv, head_dim); sequence b is rows
    cu_seqlens_q[b]:cu_seqlens_q[b+1] of q and cu_seqlens_k[b]:cu_seqlens_k[b+1] of k and v
    (int32, batch + 1 entries starting at 0). max_seqlen_q/k: the longest sequences (computed
    from cu_seqlens, with a device sync, when not given). lse: (heads_q, total_q).
    """
    _check(q, k, v, packed=True)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, Tensor) or cu.dim() != 1 or cu.dtype != torch.int32:
            raise ValueError(
                f"{name} must be a 1-D int32 tensor of cumulative lengths, got {_describe(cu)}"
            )
        if cu.device != q.device:
            raise ValueError(f"{name} is on {cu.device} but q is on {q.device}")
        if cu.numel() < 1:
            raise ValueError(f"{name} needs batch + 1 >= 1 entries, got none")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(
            f"cu_seqlens_q has {cu_seqlens_q.numel()} entries and cu_seqlens_k "
            f"{cu_seqlens_k.numel()}: both need batch + 1"
        )
    if max_seqlen_q is None:
        max_seqlen_q = _longest(cu_seqlens_q)
    if max_seqlen_k is None:
        max_seqlen_k = _longest(cu_seqlens_k)
    left, right = _window(window, causal)
    scale = _scale(softmax_scale, q.shape[-1])
    q, k, v = _unit_stride(q), _unit_stride(k), _unit_stride(v)
    out, lse = _attend(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, left, right, scale
    )
    return (out, lse) if return_lse else out


def _longest(cu_seqlens: Tensor) -> int:
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0


def _describe(t) -> str:
    if not isinstance(t, Tensor):
        return type(t).__name__
    return f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')} on {t.device}"


def _check(q, k, v, *, packed: bool) -> None:
    dims = 3 if packed else 4
    layout = "(tokens, heads, head_dim)" if packed else "(batch, seqlen, heads, head_dim)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != dims:
            raise ValueError(f"{name} must be a {dims}-D tensor {layout}, got {_describe(t)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"flash_attention takes float16 or bfloat16, got {q.dtype} (under autocast the "
            "projections already return bf16; for fp32 use memfit.functional.attention)"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v devices differ: {q.device}, {k.device}, {v.device}")
    if not HAS_TRITON:
        raise ValueError("flash_attention needs triton, which is not installed")
    if q.device.type != "cuda" and not (q.device.type == "cpu" and _triton._cpu_requested):
        raise ValueError(
            f"flash_attention runs on CUDA tensors, got {q.device} (on CPU use "
            "memfit.functional.attention with backend='sdpa')"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if not packed and q.shape[0] != k.shape[0]:
        raise ValueError(f"q has batch {q.shape[0]} but k and v have {k.shape[0]}")
    head_dim, heads_q, heads_kv = q.shape[-1], q.shape[-2], k.shape[-2]
    if k.shape[-1] != head_dim:
        raise ValueError(f"q has head_dim {head_dim} but k and v have {k.shape[-1]}")
    if heads_kv == 0 or heads_q % heads_kv != 0:
        raise ValueError(f"heads_q={heads_q} must be a multiple of heads_kv={heads_kv}")
    if not head_dim_supported(head_dim):
        raise ValueError(f"head_dim={head_dim} is not supported: {SUPPORTED_HEAD_DIMS}")


def head_dim_supported(head_dim: int) -> bool:
    return head_dim % 8 == 0 and 16 <= head_dim <= 256


def _window(window, causal: bool) -> tuple[int, int]:
    if window is None:
        left = right = None
    else:
        try:
            left, right = window
        except (TypeError, ValueError):
            raise ValueError(f"window must be (left, right) or None, got {window!r}") from None
    sides = []
    for name, side in (("left", left), ("right", right)):
        if side is None or side == -1:
            sides.append(NO_LIMIT)
        elif isinstance(side, int) and not isinstance(side, bool) and side >= 0:
            sides.append(min(side, NO_LIMIT))
        else:
            raise ValueError(f"window {name} must be an int >= 0, -1 or None, got {side!r}")
    if causal:
        sides[1] = 0
    return sides[0], sides[1]


def scale_supported(softmax_scale) -> bool:
    """Whether `softmax_scale` is one the kernels take: a positive finite Python number."""
    return (
        isinstance(softmax_scale, (int, float))
        and math.isfinite(softmax_scale)
        and softmax_scale > 0
    )


def _scale(softmax_scale: float | None, head_dim: int) -> float:
    if softmax_scale is None:
        return head_dim**-0.5
    if not scale_supported(softmax_scale):
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale!r}")
    return float(softmax_scale)


def _unit_stride(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()
