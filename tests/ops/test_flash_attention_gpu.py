"""GPU twins of test_flash_attention.py at real shapes, on the compiled kernels (autotuned).
Skipped without CUDA."""

import pytest
import torch

from memfit.models.config import PRESETS
from memfit.models.llama import build_model
from memfit.ops.attention import flash_attention
from tests.ops.flash_cases import (
    check_against_reference,
    check_deterministic,
    check_varlen,
    make_qkv,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CASES = [
    # batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, causal, window
    (2, 1025, 1025, 16, 16, 128, True, None),
    (2, 1025, 1025, 8, 8, 128, False, None),
    (1, 1000, 2000, 32, 4, 64, True, None),  # GQA 8, bottom-right diagonal
    (1, 2000, 1000, 8, 2, 64, True, None),  # GQA 4, rows that see no key
    (1, 97, 97, 8, 1, 32, True, None),
    (1, 777, 1500, 8, 2, 96, True, None),
    (1, 600, 600, 4, 4, 256, True, None),
    (1, 1, 4097, 16, 4, 128, True, None),  # decode step over a cache
    (2, 2048, 2048, 8, 2, 128, True, (255, 0)),  # sliding window 256
    (1, 1025, 1025, 8, 8, 128, False, (100, 20)),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_matches_reference(case, dtype):
    batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, causal, window = case
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, dtype, "cuda")
    check_against_reference(q, k, v, causal=causal, window=window)


def test_varlen_documents_of_very_different_lengths():
    # a one-token document's exact dq is 0 (one key: the softmax is constant); what is left is
    # fp32 rounding of p * (dp - delta), about 1e-6: hence the floor
    lengths = [1, 17, 97, 1025, 3000, 5, 640]
    check_varlen(lengths, lengths, 16, 4, 128, torch.bfloat16, "cuda", causal=True, floor=1e-5)
    check_varlen(
        [3, 500, 1], [700, 900, 64], 8, 8, 64, torch.float16, "cuda", causal=True, floor=1e-5
    )


def test_backward_is_deterministic():
    q, k, v = make_qkv(2, 2048, 2048, 16, 4, 128, torch.bfloat16, "cuda")
    check_deterministic(q, k, v, causal=True, reruns=200)


def test_non_contiguous_fused_projection_views():
    batch, seqlen, heads, heads_kv, head_dim = 2, 1031, 16, 4, 128
    qkv = torch.randn(
        batch, seqlen, (heads + 2 * heads_kv) * head_dim, device="cuda", dtype=torch.bfloat16
    )
    q, k, v = qkv.split([heads * head_dim, heads_kv * head_dim, heads_kv * head_dim], dim=-1)
    q = q.view(batch, seqlen, heads, head_dim).detach().requires_grad_()
    k = k.view(batch, seqlen, heads_kv, head_dim).detach().requires_grad_()
    v = v.view(batch, seqlen, heads_kv, head_dim).detach().requires_grad_()
    check_against_reference(q, k, v, causal=True)


def test_compiles_inside_torch_compile():
    q, k, v = make_qkv(2, 512, 512, 8, 2, 64, torch.bfloat16, "cuda")

    def block(q, k, v):
        return flash_attention(q * 1.0, k, v, causal=True).float().square().sum()

    compiled = torch.compile(block, fullgraph=True)
    eager_loss = block(q, k, v)
    eager_grads = torch.autograd.grad(eager_loss, (q, k, v))
    loss = compiled(q, k, v)
    grads = torch.autograd.grad(loss, (q, k, v))
    torch.testing.assert_close(loss, eager_loss)
    for a, b in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(a, b)


def test_model_trains_the_same_with_flash_and_sdpa():
    """One bf16 step of a llama-shaped model: loss and gradients agree between the backends."""
    config = PRESETS["tiny"]
    tokens = torch.randint(0, config.vocab_size, (2, 257), device="cuda")
    results = {}
    for backend in ("flash", "sdpa"):
        model = build_model(config, device=torch.device("cuda"), attention=backend, seed=0)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(tokens[:, :-1], targets=tokens[:, 1:])
        loss.backward()
        results[backend] = (loss.detach(), [p.grad.detach().clone() for p in model.parameters()])
    (flash_loss, flash_grads), (sdpa_loss, sdpa_grads) = results["flash"], results["sdpa"]
    torch.testing.assert_close(flash_loss, sdpa_loss, atol=2e-2, rtol=1e-2)
    for a, b in zip(flash_grads, sdpa_grads, strict=True):
        assert (a - b).norm() <= 0.05 * b.norm() + 1e-6
