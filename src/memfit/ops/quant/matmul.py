"""Matrix products with a quantized weight, the weight dequantized inside the kernel (QLoRA's base).

For x (M, K), a frozen weight W (N, K) held as NF4 with double-quantized scales, as int8 per row
(`memfit.ops.quant.nf4`) or as int4 in groups (`memfit.ops.quant.int4`), and the gradient g
(M, N) of the output:

    quant_matmul(x, W)      y  = x W^T (+ b)     (M, N)    the forward
    quant_matmul_dx(g, W)   dx = g W             (M, K)    the input's gradient in the backward

W never exists in the compute dtype in memory: each program reads the packed codes and scales of
its tiles of W, dequantizes them in registers and feeds them to the tensor cores. The weight's
bytes read are 4.13 bits (NF4) or 8 bits (int8) an element instead of 16. (Which products take
these kernels is memfit.nn.quant's choice, by measurement: see Speed below.)

Dequantizing a (BN, BK) tile: NF4 reads BK / 2 bytes a row, two codes a byte (the first in the
high nibble), looks each code up in the 16 levels, and multiplies by its block's absmax, itself
q * scale + mean (one int8 per 64 weights, one fp32 scale per 256 blocks); int8 multiplies q by
its row's scale; int4 reads each word once and shifts its eight levels out in feature order
(interleaved in the group), then takes (q - zero) * scale of its group. The tile is rounded to
the compute dtype, so the values multiplied are those `dequantize_nf4` / `dequantize_int8` /
`dequantize_int4` return (on the GPU up to the rounding of an absmax whose q * scale + mean the
compiler fuses into one multiply-add), and the products and sums are fp32 as in a bf16 GEMM: the
result equals dequantize-then-matmul up to the order of the sums.

NF4 tiles whose columns are whole blocks of 64 (K a multiple of 64, every Llama layer) are read
as bytes, each byte's two codes interleaved back into the columns (high nibble first); any other
K (blocks straddle rows)
takes the general path, which addresses each element's byte and block by its flat index.

Forward: a program owns a (BM rows of x) x (BN features) tile of y and walks K; the dequantized
W tile is the first operand of the product (y^T = W x^T). Backward: a program owns (BM rows) x
(BK input features) of dx and walks N. `dequantize` writes W whole in the compute dtype with the
same tile code.

Speed (H200, Triton 3.6, llama-3-8b's layers, benchmarks/results/quant_matmul.json): the int8
products run at 410-440 TFLOP/s at 2048-8192 rows (cuBLAS on the bf16 weight: 700-800) and beat
dequantize-then-cuBLAS at 16 rows on the wide layers; the NF4 products reach only 35-50 TFLOP/s:
the lookup of each code in the 16 levels is a gather that Triton pipelines as a copy through
shared memory, and it dominates. `dequantize`, the same tile code writing W, streams at about
2.3 TB/s (gate_up, 117M weights: 0.11 ms), so for NF4 memfit.nn.quant dequantizes each weight
into a transient buffer and multiplies with cuBLAS (FUSED_MAX_ROWS). A lookup that stays in
registers (a select tree over the code's bits, or byte permutes) is the way to a fused NF4
GEMM that pays.

On CUDA the tile sizes are autotuned per shape (M bucketed to a power of two up to 2048); under
Triton's interpreter (tests, CPU) one small tile is used.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from memfit.ops._triton import launch, round_to_bf16, tl, triton
from memfit.ops.quant.nf4 import NF4_BLOCK, SCALE_BLOCK, nf4_code

__all__ = ["dequantize", "quant_matmul", "quant_matmul_dx"]

_NF4, _INT8, _INT4 = 0, 1, 2


@functools.cache
def _code(device: torch.device) -> Tensor:
    return nf4_code(device)


@triton.jit
def _int4_weight_tile(
    w_ptr, s_ptr, a_ptr, rows64, rows_ok, k0, K, WORDS: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr,
):  # fmt: skip
    """int4 W[rows, k0 : k0 + BK] in fp32 from whole words: nibble j of a group's word c is its
    feature j * WORDS + c (memfit.ops.quant.int4), so shifting each word by 4j lays the levels
    out in feature order, (8, WORDS) a group; each word, scale and zero point is read once."""
    size: tl.constexpr = 8 * WORDS  # the group
    c = tl.arange(0, WORDS)
    if BK >= size:  # whole groups: (BN, groups, 8, WORDS)
        g = k0 // size + tl.arange(0, BK // size)
        ok = rows_ok[:, None] & (g < K // size)[None, :]
        words = tl.load(
            w_ptr + rows64[:, None, None] * (K // 8) + (g[:, None] * WORDS + c[None, :])[None],
            mask=ok[:, :, None], other=0,
        )  # fmt: skip
        at = rows64[:, None] * (K // size) + g[None, :]
        zero = tl.load(a_ptr + at, mask=ok, other=0).to(tl.float32)[:, :, None, None]
        scale = tl.load(s_ptr + at, mask=ok, other=0.0)[:, :, None, None]
        shifts = 4 * tl.arange(0, 8)
        q = (words[:, :, None, :] >> shifts[None, None, :, None]) & 15
    else:  # a part of one group: nibbles j0 .. j0 + BK / WORDS - 1 of its words, (BN, ., WORDS)
        g = k0 // size
        words = tl.load(
            w_ptr + rows64[:, None] * (K // 8) + g * WORDS + c[None, :], mask=rows_ok[:, None],
            other=0,
        )  # fmt: skip
        at = rows64 * (K // size) + g
        zero = tl.load(a_ptr + at, mask=rows_ok, other=0).to(tl.float32)[:, None, None]
        scale = tl.load(s_ptr + at, mask=rows_ok, other=0.0)[:, None, None]
        shifts = 4 * ((k0 % size) // WORDS + tl.arange(0, BK // WORDS))
        q = (words[:, None, :] >> shifts[None, :, None]) & 15
    return tl.reshape((q.to(tl.float32) - zero) * scale, (BN, BK))


@triton.jit
def _weight_tile(
    w_ptr, s_ptr, a_ptr, code_ptr, mean_ptr, rows, k0, N, K,
    KIND: tl.constexpr, ALIGNED: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    DTYPE: tl.constexpr, ROUND_BF16_BY_HAND: tl.constexpr, WORDS: tl.constexpr,
):  # fmt: skip
    """W[rows, k0 : k0 + BK] in DTYPE, zero outside (N, K). int8: w_ptr q (N, K), s_ptr the
    rows' scales. NF4: w_ptr the packed codes, a_ptr the int8 absmax, s_ptr the absmax scales,
    mean_ptr their mean, code_ptr the 16 levels."""
    cols = k0 + tl.arange(0, BK)
    rows_ok = rows < N
    inside = rows_ok[:, None] & (cols < K)[None, :]
    rows64 = rows.to(tl.int64)
    if KIND == 1:  # int8, a scale per row
        q = tl.load(w_ptr + rows64[:, None] * K + cols[None, :], mask=inside, other=0)
        scale = tl.load(s_ptr + rows, mask=rows_ok, other=0.0)
        w = q.to(tl.float32) * scale[:, None]
    elif KIND == 2:  # int4, a scale and zero point per group of each row
        w = _int4_weight_tile(w_ptr, s_ptr, a_ptr, rows64, rows_ok, k0, K, WORDS, BN, BK)
    elif ALIGNED:  # NF4, the tile's columns whole blocks of one row
        half = k0 // 2 + tl.arange(0, BK // 2)
        byte_ok = rows_ok[:, None] & (half < K // 2)[None, :]
        packed = tl.load(w_ptr + rows64[:, None] * (K // 2) + half[None, :], mask=byte_ok, other=0)
        high = tl.load(code_ptr + (packed >> 4).to(tl.int32))
        low = tl.load(code_ptr + (packed & 15).to(tl.int32))
        blocks = k0 // 64 + tl.arange(0, BK // 64)
        block_ok = rows_ok[:, None] & (blocks < K // 64)[None, :]
        flat_block = rows64[:, None] * (K // 64) + blocks[None, :]
        q = tl.load(a_ptr + flat_block, mask=block_ok, other=0).to(tl.float32)
        absmax = q * tl.load(s_ptr + flat_block // 256, mask=block_ok, other=0.0)
        absmax += tl.load(mean_ptr)
        high = tl.reshape(high, (BN, BK // 64, 32)) * absmax[:, :, None]
        low = tl.reshape(low, (BN, BK // 64, 32)) * absmax[:, :, None]
        w = tl.reshape(tl.join(high, low), (BN, BK))
    else:  # NF4, any K: each element's byte and block from its flat index
        flat = rows64[:, None] * K + cols[None, :]
        packed = tl.load(w_ptr + flat // 2, mask=inside, other=0).to(tl.int32)
        index = (packed >> ((1 - (flat % 2)) * 4).to(tl.int32)) & 15
        block = flat // 64
        q = tl.load(a_ptr + block, mask=inside, other=0).to(tl.float32)
        absmax = q * tl.load(s_ptr + block // 256, mask=inside, other=0.0) + tl.load(mean_ptr)
        w = tl.load(code_ptr + index) * absmax
    w = tl.where(inside, w, 0.0)
    if ROUND_BF16_BY_HAND:  # the interpreter's cast truncates: bf16 values, held in fp32
        return round_to_bf16(w).to(tl.float32)
    return w.to(DTYPE)


@triton.jit
def _dot(a, b, acc, ROUND_BF16_BY_HAND: tl.constexpr):
    """acc + a b; under the interpreter in fp32 (the tile holds bf16 values in fp32)."""
    if ROUND_BF16_BY_HAND:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _grouped(pid, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP: tl.constexpr):
    """(pid_m, pid_n) with GROUP row blocks walked together, so that their W tiles are reused
    from L2."""
    grid_m = tl.cdiv(M, BM)
    grid_n = tl.cdiv(N, BN)
    per_group = GROUP * grid_n
    first_m = (pid // per_group) * GROUP
    size = tl.minimum(grid_m - first_m, GROUP)
    return first_m + (pid % per_group) % size, (pid % per_group) // size


@triton.jit
def _forward_kernel(
    x_ptr, y_ptr, b_ptr, w_ptr, s_ptr, a_ptr, code_ptr, mean_ptr, M, N, K, stride_x,
    stride_y, M_BUCKET, KIND: tl.constexpr, ALIGNED: tl.constexpr, HAS_BIAS: tl.constexpr,
    ROUND_BF16_BY_HAND: tl.constexpr, WORDS: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    """y[m tile, n tile] = x W^T (+ b), computed as (W x^T)^T."""
    pid_m, pid_n = _grouped(tl.program_id(0), M, N, BM, BN, GROUP)
    rows = pid_m * BM + tl.arange(0, BM)
    features = pid_n * BN + tl.arange(0, BN)
    rows_ok = rows < M
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        x = tl.load(x_rows + cols[None, :], mask=rows_ok[:, None] & (cols < K)[None, :], other=0.0)
        w = _weight_tile(
            w_ptr, s_ptr, a_ptr, code_ptr, mean_ptr, features, k0, N, K, KIND, ALIGNED, BN, BK,
            x_ptr.dtype.element_ty, ROUND_BF16_BY_HAND, WORDS,
        )  # fmt: skip
        acc = _dot(w, tl.trans(x), acc, ROUND_BF16_BY_HAND)
    if HAS_BIAS:
        acc += tl.load(b_ptr + features, mask=features < N, other=0.0).to(tl.float32)[:, None]
    if ROUND_BF16_BY_HAND:
        out = round_to_bf16(acc)
    else:
        out = acc.to(y_ptr.dtype.element_ty)
    y = y_ptr + rows.to(tl.int64)[None, :] * stride_y + features[:, None]
    tl.store(y, out, mask=(features < N)[:, None] & rows_ok[None, :])


@triton.jit
def _dx_kernel(
    g_ptr, dx_ptr, w_ptr, s_ptr, a_ptr, code_ptr, mean_ptr, M, N, K, stride_g, stride_dx,
    M_BUCKET, KIND: tl.constexpr, ALIGNED: tl.constexpr, ROUND_BF16_BY_HAND: tl.constexpr,
    WORDS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    """dx[m tile, k tile] = g W over all N."""
    pid_m, pid_k = _grouped(tl.program_id(0), M, K, BM, BK, GROUP)
    rows = pid_m * BM + tl.arange(0, BM)
    rows_ok = rows < M
    k0 = pid_k * BK
    g_rows = g_ptr + rows.to(tl.int64)[:, None] * stride_g
    acc = tl.zeros((BM, BK), dtype=tl.float32)
    for n0 in range(0, N, BN):
        features = n0 + tl.arange(0, BN)
        g = tl.load(
            g_rows + features[None, :], mask=rows_ok[:, None] & (features < N)[None, :], other=0.0
        )
        w = _weight_tile(
            w_ptr, s_ptr, a_ptr, code_ptr, mean_ptr, features, k0, N, K, KIND, ALIGNED, BN, BK,
            g_ptr.dtype.element_ty, ROUND_BF16_BY_HAND, WORDS,
        )  # fmt: skip
        acc = _dot(g, w, acc, ROUND_BF16_BY_HAND)
    cols = k0 + tl.arange(0, BK)
    if ROUND_BF16_BY_HAND:
        out = round_to_bf16(acc)
    else:
        out = acc.to(dx_ptr.dtype.element_ty)
    dx = dx_ptr + rows.to(tl.int64)[:, None] * stride_dx + cols[None, :]
    tl.store(dx, out, mask=rows_ok[:, None] & (cols < K)[None, :])


@triton.jit
def _dequantize_kernel(
    out_ptr, w_ptr, s_ptr, a_ptr, code_ptr, mean_ptr, N, K,
    KIND: tl.constexpr, ALIGNED: tl.constexpr, ROUND_BF16_BY_HAND: tl.constexpr,
    WORDS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    k0 = tl.program_id(1) * BK
    cols = k0 + tl.arange(0, BK)
    w = _weight_tile(
        w_ptr, s_ptr, a_ptr, code_ptr, mean_ptr, rows, k0, N, K, KIND, ALIGNED, BN, BK,
        out_ptr.dtype.element_ty, ROUND_BF16_BY_HAND, WORDS,
    )  # fmt: skip
    if ROUND_BF16_BY_HAND:
        w = w.to(tl.bfloat16)  # exact: the values are bf16's
    out = out_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :]
    tl.store(out, w, mask=(rows < N)[:, None] & (cols < K)[None, :])


# (BM, BN, BK, warps, stages), BK a multiple of 64 (whole NF4 blocks): the tiles the autotuner
# chose at llama-3-8b's shapes from a wider sweep on an H200 (results/quant_matmul.json)
_CONFIGS = [(256, 128, 64, 8, 3), (128, 128, 64, 4, 4), (64, 64, 128, 4, 4), (64, 128, 128, 4, 4)]
# int4's tiles, chosen when each element read its own word, scale and zero point (9 bytes an
# element, staged in shared memory): memfit.nn.quant takes dequantize + cuBLAS for int4 instead
# (FUSED_MAX_ROWS), so they are not tuned again
_INT4_CONFIGS = [(16, 64, 64, 4, 2), (32, 128, 64, 4, 2), (64, 64, 128, 4, 2), (128, 128, 64, 8, 2)]
_INTERPRET = dict(BM=16, BN=16, BK=64, GROUP=2)


def _tuned(kernel, configs):
    if triton.autotune is None:  # no triton: never launched
        return kernel
    configs = [
        triton.Config(dict(BM=bm, BN=bn, BK=bk, GROUP=8), num_warps=w, num_stages=s)
        for bm, bn, bk, w, s in configs
    ]
    return triton.autotune(configs, key=["M_BUCKET", "N", "K"])(kernel)


_TUNED = {
    (_forward_kernel, _NF4): _tuned(_forward_kernel, _CONFIGS),
    (_forward_kernel, _INT8): _tuned(_forward_kernel, _CONFIGS),
    (_dx_kernel, _NF4): _tuned(_dx_kernel, _CONFIGS),
    (_dx_kernel, _INT8): _tuned(_dx_kernel, _CONFIGS),
    (_forward_kernel, _INT4): _tuned(_forward_kernel, _INT4_CONFIGS),
    (_dx_kernel, _INT4): _tuned(_dx_kernel, _INT4_CONFIGS),
}


def _weight_args(
    state: dict[str, Tensor], kind: str, shape: tuple[int, int], device: torch.device
) -> tuple:
    """The kernels' weight pointers (w, s, a, code, mean) and their KIND, ALIGNED, WORDS, after
    checking that `state` holds a weight of `shape` on `device`."""
    n, k = shape
    if kind not in ("nf4", "int8", "int4"):
        raise ValueError(f"quantized kind must be 'nf4', 'int8' or 'int4', got {kind!r}")
    if kind == "nf4" and "absmax_q" not in state:
        raise ValueError("the NF4 kernels read double-quantized scales (quantize_nf4's default)")
    blocks = -(-n * k // NF4_BLOCK)
    groups = state["scale"].shape[-1] if kind == "int4" and "scale" in state else 1
    expected = {
        "nf4": {"packed": blocks * NF4_BLOCK // 2, "absmax_q": blocks},
        "int8": {"q": n * k, "scale": n},
        "int4": {"packed": n * k // 8, "scale": n * groups, "zero": n * groups},
    }[kind]
    for name, numel in expected.items():
        tensor = state.get(name)
        if tensor is None or tensor.numel() != numel or not tensor.is_contiguous():
            got = "absent" if tensor is None else f"{tensor.numel()} values"
            raise ValueError(
                f"the {kind} state's {name!r} ({got}) is not that of a contiguous ({n}, {k}) "
                f"weight ({numel} values)"
            )
        if tensor.device != device:
            raise ValueError(f"the {kind} state is on {tensor.device}, the operand on {device}")
    if kind == "int8":
        scale = state["scale"]
        return (state["q"], scale, scale, scale, scale), dict(KIND=_INT8, ALIGNED=False, WORDS=1)
    if kind == "int4":
        if k % groups or (k // groups) % 16:
            raise ValueError(f"int4 groups of {k} / {groups} features are not whole words")
        scale = state["scale"]
        pointers = (state["packed"], scale, state["zero"], scale, scale)
        return pointers, dict(KIND=_INT4, ALIGNED=False, WORDS=k // groups // 8)
    pointers = (
        state["packed"], state["absmax_scale"], state["absmax_q"], _code(device),
        state["absmax_mean"],
    )  # fmt: skip
    return pointers, dict(KIND=_NF4, ALIGNED=k % NF4_BLOCK == 0, WORDS=1)


def _check(a: Tensor, features: int, what: str) -> None:
    if a.ndim != 2 or a.shape[1] != features or a.stride(1) != 1:
        raise ValueError(
            f"{what} must be 2-D with {features} columns of unit stride, got {tuple(a.shape)} "
            f"strides {a.stride()}"
        )
    if a.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"the quantized matmul computes in bf16 or fp16, {what} is {a.dtype}")


def _bucket(m: int) -> int:
    return min(triton.next_power_of_2(m), 2048)


def _launch(kernel, grid, device: torch.device, *args, **meta) -> None:
    if device.type == "cpu":  # the interpreter: one small tile
        launch(kernel, grid(_INTERPRET), device, *args, **meta, **_INTERPRET)
    else:
        launch(_TUNED[kernel, meta["KIND"]], grid, device, *args, **meta)


def quant_matmul(
    x: Tensor, state: dict[str, Tensor], kind: str, shape: tuple[int, int],
    bias: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """x (M, K) @ W^T (+ bias) for W (N, K) = shape held quantized in `state` (quantize_nf4 with
    double quantization, or quantize_int8); x bf16 or fp16, the result in x's dtype."""
    n, k = shape
    _check(x, k, "x")
    m = x.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    pointers, meta = _weight_args(state, kind, shape, x.device)
    if bias is not None and (bias.shape != (n,) or bias.device != x.device or bias.stride(0) != 1):
        raise ValueError(
            f"the bias must be ({n},) contiguous on {x.device}, got {tuple(bias.shape)}"
        )
    _launch(
        _forward_kernel,
        lambda c: (triton.cdiv(m, c["BM"]) * triton.cdiv(n, c["BN"]),), x.device,
        x, y, bias if bias is not None else y, *pointers, m, n, k, x.stride(0), y.stride(0),
        _bucket(m), HAS_BIAS=bias is not None,
        ROUND_BF16_BY_HAND=x.device.type == "cpu" and x.dtype == torch.bfloat16, **meta,
    )  # fmt: skip
    return y


def quant_matmul_dx(
    g: Tensor, state: dict[str, Tensor], kind: str, shape: tuple[int, int]
) -> Tensor:
    """g (M, N) @ W for W (N, K) = shape held quantized in `state`: the input's gradient of
    `quant_matmul`, in g's dtype."""
    n, k = shape
    _check(g, n, "the gradient")
    m = g.shape[0]
    dx = torch.empty((m, k), dtype=g.dtype, device=g.device)
    if m == 0:
        return dx
    pointers, meta = _weight_args(state, kind, shape, g.device)
    _launch(
        _dx_kernel,
        lambda c: (triton.cdiv(m, c["BM"]) * triton.cdiv(k, c["BK"]),), g.device,
        g, dx, *pointers, m, n, k, g.stride(0), dx.stride(0), _bucket(m),
        ROUND_BF16_BY_HAND=g.device.type == "cpu" and g.dtype == torch.bfloat16, **meta,
    )  # fmt: skip
    return dx


def dequantize(
    state: dict[str, Tensor], kind: str, shape: tuple[int, int], dtype: torch.dtype
) -> Tensor:
    """W (N, K) = shape in `dtype` from its quantized `state`, by the kernels' tile code."""
    n, k = shape
    device = next(iter(state.values())).device
    out = torch.empty((n, k), dtype=dtype, device=device)
    pointers, meta = _weight_args(state, kind, shape, device)
    bn, bk = (16, 64) if device.type == "cpu" else (32, 256)
    launch(
        _dequantize_kernel, (triton.cdiv(n, bn), triton.cdiv(k, bk)), device, out, *pointers, n, k,
        ROUND_BF16_BY_HAND=device.type == "cpu" and dtype == torch.bfloat16, BN=bn, BK=bk,
        num_warps=4, **meta,
    )  # fmt: skip
    return out


assert NF4_BLOCK == 64 and SCALE_BLOCK == 256  # the kernels' constants
