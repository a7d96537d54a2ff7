import math

import pytest
import torch

import memfit.ops.rotary as rotary_module
from memfit.ops.rotary import apply_rotary, apply_rotary_qk, rotary_cos_sin
from tests.ops.paths import import_without_triton, kernels_on_cpu, on_path
from tests.reference import assert_error_within, rotary_reference, saved_tensor_bytes

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.fixture(params=["torch", "triton"])
def path(request, monkeypatch):
    yield from on_path(request, monkeypatch, rotary_module, "_launch_rotary")


def fused_qkv(batch, seq, q_heads, kv_heads, head_dim, dtype):
    """A (batch, seq, (q_heads + 2 kv_heads) * head_dim) leaf and its q and k views."""
    qkv = torch.randn(batch, seq, (q_heads + 2 * kv_heads) * head_dim, dtype=torch.float64)
    qkv = qkv.to(dtype).requires_grad_()
    q, k, _ = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = q.view(batch, seq, q_heads, head_dim)  # (B, T, nh, hs), non-contiguous
    k = k.view(batch, seq, kv_heads, head_dim)  # (B, T, nkv, hs)
    return qkv, q, k


# (batch, seq, heads, head_dim): 1, 7 and 33 tokens; head_dim 130 has a half of 65 (masked).
SHAPES = [(1, 1, 1, 8), (1, 7, 3, 24), (3, 11, 1, 64), (2, 17, 3, 48), (1, 33, 2, 130)]


@pytest.mark.parametrize(("batch", "seq", "heads", "head_dim"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("per_row_positions", [False, True])
def test_matches_fp64_reference(path, batch, seq, heads, head_dim, dtype, per_row_positions):
    torch.manual_seed(0)
    if per_row_positions:  # e.g. packed sequences: each row has its own positions
        positions = torch.randint(0, 4096, (batch, seq))
    else:
        positions = seq
    cos, sin = rotary_cos_sin(positions, head_dim, theta=10000.0)
    x = torch.randn(batch, seq, heads, head_dim, dtype=torch.float64).to(dtype)
    grad_out = torch.randn(batch, seq, heads, head_dim, dtype=torch.float64).to(dtype)

    def run(function, x, cos, sin, grad_out):
        x = x.detach().requires_grad_()
        out = function(x, cos, sin)
        out.backward(grad_out)
        return out, x.grad

    out, grad = run(apply_rotary, x, cos, sin, grad_out)
    base_out, base_grad = run(rotary_reference, x, cos, sin, grad_out)
    exact_out, exact_grad = run(
        rotary_reference, x.double(), cos.double(), sin.double(), grad_out.double()
    )

    assert out.dtype == dtype and grad.dtype == dtype
    assert_error_within(out, base_out, exact_out, name="out")
    assert_error_within(grad, base_grad, exact_grad, name="grad_x")


@pytest.mark.parametrize("table_shape", [(5, 8), (2, 5, 8)])
def test_gradcheck_in_fp64_with_arbitrary_tables(path, table_shape):
    torch.manual_seed(0)
    # Tables whose halves differ: the backward must be the exact transpose, not just -angle.
    x = torch.randn(2, 5, 3, 8, dtype=torch.float64, requires_grad=True)
    cos = torch.randn(table_shape, dtype=torch.float64)
    sin = torch.randn(table_shape, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda x: apply_rotary(x, cos, sin), (x,), fast_mode=True)
    torch.testing.assert_close(apply_rotary(x, cos, sin), rotary_reference(x, cos, sin))


@pytest.mark.parametrize("per_row_positions", [False, True])
def test_non_contiguous_view_of_fused_qkv(path, per_row_positions):
    torch.manual_seed(0)
    batch, seq, heads, head_dim = 2, 13, 4, 16
    qkv = torch.randn(batch, seq, 3 * heads * head_dim, dtype=torch.bfloat16, requires_grad=True)
    k = qkv.view(batch, seq, 3, heads, head_dim)[:, :, 1]  # (batch, seq, heads, head_dim)
    assert not k.is_contiguous()
    positions = torch.randint(0, 4096, (batch, seq)) if per_row_positions else seq
    cos, sin = rotary_cos_sin(positions, head_dim, theta=500000.0)
    out = apply_rotary(k, cos, sin)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)

    k_contiguous = k.detach().contiguous().requires_grad_()
    expected = apply_rotary(k_contiguous, cos, sin)
    expected.backward(grad_out)
    assert torch.equal(out, expected)
    grad_qkv = qkv.grad.view(batch, seq, 3, heads, head_dim)
    assert torch.equal(grad_qkv[:, :, 1], k_contiguous.grad)
    assert (
        torch.count_nonzero(grad_qkv[:, :, 0]) == 0 and torch.count_nonzero(grad_qkv[:, :, 2]) == 0
    )


def test_saves_only_cos_and_sin(path):
    torch.manual_seed(0)
    x = torch.randn(2, 31, 4, 32, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = rotary_cos_sin(31, 32, theta=10000.0)
    _, ours = saved_tensor_bytes(apply_rotary, x, cos, sin)
    # The fp32 tables themselves (views of the inputs: no new memory), nothing of x's size.
    assert ours == 2 * cos.numel() * cos.element_size()
    assert ours < x.numel() * x.element_size()
    _, pair = saved_tensor_bytes(apply_rotary_qk, x, x.detach().requires_grad_(), cos, sin)
    assert pair == ours


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_matches_the_plain_path_bit_for_bit(monkeypatch, dtype):
    """Same fp32 products and sums (no FMA), one rounding to dtype: equal results."""
    torch.manual_seed(0)
    qkv, q, k = fused_qkv(3, 11, 3, 1, 24, dtype)
    cos, sin = rotary_cos_sin(torch.randint(0, 4096, (3, 11)), 24, theta=10000.0)
    grad_q, grad_k = torch.randn(q.shape).to(dtype), torch.randn(k.shape).to(dtype)
    results = {}
    for interpret in ("0", "1"):
        kernels_on_cpu(monkeypatch, interpret == "1")
        q_out, k_out = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        (grad_qkv,) = torch.autograd.grad((q_out, k_out), qkv, (grad_q, grad_k))
        results[interpret] = (q_out, k_out, grad_qkv)
    assert all(torch.equal(a, b) for a, b in zip(results["0"], results["1"], strict=True))


@pytest.mark.parametrize(("q_heads", "kv_heads", "head_dim"), [(3, 1, 24), (2, 2, 8), (4, 2, 130)])
def test_apply_rotary_qk_equals_two_apply_rotary_calls(path, q_heads, kv_heads, head_dim):
    torch.manual_seed(0)
    batch, seq = 2, 7
    qkv, q, k = fused_qkv(batch, seq, q_heads, kv_heads, head_dim, torch.bfloat16)
    cos, sin = rotary_cos_sin(torch.randint(0, 4096, (batch, seq)), head_dim, theta=10000.0)
    grad_q, grad_k = torch.randn(q.shape).bfloat16(), torch.randn(k.shape).bfloat16()

    q_out, k_out = apply_rotary_qk(q, k, cos, sin)
    (grad_pair,) = torch.autograd.grad((q_out, k_out), qkv, (grad_q, grad_k))
    q_single, k_single = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    (grad_single,) = torch.autograd.grad((q_single, k_single), qkv, (grad_q, grad_k))
    assert q_out.is_contiguous() and k_out.is_contiguous()
    assert torch.equal(q_out, q_single) and torch.equal(k_out, k_single)
    assert torch.equal(grad_pair, grad_single)
    # Only the q and k columns of qkv receive gradient.
    assert torch.count_nonzero(grad_pair[..., (q_heads + kv_heads) * head_dim :]) == 0


def test_plain_path_while_torch_compile_traces(monkeypatch):
    """Under torch.compile the plain path is traced, for Inductor to fuse with its neighbours."""
    kernels_on_cpu(monkeypatch)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(rotary_module, "_launch_rotary", None)  # calling it would raise
    x = torch.randn(1, 3, 2, 8, requires_grad=True)
    cos, sin = rotary_cos_sin(3, 8, theta=10000.0)
    apply_rotary(x, cos, sin).sum().backward()
    apply_rotary_qk(x, x, cos, sin)


def test_works_without_triton(monkeypatch):
    """Where triton is missing, the module imports and serves every call on the plain path."""
    module = import_without_triton(monkeypatch, rotary_module, "rotary_without_triton")
    kernels_on_cpu(monkeypatch)
    assert not module.HAS_TRITON
    x = torch.randn(2, 3, 2, 8, requires_grad=True)
    cos, sin = rotary_cos_sin(3, 8, theta=10000.0)
    out = module.apply_rotary(x, cos, sin)
    out.sum().backward()
    assert torch.equal(out, rotary_reference(x, cos, sin))


def test_same_result_under_autocast(path):
    torch.manual_seed(0)
    x = torch.randn(2, 9, 3, 16, requires_grad=True)
    cos, sin = rotary_cos_sin(9, 16, theta=10000.0)
    grad_out = torch.randn(2, 9, 3, 16)
    out = apply_rotary(x, cos, sin)
    (grad,) = torch.autograd.grad(out, x, grad_out)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_autocast = apply_rotary(x, cos, sin)
        (grad_autocast,) = torch.autograd.grad(out_autocast, x, grad_out)
    assert out_autocast.dtype == torch.float32
    assert torch.equal(out, out_autocast) and torch.equal(grad, grad_autocast)


def test_rotation_preserves_norms_and_relative_positions(path):
    torch.manual_seed(0)
    head_dim = 64
    cos, sin = rotary_cos_sin(40, head_dim, theta=10000.0)
    q = torch.randn(1, 1, 1, head_dim, dtype=torch.float64).expand(1, 40, 1, head_dim)
    k = torch.randn(1, 1, 1, head_dim, dtype=torch.float64).expand(1, 40, 1, head_dim)
    q_rotated = apply_rotary(q, cos.double(), sin.double())[0, :, 0]  # (40, head_dim)
    k_rotated = apply_rotary(k, cos.double(), sin.double())[0, :, 0]
    torch.testing.assert_close(q_rotated.norm(dim=-1), q[0, :, 0].norm(dim=-1))
    # <q_m, k_n> depends on m - n only (RoFormer eq. 16): compare pairs with m - n = 3.
    scores = q_rotated @ k_rotated.T
    torch.testing.assert_close(scores[3, 0], scores[30, 27], rtol=1e-5, atol=1e-5)


def test_cos_sin_tables():
    cos, sin = rotary_cos_sin(5, 8, theta=10000.0)
    assert cos.shape == sin.shape == (5, 8) and cos.dtype == torch.float32
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    angles = torch.arange(5, dtype=torch.float64)[:, None] * inv_freq
    torch.testing.assert_close(cos, torch.cat((angles, angles), -1).cos().float())
    torch.testing.assert_close(sin, torch.cat((angles, angles), -1).sin().float())

    cos_rows, _ = rotary_cos_sin(torch.tensor([[4, 0, 2], [1, 3, 4]]), 8, theta=10000.0)
    assert cos_rows.shape == (2, 3, 8)
    assert torch.equal(cos_rows[1, 2], cos[4]) and torch.equal(cos_rows[0, 1], cos[0])

    default, _ = rotary_cos_sin(5, 8, theta=10000.0, scaling={"rope_type": "default"})
    assert torch.equal(default, cos)


def test_llama3_scaling_keeps_high_and_divides_low_frequencies():
    head_dim, theta = 128, 500000.0
    positions = torch.tensor([1])
    _, sin_plain = rotary_cos_sin(positions, head_dim, theta)
    _, sin_scaled = rotary_cos_sin(positions, head_dim, theta, scaling=LLAMA3_SCALING)
    # At position 1 the angle is inv_freq itself; sin(angle) ~ angle for the small ones.
    inv_plain, inv_scaled = sin_plain[0, : head_dim // 2], sin_scaled[0, : head_dim // 2]
    assert torch.equal(inv_plain[0], inv_scaled[0])  # highest frequency: unchanged
    assert math.isclose(inv_scaled[-1].item(), inv_plain[-1].item() / 8.0, rel_tol=1e-4)
    assert torch.all(inv_scaled <= inv_plain)


@pytest.mark.parametrize("scaling", [None, LLAMA3_SCALING])
def test_tables_and_rotation_match_hugging_face_bit_for_bit(scaling):
    modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=256,
        num_attention_heads=2,
        rope_theta=500000.0,
        rope_scaling=scaling,
        max_position_embeddings=131072,
    )
    hf_rotary = modeling_llama.LlamaRotaryEmbedding(config)
    positions = torch.arange(0, 20000, 7)[None]  # (1, seq)
    hf_cos, hf_sin = hf_rotary(torch.zeros(1), positions)  # fp32 (1, seq, 128)
    cos, sin = rotary_cos_sin(positions, 128, 500000.0, scaling)
    assert torch.equal(cos, hf_cos) and torch.equal(sin, hf_sin)

    q = torch.randn(1, positions.shape[1], 2, 128)  # (batch, seq, heads, head_dim)
    hf_q, _ = modeling_llama.apply_rotary_pos_emb(q, q, hf_cos, hf_sin, unsqueeze_dim=2)
    assert torch.equal(apply_rotary(q, cos, sin), hf_q)


@pytest.mark.parametrize(
    ("x", "cos_shape", "message"),
    [
        (torch.randn(2, 5, 8), (5, 8), r"x.shape=\(2, 5, 8\)"),
        (torch.randn(2, 5, 3, 7), (5, 7), r"even head_dim, got x.shape=\(2, 5, 3, 7\)"),
        (torch.randn(2, 5, 3, 8), (6, 8), r"cos.shape=\(6, 8\)"),
        (torch.randn(2, 5, 3, 8), (3, 5, 8), r"cos.shape=\(3, 5, 8\)"),
        (torch.ones(2, 5, 3, 8, dtype=torch.int64), (5, 8), "x.dtype=torch.int64"),
    ],
)
def test_apply_rotary_bad_inputs_raise_value_error(x, cos_shape, message):
    with pytest.raises(ValueError, match=message):
        apply_rotary(x, torch.ones(cos_shape), torch.zeros(cos_shape))


@pytest.mark.parametrize(
    ("q_shape", "k_shape", "k_dtype", "message"),
    [
        ((2, 5, 3, 8), (2, 4, 1, 8), torch.float32, r"k.shape=\(2, 4, 1, 8\)"),
        ((2, 5, 3, 8), (2, 5, 1, 16), torch.float32, r"k.shape=\(2, 5, 1, 16\)"),
        ((2, 5, 3, 8), (2, 5, 1, 8), torch.bfloat16, "k.dtype=torch.bfloat16"),
    ],
)
def test_apply_rotary_qk_bad_inputs_raise_value_error(q_shape, k_shape, k_dtype, message):
    q, k = torch.randn(q_shape), torch.randn(k_shape, dtype=k_dtype)
    with pytest.raises(ValueError, match=message):
        apply_rotary_qk(q, k, torch.ones(5, 8), torch.zeros(5, 8))


def test_apply_rotary_rejects_tables_that_require_grad():
    cos = torch.ones(5, 8, requires_grad=True)
    with pytest.raises(ValueError, match="not differentiable in cos and sin"):
        apply_rotary(torch.randn(2, 5, 3, 8), cos, torch.zeros(5, 8))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"positions": 4, "head_dim": 7, "theta": 1e4}, "even head_dim, got head_dim=7"),
        ({"positions": -1, "head_dim": 8, "theta": 1e4}, "got -1"),
        ({"positions": 4, "head_dim": 8, "theta": 0.0}, "theta=0.0"),
        ({"positions": torch.zeros(3), "head_dim": 8, "theta": 1e4}, "dtype=torch.float32"),
        (
            {"positions": 4, "head_dim": 8, "theta": 1e4, "scaling": {"rope_type": "yarn"}},
            "rope_type='yarn'",
        ),
        (
            {"positions": 4, "head_dim": 8, "theta": 1e4, "scaling": {"rope_type": "llama3"}},
            "missing",
        ),
    ],
)
def test_rotary_cos_sin_bad_inputs_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        rotary_cos_sin(**kwargs)
