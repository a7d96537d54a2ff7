"""SwiGLU on both paths: plain PyTorch, and the Triton kernels run by Triton's interpreter.

The Triton path runs on CPU inside `triton_on_cpu()`, under the interpreter that
tests/conftest.py switches on. Triton's interpreter rounds fp32 -> bf16 toward zero where the GPU rounds to
nearest even, so under it bf16 outputs can be 1 ulp off instead of 0.5; the fp64 comparisons
allow for that extra half ulp there (`floor_for`). The GPU tests hold the compiled kernels to
the plain rule.
"""

import contextlib

import pytest
import torch

import memfit.ops._triton
import memfit.ops.swiglu as swiglu_module
from memfit.ops._triton import interpreter_enabled, triton_on_cpu
from memfit.ops.swiglu import swiglu, swiglu_backward, swiglu_forward
from tests.ops.paths import floor_for, on_path
from tests.reference import assert_error_within, saved_tensor_bytes, swiglu_reference


@pytest.fixture(params=["pytorch", "triton"])
def path(request, monkeypatch):
    yield from on_path(request, monkeypatch, swiglu_module, "launch")


def run_forward_backward(function, gate_up, grad_out):
    gate_up = gate_up.detach().requires_grad_()
    out = function(gate_up)
    out.backward(grad_out)
    return out, gate_up.grad


@pytest.mark.parametrize("rows", [1, 7, 33])
@pytest.mark.parametrize("ffn", [5, 17, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_fp64_reference(path: str, rows: int, ffn: int, dtype: torch.dtype):
    torch.manual_seed(0)
    gate_up = (torch.randn(rows, 2 * ffn, dtype=torch.float64) * 3).to(dtype)
    grad_out = torch.randn(rows, ffn, dtype=torch.float64).to(dtype)

    out, grad = run_forward_backward(swiglu, gate_up, grad_out)
    base_out, base_grad = run_forward_backward(swiglu_reference, gate_up, grad_out)
    exact_out, exact_grad = run_forward_backward(
        swiglu_reference, gate_up.double(), grad_out.double()
    )

    assert out.dtype == dtype and grad.dtype == dtype
    assert out.shape == (rows, ffn) and grad.shape == gate_up.shape
    floor = floor_for(path, dtype)
    assert_error_within(out, base_out, exact_out, name="out", floor=floor)
    assert_error_within(grad, base_grad, exact_grad, name="grad_gate_up", floor=floor)


def test_leading_dims_and_gradcheck_in_fp64():
    torch.manual_seed(0)
    gate_up = torch.randn(2, 3, 10, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(swiglu, (gate_up,), fast_mode=True)
    torch.testing.assert_close(swiglu(gate_up), swiglu_reference(gate_up), rtol=1e-12, atol=1e-12)


def test_leading_dims(path: str):
    torch.manual_seed(0)
    gate_up = torch.randn(2, 3, 34, requires_grad=True)
    out = swiglu(gate_up)
    assert out.shape == (2, 3, 17)
    out.backward(torch.ones_like(out))
    exact = gate_up.detach().double().requires_grad_()
    swiglu_reference(exact).backward(torch.ones_like(out, dtype=torch.float64))
    torch.testing.assert_close(out, swiglu_reference(exact).float().detach())
    torch.testing.assert_close(gate_up.grad, exact.grad.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saves_only_its_input(path: str, dtype: torch.dtype):
    torch.manual_seed(0)
    gate_up = torch.randn(33, 2 * 40, dtype=dtype, requires_grad=True)
    _, ours = saved_tensor_bytes(swiglu, gate_up)
    _, eager = saved_tensor_bytes(swiglu_reference, gate_up)
    gate_up_bytes = gate_up.numel() * gate_up.element_size()
    assert ours == gate_up_bytes
    assert eager > ours


@pytest.mark.parametrize(
    "make_view",
    [
        lambda fused: fused[..., 24:],  # a slice of a wider projection: rows strided by 72
        lambda fused: fused[..., 24:].transpose(0, 1),  # leading dims that cannot merge: copied
    ],
    ids=["row-stride", "transposed"],
)
def test_non_contiguous_input(path: str, make_view):
    torch.manual_seed(0)
    # gate_up as the last two thirds of a wider fused projection output: a strided view.
    fused = torch.randn(3, 5, 3 * 24, dtype=torch.bfloat16, requires_grad=True)
    gate_up = make_view(fused)  # (3, 5, 48) or (5, 3, 48)
    assert not gate_up.is_contiguous()
    out = swiglu(gate_up)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)

    contiguous = gate_up.detach().contiguous().requires_grad_()
    expected = swiglu(contiguous)
    expected.backward(grad_out)
    assert torch.equal(out, expected)
    (expected_grad,) = torch.autograd.grad(make_view(fused), fused, contiguous.grad)
    assert torch.equal(fused.grad, expected_grad)
    assert torch.count_nonzero(fused.grad[..., :24]) == 0


def test_non_contiguous_grad_out(path: str):
    torch.manual_seed(0)
    gate_up = torch.randn(6, 40, requires_grad=True)
    grad_out = torch.randn(20, 6).t()  # (6, 20), columns strided
    (grad,) = torch.autograd.grad(swiglu(gate_up), gate_up, grad_out)
    (expected,) = torch.autograd.grad(swiglu(gate_up), gate_up, grad_out.contiguous())
    assert torch.equal(grad, expected)


def test_two_runs_are_bitwise_equal(path: str):
    torch.manual_seed(0)
    gate_up = torch.randn(7, 2 * 200, dtype=torch.bfloat16)
    grad_out = torch.randn(7, 200, dtype=torch.bfloat16)
    first = run_forward_backward(swiglu, gate_up, grad_out)
    second = run_forward_backward(swiglu, gate_up, grad_out)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_autocast_keeps_the_input_dtype(path: str):
    torch.manual_seed(0)
    gate_up = torch.randn(17, 48, dtype=torch.bfloat16, requires_grad=True)
    grad_out = torch.randn(17, 24, dtype=torch.bfloat16)
    out = swiglu(gate_up)
    (grad,) = torch.autograd.grad(out, gate_up, grad_out)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_autocast = swiglu(gate_up)
        (grad_autocast,) = torch.autograd.grad(out_autocast, gate_up, grad_out)
    assert out_autocast.dtype == torch.bfloat16
    assert torch.equal(out, out_autocast) and torch.equal(grad, grad_autocast)


@pytest.mark.parametrize("reason", ["compiling", "fp64", "no-triton", "cpu-not-requested"])
def test_falls_back_to_pytorch(monkeypatch, reason: str):
    pytest.importorskip("triton")
    if not interpreter_enabled():
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1 at startup (tests/conftest.py)")
    launched = []
    monkeypatch.setattr(swiglu_module, "launch", lambda *a, **k: launched.append(a))
    dtype = torch.float64 if reason == "fp64" else torch.float32
    if reason == "compiling":
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    elif reason == "no-triton":
        monkeypatch.setattr(memfit.ops._triton, "HAS_TRITON", False)
    context = contextlib.nullcontext() if reason == "cpu-not-requested" else triton_on_cpu()
    gate_up = torch.randn(3, 34, dtype=dtype, requires_grad=True)
    with context:
        out = swiglu(gate_up)
        out.backward(torch.ones_like(out))
    assert launched == []
    torch.testing.assert_close(out, swiglu_reference(gate_up))


def test_launchers_reject_what_they_cannot_take():
    gate_up = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"stride=\(1, 8\)"):
        swiglu_forward(gate_up.t())
    with pytest.raises(ValueError, match="dtype=torch.float64"):
        swiglu_forward(gate_up.double())
    with pytest.raises(ValueError, match=r"expects grad_out of shape \(4, 4\)"):
        swiglu_backward(torch.randn(4, 8), gate_up)


@pytest.mark.parametrize(
    ("gate_up", "message"),
    [
        (torch.randn(4, 7), r"shape=\(4, 7\)"),
        (torch.randn(()), r"shape=\(\)"),
        (torch.ones(4, 8, dtype=torch.int32), "dtype=torch.int32"),
    ],
)
def test_bad_inputs_raise_value_error(gate_up, message):
    with pytest.raises(ValueError, match=message):
        swiglu(gate_up)
