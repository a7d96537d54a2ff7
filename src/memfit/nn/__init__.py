"""Modules that own parameters. They call `memfit.functional`, never an op directly; models in
`memfit.models` compose them."""

from memfit.nn.attention import Attention, AttentionMetadata
from memfit.nn.linear import Linear
from memfit.nn.lora import (
    LoRALinear,
    LoRASpec,
    apply_lora,
    load_peft_adapter,
    merge_lora,
    save_peft_adapter,
)
from memfit.nn.mlp import SwiGLUMLP
from memfit.nn.norm import RMSNorm

__all__ = [
    "Attention",
    "AttentionMetadata",
    "Linear",
    "LoRALinear",
    "LoRASpec",
    "RMSNorm",
    "SwiGLUMLP",
    "apply_lora",
    "load_peft_adapter",
    "merge_lora",
    "save_peft_adapter",
]
