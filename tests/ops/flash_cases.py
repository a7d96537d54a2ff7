"""Shared checks of memfit's FlashAttention, run on CPU under Triton's interpreter
(test_flash_attention.py) and on a GPU at real shapes (test_flash_attention_gpu.py)."""

import torch

from memfit.ops.attention import flash_attention, flash_attention_varlen
from tests.reference import assert_error_within, attention_reference


def make_qkv(batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, dtype, device, seed=0):
    generator = torch.Generator(device="cpu").manual_seed(seed)

    def make(*shape):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    q = make(batch, seqlen_q, heads, head_dim).requires_grad_()
    k = make(batch, seqlen_k, heads_kv, head_dim).requires_grad_()
    v = make(batch, seqlen_k, heads_kv, head_dim).requires_grad_()
    return q, k, v


def check_against_reference(q, k, v, *, causal=False, window=None, softmax_scale=None, floor=1e-6):
    """memfit's output, lse and gradients within 2x of PyTorch's error in the same precision,
    both measured against fp64."""
    out, lse = flash_attention(
        q, k, v, causal=causal, window=window, softmax_scale=softmax_scale, return_lse=True
    )
    generator = torch.Generator(device="cpu").manual_seed(1)
    grad_out = torch.randn(out.shape, generator=generator).to(device=out.device, dtype=out.dtype)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)

    def reference(dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        ref_out, ref_lse = attention_reference(
            *leaves, causal=causal, window=window, softmax_scale=softmax_scale, dtype=dtype
        )
        ref_grads = torch.autograd.grad(ref_out, leaves, grad_out.to(dtype))
        return ref_out, ref_lse, ref_grads

    exact_out, exact_lse, exact_grads = reference(torch.float64)
    base_out, _, base_grads = reference(q.dtype)
    assert_error_within(out, base_out, exact_out, name="out", floor=floor)
    for name, actual, baseline, exact in zip(
        "dq dk dv".split(), grads, base_grads, exact_grads, strict=True
    ):
        assert_error_within(actual, baseline, exact, name=name, floor=floor)
    seen = exact_lse.isfinite()
    assert torch.equal(lse.isfinite(), seen), "rows that see no key must have lse = -inf"
    assert (lse[~seen] == float("-inf")).all()
    torch.testing.assert_close(lse[seen].double(), exact_lse[seen], atol=1e-4, rtol=1e-4)
    return out, grads


def check_varlen(lengths_q, lengths_k, heads, heads_kv, head_dim, dtype, device, *, causal,
                 window=None, floor=1e-6):  # fmt: skip
    """Packed documents give what each document gives alone (no attention across boundaries):
    the references are computed document by document and joined, then compared as one batch."""
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = make_qkv(1, sum(lengths_q), sum(lengths_k), heads, heads_kv, head_dim, dtype, device)
    q, k, v = (t.detach()[0].requires_grad_() for t in (q, k, v))
    out, lse = flash_attention_varlen(
        q, k, v, cu_q.to(device), cu_k.to(device), causal=causal, window=window, return_lse=True
    )
    generator = torch.Generator(device="cpu").manual_seed(1)
    grad_out = torch.randn(out.shape, generator=generator).to(device=device, dtype=dtype)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)

    def reference(dtype):
        """(out, lse, dq, dk, dv) of every document alone, joined along the tokens."""
        pieces = []
        for b in range(len(lengths_q)):
            rows_q, rows_k = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            leaves = [t.detach()[rows].unsqueeze(0).to(dtype).requires_grad_()
                      for t, rows in ((q, rows_q), (k, rows_k), (v, rows_k))]  # fmt: skip
            ref_out, ref_lse = attention_reference(
                *leaves, causal=causal, window=window, dtype=dtype
            )
            ref_grads = torch.autograd.grad(
                ref_out, leaves, grad_out[rows_q].unsqueeze(0).to(dtype)
            )
            pieces.append((ref_out[0], ref_lse[0], *(g[0] for g in ref_grads)))
        return [
            torch.cat(parts, dim=1 if i == 1 else 0)
            for i, parts in enumerate(zip(*pieces, strict=True))
        ]

    exact = reference(torch.float64)
    baseline = reference(dtype)
    for name, actual, base, ex in zip(
        "out dq dk dv".split(), (out, *grads), baseline[:1] + baseline[2:], exact[:1] + exact[2:],
        strict=True,
    ):  # fmt: skip
        assert_error_within(actual, base, ex, name=f"packed {name}", floor=floor)
    seen = exact[1].isfinite()
    assert torch.equal(lse.isfinite(), seen)
    torch.testing.assert_close(lse[seen].double(), exact[1][seen], atol=1e-4, rtol=1e-4)


def check_deterministic(q, k, v, *, reruns: int, **options):
    """out, dq, dk, dv bitwise equal over `reruns` reruns on the same inputs (flash-attn's race
    test): the backward adds nothing atomically, so no run may differ by a single bit."""

    def run():
        out = flash_attention(q, k, v, **options)
        return (out, *torch.autograd.grad(out, (q, k, v), grad_out))

    grad_out = torch.randn_like(flash_attention(q, k, v, **options))
    first = run()
    for rerun in range(reruns):
        for name, a, b in zip("out dq dk dv".split(), first, run(), strict=True):
            assert torch.equal(a, b), f"{name} differs in rerun {rerun + 1} of {reruns}"
