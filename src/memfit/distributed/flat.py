"""Flat, padded buffers: the memory layout ZeRO shards (Rajbhandari et al. 2020, section 5).

The parameters of a model (or of one bucket of it) are laid end to end in one 1-D buffer, each
starting at a multiple of `alignment` elements, and the buffer is padded to a multiple of
world_size * alignment, so that it splits into world_size equal shards: rank r owns elements
[r * shard_numel, (r + 1) * shard_numel). Equal shards are what the collectives need
(reduce_scatter_tensor and all_gather_into_tensor take one equal-sized piece per rank), and the
padding (fewer than world_size * alignment elements, zeros) is how parameter counts that do not
divide by the world size are handled. A parameter may straddle two shards: `pieces(rank)` says
which slice of which parameter a rank owns, for the optimizer step on a shard and for checkpoints.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Piece:
    """The part of parameter `index` that lies in one rank's shard: its elements
    [param_start, param_start + numel) of the flattened parameter are elements
    [shard_start, shard_start + numel) of the shard."""

    index: int
    param_start: int
    shard_start: int
    numel: int


class FlatLayout:
    """Where each of `numels` (element counts of the parameters, in order) lives in a flat buffer
    split into `world_size` equal shards."""

    def __init__(self, numels: Sequence[int], world_size: int, alignment: int = 1) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if alignment < 1:
            raise ValueError(f"alignment must be >= 1 element, got {alignment}")
        if any(n < 0 for n in numels):
            raise ValueError(f"element counts must be >= 0, got {list(numels)}")
        self.numels = tuple(int(n) for n in numels)
        self.world_size = world_size
        self.alignment = alignment
        offsets, position = [], 0
        for numel in self.numels:
            offsets.append(position)
            position += math.ceil(numel / alignment) * alignment
        self.offsets = tuple(offsets)
        self.numel = position  # used elements, alignment gaps included
        unit = world_size * alignment
        self.padded_numel = max(unit, math.ceil(position / unit) * unit)
        self.shard_numel = self.padded_numel // world_size

    @classmethod
    def of(cls, tensors: Sequence[Tensor], world_size: int, alignment: int = 1) -> FlatLayout:
        return cls([t.numel() for t in tensors], world_size, alignment)

    def shard_bounds(self, rank: int) -> tuple[int, int]:
        """[start, end) of rank's shard in the flat buffer."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world_size {self.world_size}")
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def pieces(self, rank: int) -> list[Piece]:
        """The slices of parameters that lie in rank's shard, in buffer order."""
        start, end = self.shard_bounds(rank)
        found = []
        for index, (offset, numel) in enumerate(zip(self.offsets, self.numels, strict=True)):
            lo, hi = max(offset, start), min(offset + numel, end)
            if lo < hi:
                found.append(Piece(index, lo - offset, lo - start, hi - lo))
        return found

    def empty(self, dtype: torch.dtype, device: torch.device | str = "cpu") -> Tensor:
        """A zeroed flat buffer of padded_numel elements (padding and gaps stay zero)."""
        return torch.zeros(self.padded_numel, dtype=dtype, device=device)

    def views(self, flat: Tensor, shapes: Sequence[torch.Size] | None = None) -> list[Tensor]:
        """Views of `flat` for each parameter, shaped like `shapes` (1-D when not given)."""
        if flat.dim() != 1 or flat.numel() != self.padded_numel:
            raise ValueError(
                f"flat buffer must be 1-D with {self.padded_numel} elements, got "
                f"{tuple(flat.shape)}"
            )
        shapes = shapes or [torch.Size([n]) for n in self.numels]
        return [
            flat[offset : offset + numel].view(shape)
            for offset, numel, shape in zip(self.offsets, self.numels, shapes, strict=True)
        ]

    def pack(self, tensors: Sequence[Tensor], out: Tensor) -> Tensor:
        """Copy `tensors` into their places in `out` (gaps and padding untouched); returns out."""
        for view, tensor in zip(self.views(out), tensors, strict=True):
            view.copy_(tensor.reshape(-1))
        return out
