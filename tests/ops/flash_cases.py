"""Shared checks of memfit's FlashAttention, run on CPU under Triton's interpreter
(test_flash_attention.py) and on a GPU at real shapes (test_flash_attention_gpu.py)."""

import torch

from memfit.ops.flash_attention import flash_attention, flash_attention_varlen
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
    grad_out = torch.randn_like(out)
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
    """Packed documents give what each document gives alone (no attention across boundaries)."""
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = make_qkv(1, sum(lengths_q), sum(lengths_k), heads, heads_kv, head_dim, dtype, device)
    q, k, v = (t.detach()[0].requires_grad_() for t in (q, k, v))
    out, lse = flash_attention_varlen(
        q, k, v, cu_q.to(device), cu_k.to(device), causal=causal, window=window, return_lse=True
    )
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    for b in range(len(lengths_q)):
        rows_q, rows_k = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])

        def piece(t, rows):
            return t.detach()[rows].unsqueeze(0)

        def reference(dtype, rows_q=rows_q, rows_k=rows_k):
            leaves = [piece(q, rows_q), piece(k, rows_k), piece(v, rows_k)]
            leaves = [t.to(dtype).requires_grad_() for t in leaves]
            ref_out, ref_lse = attention_reference(
                *leaves, causal=causal, window=window, dtype=dtype
            )
            ref_grads = torch.autograd.grad(ref_out, leaves, piece(grad_out, rows_q).to(dtype))
            return ref_out, ref_lse, ref_grads

        exact_out, exact_lse, exact_grads = reference(torch.float64)
        base_out, _, base_grads = reference(dtype)
        tag = f"document {b} ({lengths_q[b]}x{lengths_k[b]})"
        assert_error_within(piece(out, rows_q), base_out, exact_out, name=f"{tag} out", floor=floor)
        for name, actual, rows, baseline, exact in zip(
            "dq dk dv".split(),
            grads,
            (rows_q, rows_k, rows_k),
            base_grads,
            exact_grads,
            strict=True,
        ):
            assert_error_within(
                piece(actual, rows), baseline, exact, name=f"{tag} {name}", floor=floor
            )
        seen = exact_lse[0].isfinite()
        doc_lse = lse[:, rows_q]
        torch.testing.assert_close(doc_lse[seen].double(), exact_lse[0][seen], atol=1e-4, rtol=1e-4)


def check_deterministic(q, k, v, **options):
    out = flash_attention(q, k, v, **options)
    grad_out = torch.randn_like(out)
    first = (out, *torch.autograd.grad(out, (q, k, v), grad_out))
    out = flash_attention(q, k, v, **options)
    second = (out, *torch.autograd.grad(out, (q, k, v), grad_out))
    for name, a, b in zip("out dq dk dv".split(), first, second, strict=True):
        assert torch.equal(a, b), f"{name} differs between two identical runs"
