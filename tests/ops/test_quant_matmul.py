"""The dequantizing matrix products (memfit.ops.quant.matmul) under Triton's interpreter, and their
GPU twin: y = x W^T and dx = g W with W held as NF4, int8 or int4 are within 2x of the error of PyTorch's
dequantize-then-matmul in the same precision (both against fp64 on the exact dequantized W), on
odd shapes; the kernels' dequantization is bitwise that of the PyTorch reference; the
quantized layer runs them in its forward and backward."""

import pytest
import torch

import memfit.nn.quant as quant_module
import memfit.ops.quant.matmul as kernels
from memfit.nn import Linear
from memfit.nn.quant import QuantLinear
from memfit.ops.quant import (
    dequantize_int4,
    dequantize_int8,
    dequantize_nf4,
    int4_group,
    quantize_int4,
    quantize_int8,
    quantize_nf4,
    unpack_int4,
)
from memfit.ops.quant.nf4 import nf4_absmax, nf4_code
from tests.ops.paths import kernels_on_cpu
from tests.reference import assert_error_within

pytest.importorskip("triton")

# (M, N, K): odd rows and features; K a multiple of 64 (whole NF4 blocks a row: the aligned
# path), and not (blocks straddling rows: the general path)
SHAPES = [(5, 37, 128), (33, 19, 192), (3, 7, 100), (2, 5, 33)]
# int4: K a multiple of its group (128; 64, 32 and 16 where 128 does not divide it)
INT4_SHAPES = [(5, 37, 256), (33, 19, 192), (3, 7, 80), (2, 5, 96)]


def quantized(kind: str, n: int, k: int, device="cpu", seed=0):
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).to(device) * 0.05
    if kind == "int4":
        return quantize_int4(weight, int4_group(k))
    return quantize_nf4(weight) if kind == "nf4" else quantize_int8(weight)


def exact_weight(state: dict, kind: str, shape) -> torch.Tensor:
    """The dequantized weight in fp64, unrounded."""
    if kind == "int8":
        return state["q"].double() * state["scale"].double()[:, None]
    if kind == "int4":
        groups = state["scale"].shape[1]
        q = unpack_int4(state["packed"], groups).double().reshape(shape[0], groups, -1)
        q = q - state["zero"].double()[..., None]
        return (q * state["scale"].double()[..., None]).reshape(shape)
    packed = state["packed"]
    index = torch.stack([packed >> 4, packed & 15], dim=-1).reshape(-1, 64).long()
    values = nf4_code(packed.device).double()[index] * nf4_absmax(state).double()[:, None]
    return values.reshape(-1)[: shape[0] * shape[1]].reshape(shape)


def reference_weight(state, kind, shape, dtype):
    if kind == "nf4":
        return dequantize_nf4(state, shape, dtype)
    if kind == "int4":
        return dequantize_int4(state, dtype)
    return dequantize_int8(state, dtype)


def check_products(kind, m, n, k, dtype, device, floor):
    state = quantized(kind, n, k, device)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
    g = torch.randn(m, n, generator=gen).to(device=device, dtype=dtype)
    bias = torch.randn(n, generator=gen).to(device=device, dtype=dtype)
    exact = exact_weight(state, kind, (n, k))
    weight = reference_weight(state, kind, (n, k), dtype)

    y = kernels.quant_matmul(x, state, kind, (n, k), bias)
    assert y.dtype == dtype and y.shape == (m, n)
    baseline = torch.nn.functional.linear(x, weight, bias)
    expected = x.double() @ exact.T + bias.double()
    assert_error_within(y, baseline, expected, name=f"{kind} y {m}x{n}x{k}", floor=floor)

    dx = kernels.quant_matmul_dx(g, state, kind, (n, k))
    assert dx.dtype == dtype and dx.shape == (m, k)
    assert_error_within(
        dx, g @ weight, g.double() @ exact, name=f"{kind} dx {m}x{n}x{k}", floor=floor
    )

    restored = kernels.dequantize(state, kind, (n, k), dtype)
    if device == "cpu":
        assert torch.equal(restored, weight)
    else:  # the GPU may fuse the scale's multiply-add: within one rounding of the dtype
        torch.testing.assert_close(restored, weight, rtol=2.0**-7, atol=0)


@pytest.mark.parametrize("kind", ["nf4", "int8"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_dequantizing_products_are_as_exact_as_pytorchs(monkeypatch, kind, shape, dtype):
    kernels_on_cpu(monkeypatch)
    # the interpreter truncates bf16 where the GPU rounds: half an ulp of the largest value
    floor = 2.0**-8 if dtype == torch.bfloat16 else 1e-6
    check_products(kind, *shape, dtype, "cpu", floor)


@pytest.mark.parametrize("shape", INT4_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_int4_products_are_as_exact_as_pytorchs(monkeypatch, shape, dtype):
    kernels_on_cpu(monkeypatch)
    floor = 2.0**-8 if dtype == torch.bfloat16 else 1e-6
    check_products("int4", *shape, dtype, "cpu", floor)


@pytest.mark.parametrize("kind", ["nf4", "int8", "int4"])
def test_the_quantized_layer_runs_the_kernels_forward_and_backward(monkeypatch, kind):
    kernels_on_cpu(monkeypatch)
    monkeypatch.setattr(quant_module, "FUSED_MAX_ROWS", {"nf4": 8, "int8": 8, "int4": 8})
    calls = []
    for name in ("quant_matmul", "quant_matmul_dx"):
        fn = getattr(kernels, name)
        monkeypatch.setattr(
            kernels, name, lambda *a, _fn=fn, _n=name, **kw: calls.append(_n) or _fn(*a, **kw)
        )
    layer = QuantLinear(Linear(128, 24, bias=False), kind, torch.bfloat16)
    weight = layer.quant.dequantize()
    x = torch.randn(2, 3, 128, dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    grad = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, grad)
    assert calls == ["quant_matmul", "quant_matmul_dx"]
    torch.testing.assert_close(y, x @ weight.T, atol=0.02, rtol=0.02)
    torch.testing.assert_close(dx, grad @ weight, atol=0.02, rtol=0.02)


def test_above_fused_max_rows_the_weight_is_dequantized_for_a_plain_product(monkeypatch):
    kernels_on_cpu(monkeypatch)
    monkeypatch.setattr(quant_module, "FUSED_MAX_ROWS", {"nf4": 4, "int8": 4, "int4": 4})
    monkeypatch.setattr(kernels, "quant_matmul", lambda *a, **k: pytest.fail("fused kernel ran"))
    layer = QuantLinear(Linear(64, 8, bias=False), "nf4", torch.bfloat16)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(layer(x), x @ layer.quant.dequantize().T)


def test_bad_inputs_say_what_is_wrong(monkeypatch):
    kernels_on_cpu(monkeypatch)
    state = quantized("nf4", 8, 64)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        kernels.quant_matmul(torch.randn(2, 64), state, "nf4", (8, 64))
    with pytest.raises(ValueError, match="64 columns"):
        kernels.quant_matmul(torch.randn(2, 32, dtype=torch.bfloat16), state, "nf4", (8, 64))
    plain = quantize_nf4(torch.randn(8, 64), double_quant=False)
    with pytest.raises(ValueError, match="double-quantized"):
        kernels.quant_matmul(torch.randn(2, 64, dtype=torch.bfloat16), plain, "nf4", (8, 64))
    with pytest.raises(ValueError, match="'nf4', 'int8' or 'int4'"):
        kernels.quant_matmul(torch.randn(2, 64, dtype=torch.bfloat16), state, "fp8", (8, 64))
    with pytest.raises(ValueError, match=r"not that of a contiguous \(16, 64\) weight"):
        kernels.quant_matmul(torch.randn(2, 64, dtype=torch.bfloat16), state, "nf4", (16, 64))
    with pytest.raises(ValueError, match="bias"):
        x = torch.randn(2, 64, dtype=torch.bfloat16)
        kernels.quant_matmul(x, state, "nf4", (8, 64), torch.zeros(9, dtype=torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["nf4", "int8"])
@pytest.mark.parametrize(
    "shape",
    [(1, 4096, 4096), (7, 1000, 4096), (333, 28672, 4096), (8192, 4096, 14336), (129, 77, 100)],
)
def test_the_dequantizing_products_on_cuda(kind, shape):
    check_products(kind, *shape, torch.bfloat16, "cuda", 1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "shape", [(1, 4096, 4096), (7, 1000, 4096), (333, 28672, 4096), (129, 77, 96)]
)
def test_the_int4_products_on_cuda(shape):
    check_products("int4", *shape, torch.bfloat16, "cuda", 1e-6)
