"""4-bit NormalFloat (NF4) and int8 weight quantization (Dettmers et al. 2023, "QLoRA").

NF4. Pretrained weights are close to normally distributed, so the 16 levels are placed at
quantiles of N(0, 1): 8 for the positive half and 7 for the negative half (so that 0 is a level
exactly), scaled to [-1, 1]. A weight is quantized in blocks of NF4_BLOCK = 64 consecutive
elements (row-major): each block's absolute maximum (absmax) maps it into [-1, 1], and each
element becomes the index of its nearest level, two indices a byte (the first in the high
nibble). Dequantized: code[index] * absmax.

Double quantization. The absmax values (fp32, one per 64 weights: 0.5 bits a weight) are
themselves quantized: their mean is subtracted, and each group of 256 is stored as int8 times
an fp32 scale of its own (QLoRA quantizes them to 8-bit floats in blocks of 256; memfit uses a
linear int8 code of the same size, whose error on these positive, narrowly spread values is
below the 4-bit error it scales by far). Storage: 4 + 8/64 + 32/(64 x 256) = 4.127 bits a weight.

int8. One fp32 scale per output row (absmax / 127), each weight rounded to the nearest of the
255 levels: 8 + 32/K bits a weight.

These are the reference implementations, in PyTorch; they run once per weight at load.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

NF4_BLOCK = 64  # weights per absmax
SCALE_BLOCK = 256  # absmax values per second-level scale


def nf4_code(device: torch.device | str = "cpu") -> Tensor:
    """The 16 NF4 levels, ascending, in [-1, 1] with 0 exact: N(0, 1) quantiles at 8 evenly
    spaced probabilities from 1 - d to 1/2 (positive half, 1/2 excluded) and at 7 from 1 - d to 1/2
    (negative half, mirrored), d = (1/32 + 1/30) / 2 (QLoRA's offset: halfway between the
    spacing of 16 and of 15 quantiles), each half normalized to reach 1."""
    offset = torch.tensor(1 - (1 / 32 + 1 / 30) / 2, dtype=torch.float64)
    positive = torch.special.ndtri(torch.linspace(offset.item(), 0.5, 9, dtype=torch.float64)[:-1])
    negative = -torch.special.ndtri(torch.linspace(offset.item(), 0.5, 8, dtype=torch.float64)[:-1])
    levels = torch.cat([negative, torch.zeros(1, dtype=torch.float64), positive])
    levels = levels.sort().values / positive.max()
    return levels.to(torch.float32).to(device)


def _check(weight: Tensor) -> None:
    if weight.ndim != 2:
        raise ValueError(f"quantize a 2-D weight (out, in), got shape {tuple(weight.shape)}")


# quantize this many blocks at a time (16M weights): the chunk's fp32 copies and indices, about
# 200 MiB, are the transient memory, whatever the layer's size
_CHUNK_BLOCKS = 1 << 18


@torch.no_grad()
def quantize_nf4(weight: Tensor, *, double_quant: bool = True) -> dict[str, Tensor]:
    """weight (out, in) -> {"packed": uint8 (ceil(out x in / 64) x 32,), "absmax_q": int8
    (blocks,), "absmax_scale": fp32 (ceil(blocks / 256),), "absmax_mean": fp32 ()} with
    double_quant, else {"packed", "absmax": fp32 (blocks,)}. Blocks are 64 consecutive elements
    of the row-major weight (whole rows' pieces when in_features is a multiple of 64, as in every
    Llama layer), the last one padded with zeros. Computed in fp32 on weight's device, 2^18
    blocks at a time (the transient memory is that chunk's, not the layer's)."""
    _check(weight)
    flat = weight.reshape(-1)
    if flat.numel() % NF4_BLOCK:
        flat = torch.nn.functional.pad(flat, (0, -flat.numel() % NF4_BLOCK))
    blocks = flat.reshape(-1, NF4_BLOCK)
    code = nf4_code(weight.device)
    edges = (code[1:] + code[:-1]) / 2
    absmax = torch.empty(len(blocks), dtype=torch.float32, device=weight.device)
    packed = torch.empty(len(blocks) * NF4_BLOCK // 2, dtype=torch.uint8, device=weight.device)
    for start in range(0, len(blocks), _CHUNK_BLOCKS):
        chunk = blocks[start : start + _CHUNK_BLOCKS].float()
        peak = chunk.abs().amax(dim=1)
        absmax[start : start + len(chunk)] = peak
        normalized = chunk / peak.clamp_min(torch.finfo(torch.float32).tiny)[:, None]
        index = torch.bucketize(normalized, edges, out_int32=True).to(torch.uint8).reshape(-1)
        half = start * NF4_BLOCK // 2
        packed[half : half + index.numel() // 2] = (index[0::2] << 4) | index[1::2]
    if not double_quant:
        return {"packed": packed, "absmax": absmax}
    mean = absmax.mean()
    centered = absmax - mean
    groups = torch.nn.functional.pad(centered, (0, -centered.numel() % SCALE_BLOCK))
    groups = groups.reshape(-1, SCALE_BLOCK)
    scale = groups.abs().amax(dim=1) / 127
    q = torch.round(groups / scale.clamp_min(torch.finfo(torch.float32).tiny)[:, None])
    absmax_q = q.clamp(-127, 127).to(torch.int8).reshape(-1)[: centered.numel()]
    return {"packed": packed, "absmax_q": absmax_q, "absmax_scale": scale, "absmax_mean": mean}


def nf4_absmax(state: dict[str, Tensor]) -> Tensor:
    """The absmax of each block of 64 (fp32), undoing the double quantization."""
    if "absmax" in state:
        return state["absmax"]
    q = state["absmax_q"].float()
    scale = state["absmax_scale"].repeat_interleave(SCALE_BLOCK)[: q.numel()]
    return q * scale + state["absmax_mean"]


def dequantize_nf4(
    state: dict[str, Tensor], shape: tuple[int, int], dtype: torch.dtype = torch.bfloat16
) -> Tensor:
    """The weight of `shape` that `quantize_nf4` made `state` of, in `dtype`."""
    packed = state["packed"]
    values = _byte_levels(packed.device).index_select(0, packed.long()).view(-1, NF4_BLOCK)
    values = values * nf4_absmax(state)[:, None]
    return values.reshape(-1)[: shape[0] * shape[1]].reshape(shape).to(dtype)


@functools.cache
def _byte_levels(device: torch.device) -> Tensor:
    """(256, 2): the two levels each byte of packed codes holds (high nibble first)."""
    code, byte = nf4_code(device), torch.arange(256, device=device)
    return torch.stack([code[byte >> 4], code[byte & 15]], dim=-1)


@torch.no_grad()
def quantize_int8(weight: Tensor) -> dict[str, Tensor]:
    """weight (out, in) -> {"q": int8 (out, in), "scale": fp32 (out,)}: per-row absmax / 127."""
    _check(weight)
    w = weight.float()
    scale = w.abs().amax(dim=1) / 127
    q = torch.round(w / scale.clamp_min(torch.finfo(torch.float32).tiny)[:, None])
    return {"q": q.clamp(-127, 127).to(torch.int8), "scale": scale}


def dequantize_int8(state: dict[str, Tensor], dtype: torch.dtype = torch.bfloat16) -> Tensor:
    return (state["q"].float() * state["scale"][:, None]).to(dtype)
