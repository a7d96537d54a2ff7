"""Public, typed entry points to memfit's ops. Modules call these, never an op's Function directly.

Shapes follow the contract of DESIGN.md: attention takes (batch, seqlen, heads, head_dim).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from memfit.ops._triton import HAS_TRITON, use_triton
from memfit.ops.attention import (
    SUPPORTED_HEAD_DIMS,
    flash_attention,
    flash_attention_varlen,
    head_dim_supported,
)
from memfit.ops.attention.block_sparse import sparse_attention
from memfit.ops.attention.paged import paged_attention
from memfit.ops.cross_entropy import linear_cross_entropy
from memfit.ops.distill import linear_distillation_loss
from memfit.ops.gemv import gemv
from memfit.ops.rms_norm import add_rms_norm, rms_norm
from memfit.ops.rotary import apply_rotary, apply_rotary_qk, rotary_cos_sin
from memfit.ops.swiglu import swiglu
from memfit.ops.swiglu import swiglu as _swiglu  # linear's `swiglu` argument shadows it

__all__ = [
    "AttentionBackend",
    "add_rms_norm",
    "apply_rotary",
    "apply_rotary_qk",
    "attention",
    "flash_attention",
    "flash_attention_varlen",
    "linear",
    "linear_cross_entropy",
    "linear_distillation_loss",
    "register_attention_backend",
    "resolve_attention",
    "rms_norm",
    "rotary_cos_sin",
    "sparse_attention",
    "swiglu",
]

AttentionBackend = Literal["auto", "flash", "sdpa", "eager"]


def resolve_attention(
    backend: AttentionBackend,
    device: torch.device,
    *,
    precision: str = "bf16",
    head_dim: int | None = None,
    window: int | None = None,
) -> Literal["flash", "sdpa", "eager"]:
    """The kernel `attention` runs for `backend` on `device` when training in `precision`.

    `auto` is torch SDPA, except for models with a sliding `window` on CUDA in bf16/fp16, which
    get memfit's Triton FlashAttention: SDPA has no fused kernel for a window (it falls back to an
    explicit mask and dense work, 14x slower at 8k tokens on an H100, BENCHMARKS.md), while for
    plain causal attention on an H100 SDPA picks cuDNN, which trains llama-1b 4-10% faster than
    memfit's kernel today (BENCHMARKS.md, "Attention"). `flash` insists on memfit's kernel and
    says why when it cannot run.
    """
    if backend not in ("auto", "flash", "sdpa", "eager"):
        raise ValueError(
            f"unknown attention backend {backend!r}; choose one of auto, flash, sdpa, eager"
        )
    if backend in ("sdpa", "eager"):
        return backend
    reason = _flash_unavailable(torch.device(device), precision, head_dim)
    if backend == "flash" and reason:
        raise ValueError(f"attention='flash' cannot run here: {reason}; use auto or sdpa")
    return "flash" if not reason and (backend == "flash" or window is not None) else "sdpa"


def _flash_unavailable(device: torch.device, precision: str, head_dim: int | None) -> str | None:
    """Why memfit's FlashAttention cannot run, or None when it can."""
    if device.type != "cuda":
        return f"it runs on CUDA devices, not {device.type}"
    if not HAS_TRITON:
        return "triton is not installed"
    if precision not in ("bf16", "fp16"):
        return f"it computes in bf16 or fp16, not {precision}"
    if head_dim is not None and not head_dim_supported(head_dim):
        return f"head_dim {head_dim} is not one it takes ({SUPPORTED_HEAD_DIMS})"
    return None


AttentionKernel = Callable[..., Tensor]
"""kernel(q, k, v, *, causal, window, mask, metadata) -> out, shapes as in `attention`."""

_ATTENTION_BACKENDS: dict[str, AttentionKernel] = {}


def register_attention_backend(name: str, kernel: AttentionKernel) -> None:
    """Make `kernel` the attention backend `name` (`attention(..., backend=name)`, `memfit train
    --attention name`): a paged-decode or block-sparse kernel registers itself here, and models,
    which only name their backend, run it unchanged."""
    if name in _ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {name!r} is already registered")
    _ATTENTION_BACKENDS[name] = kernel


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    window: int | None = None,
    backend: str = "sdpa",
    mask: Tensor | None = None,
    metadata=None,
    stride: int = 0,
    kv_scales: tuple[Tensor, ...] | None = None,
) -> Tensor:
    """Scaled dot-product attention with grouped key/value heads.

    q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim) with
    heads_q % heads_kv == 0. Returns (batch, seqlen_q, heads_q, head_dim).
    The causal mask is aligned bottom-right: query i sees keys up to i + seqlen_k - seqlen_q (so a
    decode step with a cache sees every cached key). `window`, if set, also hides keys more than
    `window - 1` positions behind the query (Mistral's sliding window). `mask` (broadcastable to
    (batch, 1, seqlen_q, seqlen_k), bool, True where allowed) replaces both: a static KV cache's
    mask (AttentionMetadata.cached); the flash backend takes no mask and hands such calls, and
    fp32 ones, to sdpa.
    `metadata` (memfit.nn.AttentionMetadata) with a block table: k and v are a paged cache's
    block pools of one layer (num_blocks, block_size, heads_kv, head_dim), q holds the step's
    tokens flattened (1, tokens, heads_q, head_dim), each attending to its own sequence's blocks
    up to its position: the "paged" backend runs; there `stride` S > 0 beside a `window` also
    shows each query the summary columns S - 1, 2S - 1, ... (a strided sparse pattern), and
    `kv_scales` (k_scale, v_scale[, first_key, first_value]) says the pools are a quantized
    cache's, stored divided by them: fp8's (heads_kv,) each, int8's per token (num_blocks,
    block_size, heads_kv), and the first position's offsets (memfit.inference.PagedKVCache.
    kv_scales).
    backend: a registered name: flash (memfit's Triton FlashAttention, fp16/bf16 on CUDA), sdpa
    (torch's fused attention), eager (materializes the scores; a reference), or auto
    (`resolve_attention`).
    """
    heads_q, heads_kv = q.shape[2], k.shape[2]
    if heads_q % heads_kv != 0:
        raise ValueError(f"heads_q={heads_q} must be a multiple of heads_kv={heads_kv}")
    if backend == "auto":
        precision = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(q.dtype, "fp32")
        backend = resolve_attention(
            "auto", q.device, precision=precision, head_dim=q.shape[3], window=window
        )
    if metadata is not None and metadata.block_table is not None:
        backend = "paged"
    elif backend == "flash" and (mask is not None or q.dtype == torch.float32):
        backend = "sdpa"  # (a block computing in fp32 in a bf16 run: memfit.train.precision)
    if backend not in _ATTENTION_BACKENDS:
        raise ValueError(
            f"unknown attention backend {backend!r}; registered: {', '.join(_ATTENTION_BACKENDS)}"
        )
    kernel = _ATTENTION_BACKENDS[backend]
    paged = {}
    if stride:
        if backend != "paged" or window is None:
            raise ValueError(
                "stride (a strided pattern's summary columns) takes a paged cache and a window"
            )
        paged["stride"] = stride
    if kv_scales is not None:
        if backend != "paged":
            raise ValueError("kv_scales (a quantized cache's) take a paged cache")
        paged["kv_scales"] = kv_scales
    return kernel(q, k, v, causal=causal, window=window, mask=mask, metadata=metadata, **paged)


def linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    swiglu: bool = False,
    residual: Tensor | None = None,
) -> Tensor:
    """F.linear(x, weight, bias); an x of one row (a batch-1 decode step) takes memfit's Triton
    matrix-vector product (memfit.ops.gemv) where Triton runs, the dtypes agree and no gradient
    is needed. swiglu: weight is a fused gate/up projection and the result is swiglu of the
    product. residual: added to the result (a residual branch's output projection). Either is
    folded into the one-row kernel; otherwise they are the separate ops."""
    out = weight.shape[0] // 2 if swiglu else weight.shape[0]
    if (
        x.numel() == x.shape[-1] == weight.shape[1]
        and x.dtype == weight.dtype
        and (bias is None or bias.dtype == x.dtype)
        and (residual is None or (residual.dtype == x.dtype and residual.numel() == out))
        and weight.stride(1) == 1
        and not (
            torch.is_grad_enabled()
            and any(t.requires_grad for t in (x, weight, bias, residual) if t is not None)
        )
        and use_triton(x)
    ):
        return gemv(x, weight, bias, swiglu=swiglu, residual=residual)
    y = F.linear(x, weight, bias)
    y = _swiglu(y) if swiglu else y
    return y if residual is None else residual + y


def _flash(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, window, mask, metadata=None) -> Tensor:
    # Mistral's window W hides keys W or more positions back: (left, right) = (W - 1, 0)
    flash_window = (window - 1, 0) if window is not None else None
    return flash_attention(q, k, v, causal=causal, window=flash_window)


def _sdpa(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, window, mask, metadata=None) -> Tensor:
    seqlen_q, seqlen_k, heads_q, heads_kv = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    if mask is None:
        mask = _mask(seqlen_q, seqlen_k, causal, window, q.device)
        is_causal = mask is None and causal and seqlen_q > 1
        if is_causal and seqlen_q != seqlen_k:  # SDPA aligns is_causal top-left
            mask = _mask(seqlen_q, seqlen_k, True, None, q.device, force=True)
            is_causal = False
    else:
        is_causal = False
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, nh, T, hs)
    gqa = {"enable_gqa": True} if heads_kv != heads_q else {}
    if gqa and q.is_cuda and q.dtype == torch.float32:
        # No fused CUDA kernel takes fp32 with enable_gqa: SDPA would fall back to its math
        # path, which keeps the (T, T) probabilities. Repeat k and v and stay fused instead.
        group = heads_q // heads_kv
        k, v, gqa = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), {}
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, **gqa)
    return out.transpose(1, 2)  # (B, T, nh, hs)


def _eager(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, window, mask, metadata=None) -> Tensor:
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    if mask is None:
        mask = _mask(seqlen_q, seqlen_k, causal, window, q.device)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, nh, T, hs)
    return _eager_attention(q, k, v, mask, causal).transpose(1, 2)


def _paged_reference(
    q: Tensor, key_pool: Tensor, value_pool: Tensor, *, causal: bool, window, mask, metadata,
    stride: int = 0, kv_scales: tuple[Tensor, ...] | None = None,
) -> Tensor:  # fmt: skip
    """Paged attention in plain PyTorch, the reference the paged Triton kernels replace: each
    token's sequence's blocks are gathered into (tokens, blocks x block_size, heads_kv, head_dim)
    and attended under the mask of the positions up to the token's (within the window)."""
    table = metadata.block_table[metadata.seq_index]  # (T, max_blocks)
    keys = key_pool[table].flatten(1, 2)  # (T, S, nkv, hs)
    values = value_pool[table].flatten(1, 2)
    if kv_scales is not None:  # a quantized cache's: widened, scaled back (the key offset stays)
        k_scale, v_scale, *first = kv_scales
        per_token = k_scale.ndim == 3  # int8's per-token scales, (blocks, block_size, heads_kv)
        if per_token:
            k_scale, v_scale = (
                x[table].flatten(1, 2).float()[..., None] for x in (k_scale, v_scale)
            )
        else:
            k_scale, v_scale = k_scale[:, None], v_scale[:, None]
        keys, values = keys.float() * k_scale, values.float() * v_scale
        if first and first[0] is not None:  # the first position's own offsets, given back
            first_key, first_value = (
                first if per_token else (first[0] * k_scale, first[1] * v_scale)
            )
            keys[:, 0] += first_key
            values[:, 0] += first_value
        keys, values = keys.to(q.dtype), values.to(q.dtype)
    key_positions = torch.arange(keys.shape[1], device=q.device)
    positions = metadata.positions[:, None]
    allowed = key_positions[None, :] <= positions  # (T, S)
    if window is not None:
        inside = key_positions[None, :] > positions - window
        if stride:  # (a strided pattern's summary columns)
            inside |= ((key_positions + 1) % stride == 0)[None, :]
        allowed &= inside
    out = _sdpa(
        q.transpose(0, 1), keys, values, causal=False, window=None, mask=allowed[:, None, None, :]
    )  # (T, 1, nh, hs)
    return out.transpose(0, 1)  # (1, T, nh, hs)


def _paged(
    q: Tensor, key_pool: Tensor, value_pool: Tensor, *, causal: bool, window, mask, metadata,
    stride: int = 0, kv_scales: tuple[Tensor, ...] | None = None,
):  # fmt: skip
    """memfit's Triton paged kernels (memfit.ops.attention.paged) where Triton runs, else the
    plain-PyTorch reference."""
    if not use_triton(q) or metadata.seq_lens is None or not head_dim_supported(q.shape[-1]):
        return _paged_reference(
            q, key_pool, value_pool, causal=causal, window=window, mask=mask, metadata=metadata,
            stride=stride, kv_scales=kv_scales,
        )  # fmt: skip
    k_scale, v_scale, first_key, first_value = (*(kv_scales or ()), None, None, None, None)[:4]
    out = paged_attention(
        q[0], key_pool, value_pool, block_table=metadata.block_table, seq_lens=metadata.seq_lens,
        query_start=metadata.query_start, max_query_len=metadata.max_query_len,
        max_seq_len=metadata.max_seq_len, window=window, stride=stride, k_scale=k_scale,
        v_scale=v_scale, first_key=first_key, first_value=first_value,
    )  # fmt: skip
    return out[None]


register_attention_backend("flash", _flash)
register_attention_backend("paged", _paged)
register_attention_backend("sdpa", _sdpa)
register_attention_backend("eager", _eager)


def _mask(
    seqlen_q: int,
    seqlen_k: int,
    causal: bool,
    window: int | None,
    device: torch.device,
    force: bool = False,
) -> Tensor | None:
    """Boolean (seqlen_q, seqlen_k) mask, True where attention is allowed; None when the plain
    causal (square) or unmasked case applies, so SDPA can take its mask-free fast path."""
    needs_window = window is not None and seqlen_k > window
    if not force and not needs_window and (not causal or seqlen_q == seqlen_k or seqlen_q == 1):
        return None
    query_pos = torch.arange(seqlen_k - seqlen_q, seqlen_k, device=device)[:, None]
    key_pos = torch.arange(seqlen_k, device=device)[None, :]
    allowed = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if causal:
        allowed &= key_pos <= query_pos
    if needs_window:
        allowed &= key_pos > query_pos - window
    return allowed


def _eager_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
    """Reference path: materializes the (T_q, T_k) scores, softmax in fp32. Inputs (B, nh, T, hs)."""
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-2, -1)).to(torch.promote_types(q.dtype, torch.float32)) * q.shape[
        -1
    ] ** -0.5
    if mask is None and causal and seqlen_q > 1:
        mask = _mask(seqlen_q, seqlen_k, True, None, q.device, force=True)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = scores.softmax(dim=-1).to(v.dtype)
    return probs @ v
