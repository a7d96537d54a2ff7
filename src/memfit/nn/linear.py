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

    @classmethod
    def holding(cls, weight: Tensor, bias: Tensor | None = None) -> Linear:
        """A Linear around these tensors (no copy; a plain tensor becomes a Parameter keeping
        its requires_grad): what adapted or quantized layers turn back into."""
        out_features, in_features = weight.shape
        layer = cls(in_features, out_features, bias=bias is not None, device="meta")
        as_param = lambda t: t if isinstance(t, nn.Parameter) else nn.Parameter(t, t.requires_grad)  # noqa: E731
        layer.weight = as_param(weight)
        layer.bias = as_param(bias) if bias is not None else None
        return layer


def replace_module(model: nn.Module, path: str, module: nn.Module) -> None:
    """Put `module` at `path` ("layers.0.mlp.down") of `model`."""
    parent, _, attr = path.rpartition(".")
    setattr(model.get_submodule(parent), attr, module)
