import re

import pytest
import torch

from memfit.ops.rms_norm import rms_norm
from tests.reference import assert_error_within, rms_norm_reference, saved_tensor_bytes

EPS = 1e-6


@pytest.mark.parametrize("rows", [1, 17, 97])
@pytest.mark.parametrize("hidden", [8, 48, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weight_is_fp32", [True, False])
def test_matches_fp64_reference(rows: int, hidden: int, dtype: torch.dtype, weight_is_fp32: bool):
    torch.manual_seed(0)
    weight_dtype = torch.float32 if weight_is_fp32 else dtype
    x = (torch.randn(rows, hidden, dtype=torch.float64) * 3 + 0.5).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, dtype=torch.float64)).to(weight_dtype)
    grad_out = torch.randn(rows, hidden, dtype=torch.float64).to(dtype)

    def run(function, x, weight, grad_out):
        x = x.detach().requires_grad_()
        weight = weight.detach().requires_grad_()
        y = function(x, weight, EPS)
        y.backward(grad_out.to(y.dtype))
        return y, x.grad, weight.grad

    y, grad_x, grad_weight = run(rms_norm, x, weight, grad_out)
    base_y, base_grad_x, base_grad_weight = run(rms_norm_reference, x, weight, grad_out)
    exact = run(rms_norm_reference, x.double(), weight.double(), grad_out.double())

    assert y.dtype == dtype and grad_x.dtype == dtype and grad_weight.dtype == weight_dtype
    assert_error_within(y, base_y, exact[0], name="y")
    assert_error_within(grad_x, base_grad_x, exact[1], name="grad_x")
    assert_error_within(grad_weight, base_grad_weight, exact[2], name="grad_weight")


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saves_only_x_and_rstd(dtype: torch.dtype):
    torch.manual_seed(0)
    rows, hidden = 33, 64
    x = torch.randn(rows, hidden, dtype=dtype, requires_grad=True)
    weight = torch.nn.Parameter(torch.ones(hidden))
    _, ours = saved_tensor_bytes(rms_norm, x, weight, EPS, exclude=(weight,))
    _, eager = saved_tensor_bytes(rms_norm_reference, x, weight, EPS, exclude=(weight,))
    x_bytes, rstd_bytes = x.numel() * x.element_size(), rows * 4
    assert ours == x_bytes + rstd_bytes
    assert eager >= ours + x_bytes  # eager autograd keeps at least one more tensor of x's size


def test_same_result_under_autocast():
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
