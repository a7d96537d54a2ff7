"""RMSNorm (Zhang and Sennrich 2019): x / sqrt(mean(x^2) + eps) * weight, computed in fp32."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch import Tensor

from memfit import functional as MF


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return MF.rms_norm(x, self.weight, self.eps)
