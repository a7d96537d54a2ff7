"""RMSNorm on both paths: plain PyTorch, and the Triton kernels run by Triton's interpreter.

The Triton path runs on CPU inside `triton_on_cpu()`, under the interpreter that
tests/conftest.py switches on. Triton's interpreter rounds fp32 -> bf16 toward zero where the GPU rounds to
nearest even, so under it bf16 outputs can be 1 ulp off instead of 0.5; the fp64 comparisons
allow for that extra half ulp there (`floor_for`). The GPU tests hold the compiled kernels to
the plain rule.
"""

import contextlib
import re

import pytest
import torch

import memfit.ops._triton
import memfit.ops.rms_norm as rms_norm_module
from memfit.ops._triton import interpreter_enabled, triton_on_cpu
from memfit.ops.rms_norm import add_rms_norm, rms_norm, rms_norm_backward, rms_norm_forward
from tests.ops.paths import floor_for, on_path
from tests.reference import assert_error_within, rms_norm_reference, saved_tensor_bytes

EPS = 1e-6


@pytest.fixture(params=["pytorch", "triton"])
def path(request, monkeypatch):
    yield from on_path(request, monkeypatch, rms_norm_module, "launch")


def run_forward_backward(function, x, weight, grad_out):
    x = x.detach().requires_grad_()
    weight = weight.detach().requires_grad_()
    y = function(x, weight, EPS)
    y.backward(grad_out.to(y.dtype))
    return y, x.grad, weight.grad


# Odd sizes; in the Triton kernels hidden 8..130 packs 32..512 rows in a tile, and (17, 1000)
# runs 5 tiles of 4 rows on 4 persistent backward programs, so one of them loops.
SHAPES = [(rows, hidden) for rows in (1, 7, 33) for hidden in (8, 48, 130)]
SHAPES += [(1, 1000), (7, 1000), (17, 1000)]


@pytest.mark.parametrize(("rows", "hidden"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weight_is_fp32", [True, False])
def test_matches_fp64_reference(
    path: str, rows: int, hidden: int, dtype: torch.dtype, weight_is_fp32: bool
):
    torch.manual_seed(0)
    weight_dtype = torch.float32 if weight_is_fp32 else dtype
    x = (torch.randn(rows, hidden, dtype=torch.float64) * 3 + 0.5).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, dtype=torch.float64)).to(weight_dtype)
    grad_out = torch.randn(rows, hidden, dtype=torch.float64).to(dtype)

    y, grad_x, grad_weight = run_forward_backward(rms_norm, x, weight, grad_out)
    base_y, base_grad_x, base_grad_weight = run_forward_backward(
        rms_norm_reference, x, weight, grad_out
    )
    exact = run_forward_backward(rms_norm_reference, x.double(), weight.double(), grad_out.double())

    assert y.dtype == dtype and grad_x.dtype == dtype and grad_weight.dtype == weight_dtype
    floor = floor_for(path, dtype)
    assert_error_within(y, base_y, exact[0], name="y", floor=floor)
    assert_error_within(grad_x, base_grad_x, exact[1], name="grad_x", floor=floor)
    assert_error_within(grad_weight, base_grad_weight, exact[2], name="grad_weight", floor=floor)


def test_leading_dims_and_gradcheck_in_fp64():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 7, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x, weight: rms_norm(x, weight, EPS), (x, weight), fast_mode=True
    )
    torch.testing.assert_close(
        rms_norm(x, weight, EPS), rms_norm_reference(x, weight, EPS), rtol=1e-12, atol=1e-12
    )


@pytest.mark.parametrize(
    "make_view",
    [
        lambda base: base[:, ::2],  # rows with a stride of 2 * hidden: reshaped as a view
        lambda base: base.transpose(0, 1),  # leading dims that cannot merge: reshape copies
        lambda base: base[..., ::2, :].transpose(-1, -2),  # hidden not contiguous: copied
    ],
    ids=["row-stride", "transposed", "strided-hidden"],
)
def test_non_contiguous_input(path: str, make_view):
    torch.manual_seed(0)
    base = torch.randn(5, 14, 48, dtype=torch.bfloat16, requires_grad=True)
    x = make_view(base)
    assert not x.is_contiguous()
    weight = torch.randn(x.shape[-1], requires_grad=True)
    y = rms_norm(x, weight, EPS)
    grad_out = torch.randn_like(y)
    y.backward(grad_out)

    contiguous = x.detach().contiguous()
    expected_y, expected_grad_x, expected_grad_weight = run_forward_backward(
        rms_norm, contiguous, weight, grad_out
    )
    assert torch.equal(y, expected_y)
    (grad_x,) = torch.autograd.grad(make_view(base), base, expected_grad_x)  # into base's layout
    assert torch.equal(base.grad, grad_x)
    if path == "triton":  # the kernel reduces rows in their logical order, whatever the layout
        assert torch.equal(weight.grad, expected_grad_weight)
    else:  # torch's sum over the rows follows the memory layout
        torch.testing.assert_close(weight.grad, expected_grad_weight)


def test_two_runs_are_bitwise_equal(path: str):
    torch.manual_seed(0)
    # 17 rows of 1000: 5 tiles of 4 rows over 4 persistent programs in the Triton backward.
    x = torch.randn(17, 1000, dtype=torch.bfloat16)
    weight = torch.randn(1000)
    grad_out = torch.randn(17, 1000, dtype=torch.bfloat16)
    first = run_forward_backward(rms_norm, x, weight, grad_out)
    second = run_forward_backward(rms_norm, x, weight, grad_out)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saves_only_x_and_rstd(path: str, dtype: torch.dtype):
    torch.manual_seed(0)
    rows, hidden = 33, 64
    x = torch.randn(rows, hidden, dtype=dtype, requires_grad=True)
    weight = torch.nn.Parameter(torch.ones(hidden))
    _, ours = saved_tensor_bytes(rms_norm, x, weight, EPS, exclude=(weight,))
    _, eager = saved_tensor_bytes(rms_norm_reference, x, weight, EPS, exclude=(weight,))
    x_bytes, rstd_bytes = x.numel() * x.element_size(), rows * 4
    assert ours == x_bytes + rstd_bytes
    assert eager >= ours + x_bytes  # eager autograd keeps at least one more tensor of x's size


def test_same_result_under_autocast(path: str):
    torch.manual_seed(0)
    weight = torch.randn(48, requires_grad=True)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(17, 48, dtype=dtype, requires_grad=True)
        grad_out = torch.randn(17, 48, dtype=dtype)
        y = rms_norm(x, weight, EPS)
        grads = torch.autograd.grad(y, (x, weight), grad_out)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y_autocast = rms_norm(x, weight, EPS)
            grads_autocast = torch.autograd.grad(y_autocast, (x, weight), grad_out)
        assert y_autocast.dtype == dtype
        assert torch.equal(y, y_autocast)
        assert all(torch.equal(a, b) for a, b in zip(grads, grads_autocast, strict=True))


@pytest.mark.parametrize(
    "needs_grad", [(True, False), (False, True)], ids=["x-only", "weight-only"]
)
def test_gradient_for_one_input_only(path: str, needs_grad: tuple[bool, bool]):
    torch.manual_seed(0)
    x = torch.randn(7, 130, requires_grad=needs_grad[0])
    weight = torch.randn(130, requires_grad=needs_grad[1])
    grad_out = torch.randn(7, 130)
    inputs = [t for t in (x, weight) if t.requires_grad]
    grads = torch.autograd.grad(rms_norm(x, weight, EPS), inputs, grad_out)
    exact = torch.autograd.grad(
        rms_norm_reference(x.double(), weight.double(), EPS), inputs, grad_out.double()
    )
    torch.testing.assert_close(grads, tuple(g.float() for g in exact), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "reason", ["compiling", "fp64", "no-triton", "hidden-too-large", "cpu-not-requested"]
)
def test_falls_back_to_pytorch(monkeypatch, reason: str):
    pytest.importorskip("triton")
    if not interpreter_enabled():
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1 at startup (tests/conftest.py)")
    launched = []
    monkeypatch.setattr(rms_norm_module, "launch", lambda *a, **k: launched.append(a))
    dtype = torch.float64 if reason == "fp64" else torch.float32
    if reason == "compiling":
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    elif reason == "no-triton":
        monkeypatch.setattr(memfit.ops._triton, "HAS_TRITON", False)
    elif reason == "hidden-too-large":
        monkeypatch.setattr(rms_norm_module, "MAX_FUSED_HIDDEN", 64)
    context = contextlib.nullcontext() if reason == "cpu-not-requested" else triton_on_cpu()
    x = torch.randn(3, 130, dtype=dtype, requires_grad=True)
    weight = torch.randn(130, dtype=dtype, requires_grad=True)
    with context:
        y = rms_norm(x, weight, EPS)
        y.backward(torch.ones_like(y))
    assert launched == []
    torch.testing.assert_close(y, rms_norm_reference(x, weight, EPS))


def test_launchers_reject_what_they_cannot_take():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=re.escape("stride=(1, 8)")):
        rms_norm_forward(x.t(), torch.randn(4), EPS)
    with pytest.raises(ValueError, match=re.escape("x.dtype=torch.float64")):
        rms_norm_forward(x.double(), torch.randn(8), EPS)
    with pytest.raises(ValueError, match=re.escape("expects weight of shape (8,)")):
        rms_norm_forward(x, torch.randn(7), EPS)
    with pytest.raises(ValueError, match=re.escape("shape=(3,) and dtype=torch.float32")):
        rms_norm_backward(x, x, torch.randn(8), torch.ones(3))


@pytest.mark.parametrize(
    ("x", "weight", "eps", "message"),
    [
        (torch.randn(4, 8), torch.randn(7), EPS, "weight.shape=(7,)"),
        (torch.randn(4, 8), torch.randn(1, 8), EPS, "weight.shape=(1, 8)"),
        (torch.ones(4, 8, dtype=torch.int64), torch.randn(8), EPS, "x.dtype=torch.int64"),
        (torch.randn(4, 8), torch.randn(8), -1.0, "eps=-1.0"),
        (torch.randn(4, 8), torch.randn(8, device="meta"), EPS, "weight on meta"),
    ],
)
def test_bad_inputs_raise_value_error(x, weight, eps, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        rms_norm(x, weight, eps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 2048), (3, 17, 1000), (5, 130)])
def test_add_rms_norm_equals_the_add_then_the_norm(path: str, dtype, shape):
    """Fused under no_grad (the Triton path: one launch), the same values bit for bit as the add
    and then rms_norm; with a gradient needed, the two ops, differentiable."""
    generator = torch.Generator().manual_seed(0)
    x, branch = (torch.randn(shape, generator=generator).to(dtype) for _ in "xb")
    weight = torch.rand(shape[-1], generator=generator) + 0.5
    with torch.no_grad():
        normed, total = add_rms_norm(x, branch, weight, EPS)
    expected_total = x + branch
    torch.testing.assert_close(total, expected_total, rtol=0, atol=0)
    torch.testing.assert_close(normed, rms_norm(expected_total, weight, EPS), rtol=0, atol=0)
    x.requires_grad_()
    normed, total = add_rms_norm(x, branch, weight, EPS)
    (normed.float().sum() + total.float().sum()).backward()
    assert x.grad is not None and x.grad.shape == x.shape


def test_add_rms_norm_rejects_mismatched_inputs():
    with pytest.raises(ValueError, match="one shape and dtype"):
        add_rms_norm(torch.ones(2, 8), torch.ones(2, 8).bfloat16(), torch.ones(8), EPS)
