"""The quantized matrix-vector product of a decode step (memfit.ops.quant.gemv) under Triton's
interpreter, and its GPU twin: y = W x with W held as int8 or int4 is within 2x of the error of
PyTorch's dequantize-then-matmul in the same precision (both against fp64 on the exact
dequantized W), on odd shapes and int4's smaller groups; the swiglu and residual folds give the
values of the separate ops; a quantized layer takes the kernel for one row without a gradient.
On CUDA int4 multiplies in packed fp16 pairs (x scaled by a power of two a group): x's packing
is checked under the interpreter, the products on the GPU, with activations spread over many
orders of magnitude and with the fp32 products for comparison."""

import pytest
import torch
import torch.nn.functional as F

import memfit.nn.quant as quant_module
from memfit import functional as MF
from memfit.nn import Linear
from memfit.nn.quant import QuantLinear
from memfit.ops.quant import gemv as gemv_module
from memfit.ops.quant.gemv import quant_gemv
from tests.ops.paths import kernels_on_cpu
from tests.ops.test_quant_matmul import exact_weight, quantized, reference_weight
from tests.reference import assert_error_within

pytest.importorskip("triton")

# (N, K): odd rows; int4 groups of 128, 64 (192), 16 (80); int8 K odd, not a multiple of its tile
SHAPES = {
    "int4": [(37, 256), (21, 192), (19, 80)],
    "int8": [(37, 100), (19, 261), (5, 1024)],
}
CASES = [(kind, shape) for kind, shapes in SHAPES.items() for shape in shapes]


def check_gemv(kind, n, k, dtype, device, floor):
    state = quantized(kind, n, k, device)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 1, k, generator=gen).to(device=device, dtype=dtype)
    bias = torch.randn(n, generator=gen).to(device=device, dtype=dtype)
    exact = exact_weight(state, kind, (n, k))
    weight = reference_weight(state, kind, (n, k), dtype)
    for b in (None, bias):
        y = quant_gemv(x, state, kind, (n, k), b)
        assert y.dtype == dtype and y.shape == (1, 1, n)
        baseline = F.linear(x, weight, b)
        expected = x.double() @ exact.T + (b.double() if b is not None else 0)
        assert_error_within(y, baseline, expected, name=f"{kind} gemv {n}x{k}", floor=floor)


@pytest.mark.parametrize("kind,shape", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_quantized_gemv_is_as_exact_as_pytorchs(monkeypatch, kind, shape, dtype):
    kernels_on_cpu(monkeypatch)
    floor = 2.0**-8 if dtype == torch.bfloat16 else 1e-6
    check_gemv(kind, *shape, dtype, "cpu", floor)


@pytest.mark.parametrize("vec", [8, 16])
@pytest.mark.parametrize("shape", SHAPES["int8"])
def test_int8_read_eight_or_sixteen_bytes_a_thread_is_as_exact(monkeypatch, vec, shape):
    kernels_on_cpu(monkeypatch)
    monkeypatch.setattr(gemv_module, "INT8_VEC", vec)
    check_gemv("int8", *shape, torch.bfloat16, "cpu", 2.0**-8)
    check_folds("int8", 24, 192, "cpu")


@pytest.mark.parametrize("ahead_tiles", [1, 1000])
@pytest.mark.parametrize("shape", SHAPES["int4"])
def test_int4_with_or_without_the_next_tile_read_ahead_is_as_exact(monkeypatch, ahead_tiles, shape):
    kernels_on_cpu(monkeypatch)
    monkeypatch.setattr(gemv_module, "INT4_AHEAD_TILES", ahead_tiles)
    check_gemv("int4", *shape, torch.bfloat16, "cpu", 2.0**-8)
    check_folds("int4", shape[0] - shape[0] % 2, shape[1], "cpu")


def check_folds(kind, n, k, device):
    """swiglu and residual folded in: the separate ops' values on the kernel's product."""
    state = quantized(kind, 2 * n, k, device)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, k, generator=gen).to(device=device, dtype=torch.bfloat16)
    residual = torch.randn(1, n, generator=gen).to(device=device, dtype=torch.bfloat16)
    product = quant_gemv(x, state, kind, (2 * n, k))
    fused = quant_gemv(x, state, kind, (2 * n, k), swiglu=True, residual=residual)
    expected = residual + MF.swiglu(product)
    # one rounding apart where the sum cancels: half an ulp of the addends
    atol = 2.0**-8 * max(residual.abs().max().item(), MF.swiglu(product).abs().max().item())
    torch.testing.assert_close(fused, expected, atol=atol, rtol=2.0**-7)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_swiglu_and_residual_folds_match_the_separate_ops(monkeypatch, kind):
    kernels_on_cpu(monkeypatch)
    check_folds(kind, 24, 192, "cpu")


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_the_gemv_is_exact_across_the_range_of_activations(monkeypatch, kind):
    """x scaled by a power of two (exact in bf16) scales the product exactly: the kernel's
    fixed scaling of int4 products (2^-64) neither overflows nor loses bits from 1e-12 to 1e9."""
    kernels_on_cpu(monkeypatch)
    check_range(kind, "cpu")


def check_range(kind, device):
    state = quantized(kind, 21, 256, device)
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(3)).to(device, torch.bfloat16)
    y = quant_gemv(x, state, kind, (21, 256)).float()
    for power in (-40, 30):
        scaled = quant_gemv(x * 2.0**power, state, kind, (21, 256)).float()
        torch.testing.assert_close(scaled, y * 2.0**power, atol=0, rtol=0)


def test_int4s_packed_halves_hold_x_exactly_with_its_largest_below_256(monkeypatch):
    """x for the packed-half int4 product: each group's x scaled by a power of two that puts its
    largest |x| in [128, 256), as fp16 pairs (features p * W + c, (p + 4) * W + c) that read back
    exactly; a group of zeros, and values from 1e-30 to 1e30, included."""
    kernels_on_cpu(monkeypatch)
    k, groups = 640, 5
    x = torch.randn(k, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    for g, power in enumerate((0.0, 1e-30, 1e30, 1e4)):
        x[g * 128 : (g + 1) * 128] *= power
    x[500] = 3e4
    xh, xinv = gemv_module._int4_x(x, groups, pdl=False, half=True)
    assert xh.dtype == torch.int32 and xh.shape == (k // 2,) and xinv.shape == (groups,)
    words = k // groups // 8
    halves = [(xh & 0xFFFF).to(torch.int16), (xh >> 16).to(torch.int16)]
    lo, hi = (h.view(torch.float16).float().reshape(groups, 4, words) for h in halves)
    assert torch.isfinite(lo).all() and torch.isfinite(hi).all()
    inv = xinv[:, None, None]
    expected = x.float().reshape(groups, 8, words)
    torch.testing.assert_close(lo * inv, expected[:, :4], atol=0, rtol=0)
    torch.testing.assert_close(hi * inv, expected[:, 4:], atol=0, rtol=0)
    top = torch.maximum(lo.abs().amax(dim=(1, 2)), hi.abs().amax(dim=(1, 2)))
    assert ((top >= 128) & (top < 256) | (top == 0)).all(), top
    assert top[0] == 0 and xinv[0] > 0


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_quantized_layer_takes_the_gemv_for_one_row(monkeypatch, kind):
    kernels_on_cpu(monkeypatch)
    calls = []
    monkeypatch.setattr(
        quant_module, "quant_gemv", lambda *a, **kw: calls.append(1) or quant_gemv(*a, **kw)
    )
    layer = QuantLinear(Linear(128, 48, bias=True), kind, torch.bfloat16)
    x = torch.randn(1, 1, 128, dtype=torch.bfloat16)
    residual = torch.randn(1, 1, 24, dtype=torch.bfloat16)
    with torch.no_grad():
        y = layer(x, swiglu=True, residual=residual)
    assert calls == [1]
    reference = residual + MF.swiglu(F.linear(x, layer.quant.dequantize(), layer.bias))
    torch.testing.assert_close(y, reference, atol=0.05, rtol=0.02)
    # a row that needs its gradient, or several rows, take the autograd / matmul path
    x.requires_grad_(True)
    layer(x)
    layer(torch.randn(2, 128, dtype=torch.bfloat16))
    assert calls == [1]


def test_bad_inputs_say_what_is_wrong(monkeypatch):
    kernels_on_cpu(monkeypatch)
    state = quantized("int4", 8, 64)
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="int8 or int4 weights"):
        quant_gemv(x, quantized("nf4", 8, 64), "nf4", (8, 64))
    with pytest.raises(ValueError, match="one row of 64 features"):
        quant_gemv(torch.randn(2, 64, dtype=torch.bfloat16), state, "int4", (8, 64))
    with pytest.raises(ValueError, match="bf16 or fp16"):
        quant_gemv(x.float(), state, "int4", (8, 64))
    with pytest.raises(ValueError, match="even number of rows"):
        quant_gemv(x, quantized("int4", 7, 64), "int4", (7, 64), swiglu=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "kind,shape",
    [
        ("int4", (6144, 4096)), ("int4", (4096, 14336)), ("int4", (1000, 576)), ("int4", (37, 80)),
        ("int8", (6144, 4096)), ("int8", (4096, 14336)), ("int8", (1000, 101)),
    ],
)  # fmt: skip
def test_the_quantized_gemv_on_cuda(kind, shape):
    check_gemv(kind, *shape, torch.bfloat16, "cuda", 1e-6)
    check_folds(kind, shape[0] // 2, shape[1], "cuda")
    check_range(kind, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("vec", [8, 16])
@pytest.mark.parametrize("config", [(2, 2048, 4, 1), (2, 1024, 2, 1), (1, 1024, 4, 3)])
@pytest.mark.parametrize("shape", [(6144, 4096), (4096, 14336), (3072, 3072), (1000, 101)])
def test_int8s_layouts_on_cuda(monkeypatch, vec, config, shape):
    monkeypatch.setitem(gemv_module.CONFIG, "int8", config)
    monkeypatch.setattr(gemv_module, "INT8_VEC", vec)
    check_gemv("int8", *shape, torch.bfloat16, "cuda", 1e-6)
    check_folds("int8", shape[0] // 2, shape[1], "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("ahead_tiles", [1, 1000])
@pytest.mark.parametrize("config", [(4, 2048, 2, 1), (8, 1024, 4, 1), (2, 512, 1, 1)])
@pytest.mark.parametrize("shape", [(6144, 4096), (4096, 14336), (3072, 3072), (1000, 576)])
def test_int4s_layouts_on_cuda(monkeypatch, ahead_tiles, config, shape):
    """The packed-half int4 product in other tiles, rows a thread and tiles read ahead."""
    monkeypatch.setitem(gemv_module.CONFIG, "int4_half", config)
    monkeypatch.setattr(gemv_module, "INT4_AHEAD_TILES", ahead_tiles)
    check_gemv("int4", *shape, torch.bfloat16, "cuda", 1e-6)
    check_folds("int4", shape[0] // 2, shape[1], "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("half", [True, False])
@pytest.mark.parametrize("shape", [(4096, 4096), (3072, 8192), (1000, 576)])
def test_int4_in_packed_halves_on_cuda_across_outliers(monkeypatch, half, shape):
    """The packed-half int4 product (and the fp32 one) within 2x PyTorch's error where x spans
    1e-6 to 3e4 across groups (a massive activation, a nearly silent group)."""
    monkeypatch.setattr(gemv_module, "INT4_HALF", half)
    n, k = shape
    state = quantized("int4", n, k, "cuda")
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(5))
    x[0, ::97] *= 300.0
    x[0, 7] = 3e4
    x[0, 128:256] *= 1e-6
    x = x.to("cuda", torch.bfloat16)
    y = quant_gemv(x, state, "int4", (n, k))
    baseline = F.linear(x, reference_weight(state, "int4", (n, k), torch.bfloat16))
    expected = x.double() @ exact_weight(state, "int4", (n, k)).T
    assert_error_within(y, baseline, expected, name=f"int4 half={half} {n}x{k}", floor=1e-6)
