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
    monkeypatch.setattr(MF, "gemv", lambda *a: calls.append(1) or gemv(*a))
    weight = torch.randn(24, 40, device=DEVICE)
    with torch.no_grad():
        MF.linear(torch.randn(1, 1, 40, device=DEVICE), weight)
        MF.linear(torch.randn(2, 40, device=DEVICE), weight)  # two rows: F.linear
        MF.linear(torch.randn(1, 40, device=DEVICE).bfloat16(), weight.bfloat16())
    assert len(calls) == 2
    x = torch.randn(1, 40, device=DEVICE, requires_grad=True)
    MF.linear(x, weight).sum().backward()  # a gradient: F.linear, differentiable
    assert len(calls) == 2 and x.grad is not None


def test_rejects_what_it_cannot_take():
    with pytest.raises(ValueError, match="one row of 8"):
        gemv(torch.ones(2, 8), torch.ones(4, 8))
    with pytest.raises(ValueError, match="unit stride"):
        gemv(torch.ones(8), torch.ones(8, 4).T)
    assert gemv_module.BLOCK_N == 4
