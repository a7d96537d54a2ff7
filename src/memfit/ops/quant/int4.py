"""int4 weight-only quantization, group-wise and asymmetric (round to nearest), for inference.

Each row of an (out, in) weight is cut into groups of `group` consecutive input features (128 by
default). A group's 16 levels span its own range: scale = (max - min) / 15 and an integer zero
point z = round(-min / scale) in [0, 15], so that a weight w is stored as
q = clamp(round(w / scale) + z, 0, 15) and read back as (q - z) * scale. The range always
includes 0 (min <= 0 <= max), so 0 is a level and a group of zeros stays zeros. Two weights a
byte, the even input feature in the low nibble. Storage: 4 + (32 + 8) / group bits a weight
(4.3 at 128).

A layer whose input features the group does not divide takes the largest power of two below
it that does (`int4_group`), down to MIN_GROUP; `quantize_model` says which layers did.

Reference implementations in PyTorch; they run once per weight at load.
"""

from __future__ import annotations

import torch
from torch import Tensor

INT4_GROUP = 128
MIN_GROUP = 16


def int4_group(in_features: int, group: int = INT4_GROUP) -> int:
    """The group size a layer of `in_features` inputs is quantized with: `group`, else the
    largest power of two below it that divides `in_features` (at least MIN_GROUP)."""
    if group < MIN_GROUP or group & (group - 1):
        raise ValueError(f"the int4 group must be a power of two >= {MIN_GROUP}, got {group}")
    size = group
    while size >= MIN_GROUP:
        if in_features % size == 0:
            return size
        size //= 2
    raise ValueError(
        f"int4 needs input features divisible by a group of {MIN_GROUP} to {group}; this layer "
        f"has {in_features}"
    )


@torch.no_grad()
def quantize_int4(weight: Tensor, group: int = INT4_GROUP) -> dict[str, Tensor]:
    """weight (out, in) -> {"packed": int32 (out, in / 8) words (module docstring), "scale":
    fp32 (out, in / group), "zero": uint8 (out, in / group)}; `group` must divide `in`
    (`int4_group`)."""
    if weight.ndim != 2:
        raise ValueError(f"quantize a 2-D weight (out, in), got shape {tuple(weight.shape)}")
    out_features, in_features = weight.shape
    if in_features % group:
        raise ValueError(
            f"a group of {group} does not divide the {in_features} input features "
            f"(int4_group({in_features}) picks one that does)"
        )
    w = weight.float().reshape(out_features, in_features // group, group)
    scale, safe, zero = int4_grid(weight, group)
    q = (torch.round(w / safe[..., None]) + zero[..., None]).clamp(0, 15)
    return {"packed": pack_int4(q.reshape(out_features, in_features), group), "scale": scale,
            "zero": zero.to(torch.uint8)}  # fmt: skip


def int4_grid(weight: Tensor, group: int) -> tuple[Tensor, Tensor, Tensor]:
    """Each (row, group)'s grid (module docstring), fp32 (out, in / group) each: the scale, the
    scale with 1 where it is 0 (safe to divide by), and the zero point."""
    out_features, in_features = weight.shape
    w = weight.float().reshape(out_features, in_features // group, group)
    low = w.amin(dim=2).clamp(max=0.0)
    high = w.amax(dim=2).clamp(min=0.0)
    scale = (high - low) / 15
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return scale, safe, torch.round(-low / safe).clamp(0, 15)


def pack_int4(levels: Tensor, group: int) -> Tensor:
    """(out, in) levels 0..15 -> the int32 (out, in / 8) words of `quantize_int4`'s state."""
    out_features, in_features = levels.shape
    # (out, groups, 8, group / 8): [j, c] is feature j * group / 8 + c, nibble j of word c
    q = levels.to(torch.int32).reshape(out_features, in_features // group, 8, group // 8)
    words = q[:, :, 0]
    for j in range(1, 8):
        words = words | (q[:, :, j] << (4 * j))
    return words.reshape(out_features, in_features // 8).contiguous()


def unpack_int4(packed: Tensor, groups: int) -> Tensor:
    """The (out, in) levels 0..15 (int32) of `quantize_int4`'s packed words."""
    out_features = packed.shape[0]
    words = packed.reshape(out_features, groups, 1, -1)
    shifts = 4 * torch.arange(8, device=packed.device, dtype=torch.int32).reshape(1, 1, 8, 1)
    return ((words >> shifts) & 15).reshape(out_features, -1)


def dequantize_int4(state: dict[str, Tensor], dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """The (out, in) weight of `quantize_int4`'s state, in `dtype`."""
    packed, scale, zero = state["packed"], state["scale"], state["zero"]
    out_features, groups = scale.shape
    q = unpack_int4(packed, groups).reshape(out_features, groups, -1)
    w = (q.float() - zero.float()[..., None]) * scale[..., None]
    return w.reshape(out_features, -1).to(dtype)
