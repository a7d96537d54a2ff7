"""Modules that own parameters. They call `memfit.functional`, never an op directly; models in
`memfit.models` compose them."""

from memfit.nn.attention import Attention, AttentionMetadata
from memfit.nn.linear import Linear
from memfit.nn.mlp import SwiGLUMLP
from memfit.nn.norm import RMSNorm

__all__ = ["Attention", "AttentionMetadata", "Linear", "RMSNorm", "SwiGLUMLP"]
