"""AdamW with 8-bit states: block-wise dynamic quantization of both moments (Dettmers, Lewis,
Shleifer and Zettlemoyer 2022, "8-bit Optimizers via Block-wise Quantization"), and the fused
step that dequantizes, updates and requantizes them and the parameter in one pass.

The code. A state is stored as one byte per element plus one fp32 scale per block of 256
elements, the block's largest magnitude (absmax). A byte names a value of a fixed table in
[-1, 1] (the first moment, signed) or [0, 1] (the second, unsigned), multiplied by the scale.
The table is a dynamic code in the paper's sense, memfit's own layout: of the magnitude bits
(M = 7 signed, 8 unsigned), the highest set bit k of a byte's magnitude c picks a decade,
|value| in (10^-e / 10, 10^-e] with e = M - 1 - k, and the bits below it a linear step in it:

    value(c) = 10^-e * (0.1 + 0.9 * (j + 1) / 2^k),   k = floor(log2 c), j = c - 2^k, c >= 1

and c = 0 is zero. The largest decade has 2^(M-1) steps (1.4% of the block's absmax apart for
the signed code), each smaller one half as many; the top step is exactly 1, so the block's
largest element is stored exactly; the smallest nonzero value is 10^-(M-1) of the absmax. The
bytes are ordered like their values, and encoding is arithmetic, not a search of the table:
e from comparisons against the decade bounds, then the nearest step (`_encode`).

The second moment is stored as its square root: the update divides by sqrt(v), and the code's
range of 10^-7 covers a range of 10^-14 in v, so small second moments beside a large one in
the same block do not round to zero (where an update m / (sqrt(v) + eps) would explode).

The step, per element (torch.optim.AdamW's arithmetic in fp32, on the dequantized states):

    m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
    p = p (1 - lr wd) - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

then each block's new absmax and codes. On CUDA one Triton kernel does all of it for every
tensor of a group (a table of their addresses, programs over chunks of 1024 elements): it reads
the parameter, gradient and 2 bytes of state per element and writes the parameter and the
bytes, 2 x 4 + 2 + 4 + 2 = 16 bytes per fp32 parameter against fused AdamW's 28. On the CPU
the same arithmetic runs as vectorized torch ops per tensor (the reference the kernel is
tested against, and ZeRO-Offload's step). Tensors given 32-bit states (small ones, or by
choice) take the same kernel with fp32 moments.
"""

from __future__ import annotations

import torch
from torch import Tensor

from memfit.ops._triton import launch, round_to_bf16, tl, triton

__all__ = [
    "BLOCK",
    "ChunkTable",
    "adamw_step_reference",
    "dequantize",
    "dynamic_code",
    "fused_adamw_step",
    "quantize",
    "stochastic_bf16",
]

BLOCK = 256  # elements per quantization block (one fp32 absmax each)
CHUNK_BLOCKS = 4  # blocks per program of the fused step (`benchmarks/optimizers.py --sweep`)
NUM_WARPS = 4  # of a program of the fused step
SIGNED_BITS, UNSIGNED_BITS = 7, 8  # magnitude bits of the two codes


def dynamic_code(signed: bool) -> Tensor:
    """The 256 fp32 values a byte stands for (index: the byte). Signed: bit 7 is the sign."""
    bits = SIGNED_BITS if signed else UNSIGNED_BITS
    magnitudes = torch.zeros(2**bits, dtype=torch.float64)
    for c in range(1, 2**bits):
        k = c.bit_length() - 1
        e = bits - 1 - k
        magnitudes[c] = 10.0**-e * (0.1 + 0.9 * (c - 2**k + 1) / 2**k)
    values = torch.cat([magnitudes, -magnitudes]) if signed else magnitudes
    return values.float()


def _encode(a: Tensor, bits: int) -> Tensor:
    """Magnitude bytes (int32) of a = |x| / absmax in [0, 1]: the nearest step of the code."""
    e = torch.zeros_like(a, dtype=torch.int32)
    for i in range(1, bits):  # the decade: the number of bounds 10^-i that a is at or under
        e += (a <= torch.tensor(_DECADE[i], dtype=torch.float32)).int()
    f = a * _POW10_F32.to(a.device)[e]  # in (0.1, 1] (or under 0.1 in the last decade)
    steps = torch.bitwise_left_shift(torch.ones_like(e), bits - 1 - e).float()  # 2^k
    # steps from the decade's floor (0.1, the top of the decade below; 0 in the last decade,
    # whose one step has only zero below it), exact in the last product (a power of two)
    t = torch.where(e == bits - 1, f, (f - 0.1) * _INV_09 * steps)
    c = steps - 1 + torch.floor(t + 0.5)
    return c.clamp(0, 2**bits - 1).to(torch.int32)


# fp32 constants shared by both paths, so that they round alike
_DECADE = [float(torch.tensor(10.0**-i, dtype=torch.float32)) for i in range(9)]
_POW10 = [float(10**i) for i in range(9)]
_POW10_F32 = torch.tensor(_POW10, dtype=torch.float32)  # exact: integers below 2^24
_INV_09 = float(torch.tensor(1 / 0.9, dtype=torch.float32))


def quantize(x: Tensor, signed: bool) -> tuple[Tensor, Tensor]:
    """x (any shape, fp32) -> (codes: uint8 of x's shape, absmax: fp32 (ceil(numel / BLOCK),)),
    blocks of BLOCK consecutive elements of the flattened x."""
    flat = x.detach().reshape(-1).float()
    n = flat.numel()
    blocks = -(-n // BLOCK)
    padded = torch.zeros(blocks * BLOCK, dtype=torch.float32, device=x.device)
    padded[:n] = flat
    padded = padded.view(blocks, BLOCK)
    absmax = padded.abs().amax(dim=1)
    inverse = 1.0 / absmax.clamp_min(1e-30)  # (an all-zero block: codes 0 whatever it is)
    a = (padded.abs() * inverse[:, None]).clamp_(max=1.0)
    c = _encode(a, SIGNED_BITS if signed else UNSIGNED_BITS)
    if signed:
        c = c | torch.where(padded < 0, 128, 0).to(torch.int32)
    return c.reshape(-1)[:n].to(torch.uint8).view(x.shape), absmax


def dequantize(codes: Tensor, absmax: Tensor, signed: bool) -> Tensor:
    """The fp32 values of `quantize`'s output."""
    table = _code_table(signed, codes.device)
    n = codes.numel()
    values = table[codes.reshape(-1).long()]
    scale = absmax.repeat_interleave(BLOCK)[:n]
    return (values * scale).view(codes.shape)


_TABLES: dict[tuple[bool, torch.device], Tensor] = {}


def _code_table(signed: bool, device: torch.device) -> Tensor:
    key = (signed, torch.device(device))
    if key not in _TABLES:
        _TABLES[key] = dynamic_code(signed).to(device)
    return _TABLES[key]


def adamw_step_reference(
    param: Tensor,
    grad: Tensor,
    state: dict[str, Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    stochastic_seed: int | None = None,
) -> None:
    """One AdamW step of one tensor in place, in torch ops (the CPU path and the kernel's
    reference). state: "exp_avg_codes", "exp_avg_absmax", "exp_avg_sq_root_codes",
    "exp_avg_sq_root_absmax" (8-bit), or "exp_avg", "exp_avg_sq" (fp32). stochastic_seed: a bf16
    parameter is rounded stochastically (`stochastic_bf16`), with this seed."""
    g = grad.float()
    quantized = "exp_avg_codes" in state
    if quantized:
        m = dequantize(state["exp_avg_codes"], state["exp_avg_absmax"], True)
        root = dequantize(state["exp_avg_sq_root_codes"], state["exp_avg_sq_root_absmax"], False)
        v = root * root
    else:
        m, v = state["exp_avg"], state["exp_avg_sq"]
    m = m * beta1 + g * (1 - beta1)
    v = v * beta2 + g * g * (1 - beta2)
    root = torch.sqrt(v)
    p = param.float() * (1 - lr * weight_decay)
    p = p - (lr / (1 - beta1**step)) * m / (root / (1 - beta2**step) ** 0.5 + eps)
    if stochastic_seed is not None and param.dtype == torch.bfloat16:
        p = stochastic_bf16(p, stochastic_seed)
    param.copy_(p)
    if quantized:
        codes, absmax = quantize(m, True)
        state["exp_avg_codes"].copy_(codes)
        state["exp_avg_absmax"].copy_(absmax)
        codes, absmax = quantize(root, False)
        state["exp_avg_sq_root_codes"].copy_(codes)
        state["exp_avg_sq_root_absmax"].copy_(absmax)
    else:
        state["exp_avg"].copy_(m)
        state["exp_avg_sq"].copy_(v)


def stochastic_bf16(x: Tensor, seed: int) -> Tensor:
    """fp32 x rounded to bf16 up or down at random, up with probability the distance to the
    value below over the gap (unbiased: the expected result is x): 16 random bits added to the
    magnitude's low 16 bits, then truncated. A bf16 parameter updated this way keeps updates
    smaller than its rounding step on average, where rounding to nearest would drop them."""
    generator = torch.Generator(device=x.device).manual_seed(seed)
    noise = torch.randint(0, 1 << 16, x.shape, generator=generator, device=x.device)
    bits = (x.float().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF) + noise
    bits = (bits >> 16) << 16
    bits = torch.where(bits >= 1 << 31, bits - (1 << 32), bits)  # back to int32's range
    return bits.to(torch.int32).view(torch.float32).to(torch.bfloat16)


@triton.jit
def _encode_tl(a, BITS: tl.constexpr):
    """`_encode` in Triton, with the same fp32 constants: magnitude bytes (int32) of a in [0, 1]."""
    e = (a <= 1e-1).to(tl.int32) + (a <= 1e-2).to(tl.int32) + (a <= 1e-3).to(tl.int32)
    e += (a <= 1e-4).to(tl.int32) + (a <= 1e-5).to(tl.int32) + (a <= 1e-6).to(tl.int32)
    if BITS == 8:
        e += (a <= 1e-7).to(tl.int32)
    scale = tl.where(e == 0, 1.0, 10.0)
    scale = tl.where(e == 2, 100.0, scale)
    scale = tl.where(e == 3, 1000.0, scale)
    scale = tl.where(e == 4, 10000.0, scale)
    scale = tl.where(e == 5, 100000.0, scale)
    scale = tl.where(e == 6, 1000000.0, scale)
    scale = tl.where(e == 7, 10000000.0, scale)
    f = a * scale
    steps = (tl.full(a.shape, 1, tl.int32) << (BITS - 1 - e)).to(tl.float32)
    t = tl.where(e == BITS - 1, f, (f - 0.1) * 1.1111111111111112 * steps)
    c = steps - 1.0 + tl.floor(t + 0.5)
    return tl.minimum(tl.maximum(c, 0.0), 2.0**BITS - 1.0).to(tl.int32)


@triton.jit
def _adamw_kernel(
    chunk_tensor_ptr,
    chunk_start_ptr,
    numel_ptr,
    address_ptr,
    num_tensors,
    code_m_ptr,
    code_v_ptr,
    beta1,
    beta2,
    eps,
    decay,
    step_size,
    bias_root,
    seed,
    QUANT: tl.constexpr,
    PARAM_BF16: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    ROUND_BF16_BY_HAND: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One chunk of CHUNK blocks of BLOCK elements of one tensor (the tables say which): the
    AdamW step of its parameters and states. address_ptr: (6, num_tensors) int64 addresses of
    each tensor's parameter, gradient, first and second moment (codes, or fp32 values when not
    QUANT) and their absmax (QUANT)."""
    pid = tl.program_id(0)
    tensor = tl.load(chunk_tensor_ptr + pid)
    start = tl.load(chunk_start_ptr + pid)
    n = tl.load(numel_ptr + tensor)
    p_type = tl.pointer_type(tl.bfloat16 if PARAM_BF16 else tl.float32)
    p_ptr = tl.load(address_ptr + tensor).to(p_type)
    g_ptr = tl.load(address_ptr + num_tensors + tensor).to(p_type)
    state_type = tl.pointer_type(tl.uint8 if QUANT else tl.float32)
    m_ptr = tl.load(address_ptr + 2 * num_tensors + tensor).to(state_type)
    v_ptr = tl.load(address_ptr + 3 * num_tensors + tensor).to(state_type)
    rows = tl.arange(0, CHUNK)
    offsets = start + rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = offsets < n
    p = tl.load(p_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if QUANT:
        ms_ptr = tl.load(address_ptr + 4 * num_tensors + tensor).to(tl.pointer_type(tl.float32))
        vs_ptr = tl.load(address_ptr + 5 * num_tensors + tensor).to(tl.pointer_type(tl.float32))
        blocks = start // BLOCK + rows
        block_ok = blocks * BLOCK < n
        m_scale = tl.load(ms_ptr + blocks, mask=block_ok, other=0.0)
        v_scale = tl.load(vs_ptr + blocks, mask=block_ok, other=0.0)
        m_codes = tl.load(m_ptr + offsets, mask=mask, other=0).to(tl.int32)
        v_codes = tl.load(v_ptr + offsets, mask=mask, other=0).to(tl.int32)
        m = tl.load(code_m_ptr + m_codes) * m_scale[:, None]
        root = tl.load(code_v_ptr + v_codes) * v_scale[:, None]
        v = root * root
    else:
        m = tl.load(m_ptr + offsets, mask=mask, other=0.0)
        v = tl.load(v_ptr + offsets, mask=mask, other=0.0)
    m = m * beta1 + g * (1 - beta1)
    v = v * beta2 + g * g * (1 - beta2)
    root = tl.sqrt_rn(v)
    p = p * decay - step_size * m / (root / bias_root + eps)
    if STOCHASTIC:  # bf16: 16 random bits into the magnitude's low bits, then truncated
        noise = tl.randint(seed + tensor * 1000003, offsets.to(tl.int32)) & 0xFFFF
        bits = (p.to(tl.uint32, bitcast=True) + noise) >> 16
        tl.store(p_ptr + offsets, bits.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
    elif ROUND_BF16_BY_HAND:  # the interpreter's cast truncates
        tl.store(p_ptr + offsets, round_to_bf16(p), mask=mask)
    else:
        tl.store(p_ptr + offsets, p.to(p_ptr.dtype.element_ty), mask=mask)
    if QUANT:
        m_max = tl.max(tl.abs(m), axis=1)
        root_max = tl.max(root, axis=1)
        # (an all-zero block: codes 0, whatever the inverse)
        m_inverse = tl.math.div_rn(1.0, tl.maximum(m_max, 1e-30))
        root_inverse = tl.math.div_rn(1.0, tl.maximum(root_max, 1e-30))
        m_codes = _encode_tl(tl.minimum(tl.abs(m) * m_inverse[:, None], 1.0), 7)
        m_codes = m_codes | tl.where(m < 0, 128, 0)
        v_codes = _encode_tl(tl.minimum(root * root_inverse[:, None], 1.0), 8)
        tl.store(m_ptr + offsets, m_codes.to(tl.uint8), mask=mask)
        tl.store(v_ptr + offsets, v_codes.to(tl.uint8), mask=mask)
        tl.store(ms_ptr + blocks, m_max, mask=block_ok)
        tl.store(vs_ptr + blocks, root_max, mask=block_ok)
    else:
        tl.store(m_ptr + offsets, m, mask=mask)
        tl.store(v_ptr + offsets, v, mask=mask)


class ChunkTable:
    """The programs of a fused step over a list of tensors: for each, the tensor it works on
    and where its chunk starts (device int tensors, built once per list of sizes)."""

    def __init__(self, numels: list[int], device: torch.device) -> None:
        chunk = CHUNK_BLOCKS * BLOCK
        counts = [-(-n // chunk) for n in numels]
        tensor = torch.repeat_interleave(torch.arange(len(numels)), torch.tensor(counts))
        first = torch.tensor([0] + counts[:-1]).cumsum(0)
        start = (torch.arange(len(tensor)) - first[tensor]) * chunk
        self.tensor = tensor.to(device, torch.int32)
        self.start = start.to(device, torch.int64)
        self.numel = torch.tensor(numels, dtype=torch.int64, device=device)
        self.programs = len(tensor)


def fused_adamw_step(
    params: list[Tensor],
    grads: list[Tensor],
    states: list[dict[str, Tensor]],
    table: ChunkTable,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    stochastic_seed: int | None = None,
) -> None:
    """`adamw_step_reference` for every tensor of `params` in one launch: the parameters of one
    dtype (fp32 or bf16), their gradients of it, and states all 8-bit or all fp32, as `table`
    lays them out. stochastic_seed: bf16 parameters are rounded stochastically (the random bits
    are the kernel's own, not `stochastic_bf16`'s)."""
    if table.programs == 0:
        return
    quant = "exp_avg_codes" in states[0]
    keys = (
        ("exp_avg_codes", "exp_avg_sq_root_codes", "exp_avg_absmax", "exp_avg_sq_root_absmax")
        if quant
        else ("exp_avg", "exp_avg_sq")
    )
    columns = [[t.data_ptr() for t in params], [t.data_ptr() for t in grads]]
    columns += [[state[key].data_ptr() for state in states] for key in keys]
    if not quant:
        columns += [columns[0], columns[0]]  # (unused)
    device, bf16 = params[0].device, params[0].dtype == torch.bfloat16
    addresses = torch.tensor(columns, dtype=torch.int64).to(device, non_blocking=True)
    launch(
        _adamw_kernel, (table.programs,), device,
        table.tensor, table.start, table.numel, addresses, len(params),
        _code_table(True, device), _code_table(False, device),
        beta1, beta2, eps, 1 - lr * weight_decay, lr / (1 - beta1**step),
        (1 - beta2**step) ** 0.5, stochastic_seed or 0,
        QUANT=quant, PARAM_BF16=bf16, STOCHASTIC=bf16 and stochastic_seed is not None, ROUND_BF16_BY_HAND=bf16 and device.type == "cpu",
        CHUNK=CHUNK_BLOCKS,
        BLOCK=BLOCK, num_warps=NUM_WARPS,
    )  # fmt: skip
