import pytest
import torch

from memfit.ops.swiglu import swiglu
from tests.reference import assert_error_within, saved_tensor_bytes, swiglu_reference


@pytest.mark.parametrize("rows", [1, 17, 97])
@pytest.mark.parametrize("width", [8, 48, 130])  # 2 * ffn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_fp64_reference(rows: int, width: int, dtype: torch.dtype):
    torch.manual_seed(0)
    gate_up = (torch.randn(rows, width, dtype=torch.float64) * 3).to(dtype)
    grad_out = torch.randn(rows, width // 2, dtype=torch.float64).to(dtype)

    def run(function, gate_up, grad_out):
        gate_up = gate_up.detach().requires_grad_()
        out = function(gate_up)
        out.backward(grad_out)
        return out, gate_up.grad

    out, grad = run(swiglu, gate_up, grad_out)
    base_out, base_grad = run(swiglu_reference, gate_up, grad_out)
    exact_out, exact_grad = run(swiglu_reference, gate_up.double(), grad_out.double())

    assert out.dtype == dtype and grad.dtype == dtype
    assert out.shape == (rows, width // 2) and grad.shape == gate_up.shape
    assert_error_within(out, base_out, exact_out, name="out")
    assert_error_within(grad, base_grad, exact_grad, name="grad_gate_up")


def test_leading_dims_and_gradcheck_in_fp64():
    torch.manual_seed(0)
    gate_up = torch.randn(2, 3, 10, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(swiglu, (gate_up,), fast_mode=True)
    torch.testing.assert_close(swiglu(gate_up), swiglu_reference(gate_up), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saves_only_its_input(dtype: torch.dtype):
    torch.manual_seed(0)
    gate_up = torch.randn(33, 2 * 40, dtype=dtype, requires_grad=True)
    _, ours = saved_tensor_bytes(swiglu, gate_up)
    _, eager = saved_tensor_bytes(swiglu_reference, gate_up)
    gate_up_bytes = gate_up.numel() * gate_up.element_size()
    assert ours == gate_up_bytes
    assert eager > ours


def test_non_contiguous_input():
    torch.manual_seed(0)
    # gate_up as the last two thirds of a wider fused projection output: a strided view.
    fused = torch.randn(5, 7, 3 * 24, dtype=torch.bfloat16, requires_grad=True)
    gate_up = fused[..., 24:]  # (5, 7, 48)
    assert not gate_up.is_contiguous()
    out = swiglu(gate_up)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)

    contiguous = gate_up.detach().contiguous().requires_grad_()
    expected = swiglu(contiguous)
    expected.backward(grad_out)
    assert torch.equal(out, expected)
    assert torch.equal(fused.grad[..., 24:], contiguous.grad)
    assert torch.count_nonzero(fused.grad[..., :24]) == 0


def test_autocast_keeps_the_input_dtype():
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
