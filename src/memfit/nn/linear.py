"""nn.Linear through `memfit.functional.linear`: the same parameters and state dict, and a
batch-1 decode step's one row takes memfit's matrix-vector kernel."""

from __future__ import annotations

import torch.nn as nn
from torch import Tensor

from memfit import functional as MF


class Linear(nn.Linear):
    def forward(self, x: Tensor, *, swiglu: bool = False, residual: Tensor | None = None) -> Tensor:
        """swiglu: this is a fused gate/up projection; return swiglu of its output. residual:
        added to the result. `memfit.functional.linear` folds both into the one-row kernel of a
        decode step."""
        return MF.linear(x, self.weight, self.bias, swiglu=swiglu, residual=residual)
