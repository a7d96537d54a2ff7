"""The batch-1 matrix-vector kernel (memfit.ops.gemv) against an fp64 reference, within 2x the
error of torch's own F.linear in the same precision, on odd shapes, with and without bias: on
CPU under Triton's interpreter and, where there is one, compiled on the GPU at llama shapes. And
memfit.functional.linear's choice: the kernel for one row without gradient, F.linear otherwise."""

import contextlib

import pytest
import torch
import torch.nn.functional as F

import memfit.functional as MF
import memfit.ops.gemv as gemv_module
from memfit.ops._triton import interpreter_enabled, triton_on_cpu
from memfit.ops.gemv import gemv
from tests.reference import assert_error_within

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(37, 50), (1000, 130), (5, 256), (129, 96)]
if DEVICE == "cuda":
    SHAPES += [(3072, 2048), (2048, 8192), (128256, 2048), (14337, 4095)]


@pytest.fixture(autouse=True)
def _kernels():
    if DEVICE == "cpu" and not interpreter_enabled():
        pytest.skip("the kernel on CPU needs TRITON_INTERPRET=1")
    with triton_on_cpu() if DEVICE == "cpu" else contextlib.nullcontext():
        yield


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_matches_fp64_within_twice_torch_error(n, k, bias, dtype):
    generator = torch.Generator().manual_seed(n * k)
    x = torch.randn(1, 1, k, generator=generator).to(DEVICE, dtype)
    weight = (torch.randn(n, k, generator=generator) / k**0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=generator).to(DEVICE, dtype) if bias else None
    got = gemv(x, weight, b)
    exact = F.linear(x.double(), weight.double(), b.double() if bias else None)
    assert got.shape == (1, 1, n) and got.dtype == dtype
    assert_error_within(got, F.linear(x, weight, b), exact, name="gemv")


def test_linear_takes_the_kernel_for_one_row_without_gradient(monkeypatch):
    calls = []
    monkeypatch.setattr(MF, "gemv", lambda *a, **kw: calls.append(1) or gemv(*a, **kw))
    weight = torch.randn(24, 40, device=DEVICE)
    with torch.no_grad():
        MF.linear(torch.randn(1, 1, 40, device=DEVICE), weight)
        MF.linear(torch.randn(2, 40, device=DEVICE), weight)  # two rows: F.linear
        MF.linear(torch.randn(1, 40, device=DEVICE).bfloat16(), weight.bfloat16())
    assert len(calls) == 2
    x = torch.randn(1, 40, device=DEVICE, requires_grad=True)
    MF.linear(x, weight).sum().backward()  # a gradient: F.linear, differentiable
    assert len(calls) == 2 and x.grad is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_swiglu_and_residual_match_the_separate_ops(n, k, bias, dtype):
    """residual + swiglu(gate_up(x)) in one kernel: the error against fp64 within 2x that of
    the separate ops in the same precision (in both, the product's halves round to the dtype,
    then the activation, then the add)."""
    generator = torch.Generator().manual_seed(n + k)
    x = torch.randn(1, 1, k, generator=generator).to(DEVICE, dtype)
    weight = (torch.randn(2 * n, k, generator=generator) / k**0.5).to(DEVICE, dtype)
    b = torch.randn(2 * n, generator=generator).to(DEVICE, dtype) if bias else None
    residual = torch.randn(1, 1, n, generator=generator).to(DEVICE, dtype)
    got = gemv(x, weight, b, swiglu=True, residual=residual)
    gate_up = F.linear(x.double(), weight.double(), b.double() if bias else None)
    exact = residual.double() + F.silu(gate_up[..., :n]) * gate_up[..., n:]
    expected = residual + MF.swiglu(F.linear(x, weight, b))
    assert got.shape == (1, 1, n) and got.dtype == dtype
    # four roundings in a row (gate, up, the activation, the add): a different order of the sums
    # may flip one of them, so one rounding of the dtype is allowed on top of the 2x
    floor = torch.finfo(dtype).eps if dtype != torch.float32 else 1e-6
    assert_error_within(got, expected, exact, name="gemv swiglu+residual", floor=floor)
    # through memfit.functional.linear: the kernel at one row, the separate ops at two
    with torch.no_grad():
        assert torch.equal(MF.linear(x, weight, b, swiglu=True, residual=residual), got)
        two = MF.linear(x.expand(2, 1, -1), weight, b, swiglu=True, residual=residual)
    assert two.shape == (2, 1, n)
    assert_error_within(two[1:], expected, exact, name="linear swiglu+residual", floor=floor)


def test_rejects_what_it_cannot_take():
    with pytest.raises(ValueError, match="one row of 8"):
        gemv(torch.ones(2, 8), torch.ones(4, 8))
    with pytest.raises(ValueError, match="unit stride"):
        gemv(torch.ones(8), torch.ones(8, 4).T)
    with pytest.raises(ValueError, match="even number of rows"):
        gemv(torch.ones(8), torch.ones(5, 8), swiglu=True)
    with pytest.raises(ValueError, match="residual must hold 2"):
        gemv(torch.ones(8), torch.ones(4, 8), swiglu=True, residual=torch.ones(4))
    assert gemv_module.BLOCK_N == 4
