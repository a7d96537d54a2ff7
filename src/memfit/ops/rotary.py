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
passing tables that require grad raises. Autocast does not change any op used here.
"""

import math

import torch
from torch import Tensor

__all__ = ["RotaryFunction", "apply_rotary", "rotary_cos_sin"]

_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for 16-bit inputs, fp64 for fp64 inputs (so that gradcheck works)."""
    return torch.promote_types(dtype, torch.float32)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, out_dtype: torch.dtype) -> Tensor:
    """out = x * cos + rotate_half(x) * sin, computed in cos's dtype, returned in out_dtype.

    x: (batch, seq, heads, head_dim), any strides; cos, sin: broadcastable to x, wide dtype.
    """
    half = x.shape[-1] // 2
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
    dy1 = dy[..., :half].to(cos.dtype)  # (batch, seq, heads, half)
    dy2 = dy[..., half:].to(cos.dtype)
    dx = torch.empty(dy.shape, dtype=out_dtype, device=dy.device)
    dx[..., :half] = dy1 * cos[..., :half] + dy2 * sin[..., half:]
    dx[..., half:] = dy2 * cos[..., half:] - dy1 * sin[..., :half]
    return dx


class RotaryFunction(torch.autograd.Function):
    """RoPE in the rotate_half layout; saves only cos and sin."""

    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        compute_dtype = _compute_dtype(x.dtype)
        # (seq, head_dim) -> (seq, 1, head_dim) or (batch, seq, head_dim) -> (batch, seq, 1, hd):
        # broadcast over heads.
        cos = cos.to(compute_dtype).unsqueeze(-2)
        sin = sin.to(compute_dtype).unsqueeze(-2)
        ctx.save_for_backward(cos, sin)
        ctx.x_dtype = x.dtype
        return _rotate(x, cos, sin, x.dtype)

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        return _rotate_transposed(grad_out, cos, sin, ctx.x_dtype), None, None


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the query or key heads x by their positions' angles (HF rotate_half layout).

    Args:
        x: (batch, seq, heads, head_dim) queries or keys, head_dim even. May be a
            non-contiguous view (e.g. a slice of a fused qkv projection).
        cos, sin: (seq, head_dim), or (batch, seq, head_dim) for per-row positions; usually
            fp32 from `rotary_cos_sin`. Must not require grad.

    Returns:
        (batch, seq, heads, head_dim) contiguous tensor of x's dtype. Differentiable in x.
    """
    if not (x.is_floating_point() and cos.is_floating_point() and sin.is_floating_point()):
        raise ValueError(
            f"apply_rotary expects floating-point x, cos and sin, got x.dtype={x.dtype}, "
            f"cos.dtype={cos.dtype}, sin.dtype={sin.dtype}"
        )
    if x.dim() != 4 or x.shape[-1] % 2 != 0:
        raise ValueError(
            f"apply_rotary expects x of shape (batch, seq, heads, head_dim) with an even "
            f"head_dim, got x.shape={tuple(x.shape)}"
        )
    batch, seq, _, head_dim = x.shape
    allowed = [(seq, head_dim), (batch, seq, head_dim)]
    if cos.shape != sin.shape or tuple(cos.shape) not in allowed:
        raise ValueError(
            f"apply_rotary expects cos and sin of shape (seq, head_dim)={allowed[0]} or "
            f"(batch, seq, head_dim)={allowed[1]} for x.shape={tuple(x.shape)}, got "
            f"cos.shape={tuple(cos.shape)} and sin.shape={tuple(sin.shape)}"
        )
    if cos.device != x.device or sin.device != x.device:
        raise ValueError(
            f"apply_rotary expects x, cos and sin on one device, got x on {x.device}, cos on "
            f"{cos.device}, sin on {sin.device}"
        )
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        raise ValueError(
            "apply_rotary is not differentiable in cos and sin, but they require grad; build "
            "them under torch.no_grad() or pass cos.detach() and sin.detach()"
        )
    return RotaryFunction.apply(x, cos, sin)


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

    inv_freq = _inverse_frequencies(head_dim, float(theta), scaling).to(device)  # (head_dim/2,)
    freqs = positions[..., None].float() * inv_freq  # (..., seq, head_dim / 2)
    angles = torch.cat((freqs, freqs), dim=-1)  # (..., seq, head_dim)
    return angles.cos(), angles.sin()
