"""Slow, obviously correct reference implementations, shared by tests and benchmarks.

Each reference is plain, differentiable PyTorch that computes in the dtype of its inputs: run
it on fp64 inputs for the "exact" answer, and on bf16/fp16/fp32 inputs for the baseline that a
memfit op is held to (the house rule: the op's error against the fp64 answer must be at most
twice the baseline's error in the same precision, plus a tiny floor; see `assert_error_within`).
"""

import torch
import torch.nn.functional as F
from torch import Tensor


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x * rsqrt(mean(x**2) + eps) * weight. x (..., hidden), weight (hidden,)."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def swiglu_reference(gate_up: Tensor) -> Tensor:
    """silu(gate) * up. gate_up (..., 2 * ffn) = [gate, up] -> (..., ffn)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotate_half(x: Tensor) -> Tensor:
    """Hugging Face Llama's rotate_half: cat(-x2, x1) over the halves of the last dim."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rotary_reference(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Hugging Face's apply_rotary_pos_emb for x (batch, seq, heads, head_dim).

    cos, sin: (seq, head_dim) or (batch, seq, head_dim); cast to x's dtype first, as HF does.
    """
    cos = cos.to(x.dtype).unsqueeze(-2)  # broadcast over heads
    sin = sin.to(x.dtype).unsqueeze(-2)
    return x * cos + rotate_half(x) * sin


def linear_cross_entropy_reference(
    hidden: Tensor, weight: Tensor, targets: Tensor, ignore_index: int = -100
) -> Tensor:
    """Full logits = hidden @ weight.T, then F.cross_entropy with reduction="sum".

    hidden (N, h), weight (V, h), targets (N,) int64.
    """
    logits = F.linear(hidden, weight)  # (N, V)
    return F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum")


def max_error(actual: Tensor, exact: Tensor) -> float:
    """Largest absolute difference, computed in fp64."""
    if actual.numel() == 0:
        return 0.0
    return (actual.double() - exact.double()).abs().max().item()


def assert_error_within(
    actual: Tensor,
    baseline: Tensor,
    exact: Tensor,
    *,
    name: str,
    factor: float = 2.0,
    floor: float = 1e-6,
) -> None:
    """Assert max|actual - exact| <= factor * max|baseline - exact| + floor * (1 + max|exact|).

    actual: the op under test; baseline: the reference in the same precision; exact: the
    reference in fp64. The floor, relative to the size of the values, keeps the test meaningful
    where the baseline happens to be exact (e.g. zeros).
    """
    assert actual.shape == exact.shape, f"{name}: shape {actual.shape} != {exact.shape}"
    scale = 1.0 + (exact.double().abs().max().item() if exact.numel() else 0.0)
    error, baseline_error = max_error(actual, exact), max_error(baseline, exact)
    bound = factor * baseline_error + floor * scale
    assert error <= bound, (
        f"{name}: error {error:.3e} vs fp64 exceeds {factor} x baseline error "
        f"{baseline_error:.3e} + floor {floor * scale:.3e}"
    )


def saved_tensor_bytes(fn, *args, exclude: tuple[Tensor, ...] = (), **kwargs) -> tuple[object, int]:
    """Run fn(*args, **kwargs) and count the bytes autograd saves for backward.

    Tensors sharing storage with one in `exclude` (parameters: saving them costs no memory)
    are not counted. Returns (fn's result, bytes).
    """
    excluded = {tensor.untyped_storage().data_ptr() for tensor in exclude}
    total = 0

    def pack(tensor: Tensor) -> Tensor:
        nonlocal total
        if tensor.untyped_storage().data_ptr() not in excluded:
            total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = fn(*args, **kwargs)
    return result, total


def attention_reference(
    q: Tensor, k: Tensor, v: Tensor, *, causal=False, window=None, softmax_scale=None, dtype=None
) -> tuple[Tensor, Tensor]:
    """Attention as plain PyTorch writes it, (out, lse), for (batch, seqlen, heads, dim) inputs.

    dtype: fp64 for the exact reference; fp16/bf16 for PyTorch's own error in that precision
    (products in that dtype, softmax in fp32, probabilities rounded before the value product, as
    eager PyTorch computes it). Query i at aligned position p = i + seqlen_k - seqlen_q sees keys
    p - left .. p + right (causal: right = 0); a row that sees no key outputs 0 with lse -inf."""
    dtype = dtype or q.dtype
    seqlen_q, heads, head_dim = q.shape[1], q.shape[2], q.shape[3]
    seqlen_k, group = k.shape[1], heads // k.shape[2]
    qf, kf, vf = (t.to(dtype).transpose(1, 2) for t in (q, k, v))
    kf, vf = kf.repeat_interleave(group, 1), vf.repeat_interleave(group, 1)
    scores = (qf @ kf.transpose(-1, -2)).to(torch.promote_types(dtype, torch.float32))
    scores = scores * (softmax_scale or head_dim**-0.5)
    position = torch.arange(seqlen_q, device=q.device)[:, None] + seqlen_k - seqlen_q
    key = torch.arange(seqlen_k, device=q.device)[None, :]
    left, right = window if window is not None else (None, None)
    right = 0 if causal else right
    allowed = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=q.device)
    if left is not None and left >= 0:
        allowed &= key >= position - left
    if right is not None and right >= 0:
        allowed &= key <= position + right
    empty = ~allowed.any(-1)[:, None]
    scores = scores.masked_fill(~allowed, float("-inf")).masked_fill(empty, 0.0)
    lse = torch.logsumexp(scores, -1).masked_fill(empty[:, 0], float("-inf"))
    probs = scores.softmax(-1).masked_fill(empty, 0.0).to(dtype)
    return (probs @ vf).transpose(1, 2), lse
