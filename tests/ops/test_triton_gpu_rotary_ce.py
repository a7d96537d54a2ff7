"""GPU twins of the rotary and linear cross-entropy tests, at llama-1b's shapes, on the Triton
path (compiled kernels, not the interpreter). Skipped without CUDA."""

import pytest
import torch

import memfit.ops.cross_entropy as cross_entropy_module
import memfit.ops.rotary as rotary_module
from memfit.ops.cross_entropy import linear_cross_entropy
from memfit.ops.rotary import apply_rotary, apply_rotary_qk, rotary_cos_sin
from tests.reference import assert_error_within, linear_cross_entropy_reference, rotary_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

IGNORE = -100


def fused_qkv(batch: int, seq: int, q_heads: int, kv_heads: int, head_dim: int, dtype):
    """A (batch, seq, (q_heads + 2 kv_heads) * head_dim) leaf and its q and k views."""
    qkv = torch.randn(
        batch, seq, (q_heads + 2 * kv_heads) * head_dim, device="cuda", dtype=dtype
    ).requires_grad_()
    q, k, _ = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = q.view(batch, seq, q_heads, head_dim)  # (B, T, nh, hs), non-contiguous
    k = k.view(batch, seq, kv_heads, head_dim)  # (B, T, nkv, hs)
    return qkv, q, k


@pytest.mark.parametrize("per_row_positions", [False, True])
def test_rotary_at_llama_1b_shape(monkeypatch, per_row_positions):
    torch.manual_seed(0)
    batch, seq, heads, head_dim = 4, 2048, 16, 128
    qkv, q, _ = fused_qkv(batch, seq, heads, heads, head_dim, torch.bfloat16)
    positions = torch.randint(0, 8192, (batch, seq), device="cuda") if per_row_positions else seq
    cos, sin = rotary_cos_sin(positions, head_dim, theta=500000.0, device="cuda")
    grad_out = torch.randn(batch, seq, heads, head_dim, device="cuda", dtype=torch.bfloat16)

    def run(function, x, cos, sin):
        out = function(x, cos, sin)
        (grad,) = torch.autograd.grad(out, x, grad_out.to(out.dtype))
        return out, grad

    ours = run(apply_rotary, q, cos, sin)
    monkeypatch.setattr(rotary_module, "_use_triton", lambda device: False)
    plain = run(apply_rotary, q, cos, sin)
    # Same products, same fp32 rounding (no FMA), same bf16 rounding: equal bit for bit.
    assert torch.equal(ours[0], plain[0]) and torch.equal(ours[1], plain[1])

    baseline = run(rotary_reference, q, cos, sin)
    x64 = q.detach().double().requires_grad_()
    exact = run(rotary_reference, x64, cos.double(), sin.double())
    assert_error_within(ours[0], baseline[0], exact[0], name="out")
    assert_error_within(ours[1], baseline[1], exact[1], name="grad_x")


def test_rotary_qk_at_llama_1b_shape_with_gqa():
    torch.manual_seed(0)
    batch, seq, q_heads, kv_heads, head_dim = 2, 2048, 16, 4, 128
    qkv, q, k = fused_qkv(batch, seq, q_heads, kv_heads, head_dim, torch.bfloat16)
    cos, sin = rotary_cos_sin(seq, head_dim, theta=10000.0, device="cuda")
    grad_q = torch.randn(batch, seq, q_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    grad_k = torch.randn(batch, seq, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)

    q_out, k_out = apply_rotary_qk(q, k, cos, sin)
    (grad_pair,) = torch.autograd.grad((q_out, k_out), qkv, (grad_q, grad_k))
    q_single, k_single = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    (grad_single,) = torch.autograd.grad((q_single, k_single), qkv, (grad_q, grad_k))
    assert torch.equal(q_out, q_single) and torch.equal(k_out, k_single)
    assert torch.equal(grad_pair, grad_single)


def loss_and_grads(function, hidden, weight, targets, **kwargs):
    hidden = hidden.detach().requires_grad_()
    weight = weight.detach().requires_grad_()
    loss = function(hidden, weight, targets, **kwargs)
    loss.backward()
    return loss.detach(), hidden.grad, weight.grad


def llama_1b_head(rows: int, dtype=torch.float32):
    """hidden (N, 2048), weight (32000, 2048) with O(1-3) logits, targets with 20% ignored."""
    hidden_size, vocab = 2048, 32000
    hidden = torch.randn(rows, hidden_size, device="cuda").to(dtype)
    weight = (torch.randn(vocab, hidden_size, device="cuda") * 2 / hidden_size**0.5).to(dtype)
    targets = torch.randint(0, vocab, (rows,), device="cuda")
    targets[torch.rand(rows, device="cuda") < 0.2] = IGNORE
    return hidden, weight, targets


def test_linear_cross_entropy_at_llama_1b_shape_under_bf16_autocast():
    torch.manual_seed(0)
    hidden, weight, targets = llama_1b_head(8192)  # fp32 hidden and master weight
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ours = loss_and_grads(linear_cross_entropy, hidden, weight, targets)
        baseline = loss_and_grads(linear_cross_entropy_reference, hidden, weight, targets)
    exact = loss_and_grads(
        linear_cross_entropy_reference, hidden.double(), weight.double(), targets
    )
    for name, a, b, e in zip(
        ("loss", "grad_hidden", "grad_weight"), ours, baseline, exact, strict=True
    ):
        assert_error_within(a, b, e, name=name)


def test_linear_cross_entropy_bf16_inputs_and_fp32_compute_against_the_plain_path(monkeypatch):
    torch.manual_seed(0)
    hidden, weight, targets = llama_1b_head(2048, torch.bfloat16)
    ours = loss_and_grads(linear_cross_entropy, hidden, weight, targets, chunk_size=500)
    exact = loss_and_grads(
        linear_cross_entropy_reference, hidden.double(), weight.double(), targets
    )
    baseline = loss_and_grads(linear_cross_entropy_reference, hidden, weight, targets)
    for name, a, b, e in zip(
        ("loss", "grad_hidden", "grad_weight"), ours, baseline, exact, strict=True
    ):
        assert_error_within(a, b, e, name=name)

    # fp32 compute: the kernel's fast exp must keep the error near the plain path's.
    hidden32, weight32 = hidden.float(), weight.float()
    ours = loss_and_grads(linear_cross_entropy, hidden32, weight32, targets, chunk_size=500)
    monkeypatch.setattr(cross_entropy_module, "_use_triton", lambda device: False)
    plain = loss_and_grads(linear_cross_entropy, hidden32, weight32, targets, chunk_size=500)
    for name, a, b, e in zip(
        ("loss", "grad_hidden", "grad_weight"), ours, plain, exact, strict=True
    ):
        assert_error_within(a, b, e, name=name)


def test_linear_cross_entropy_is_deterministic():
    torch.manual_seed(0)
    hidden, weight, targets = llama_1b_head(4096, torch.bfloat16)
    first = loss_and_grads(linear_cross_entropy, hidden, weight.float(), targets, chunk_size=1000)
    second = loss_and_grads(linear_cross_entropy, hidden, weight.float(), targets, chunk_size=1000)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
