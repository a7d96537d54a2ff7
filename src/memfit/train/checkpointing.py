"""Activation checkpointing (recompute in backward instead of storing), applied per block.

Modes (all non-reentrant `torch.utils.checkpoint`, so they compose with autocast and any
number of backward hooks):
- none: every block keeps what autograd saves (about s*b*h*(8 + 3*ffn/h) elements per layer here:
  the two norm inputs, norm outputs, q/k/v, attention output, gate_up and the SwiGLU output).
- full: each block keeps only its input (s*b*h elements) and reruns its forward during backward:
  about one extra forward, i.e. +33% FLOPs (Chen et al. 2016, "Training Deep Nets with Sublinear
  Memory Cost").
- selective: each block is recomputed like `full`, except that the outputs of the attention
  kernel (output and log-sum-exp) are saved and never recomputed: memory s*b*h*2 per layer, and
  the backward skips attention's O(s^2) forward. With flash attention the attention part is the
  costly-to-recompute, cheap-to-store part, the reverse of what Korthikanti et al. 2022
  ("Reducing Activation Recomputation in Large Transformer Models") faced before it. With
  `attention="eager"` there is no fused kernel to save and selective behaves as full.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
import torch.nn as nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import memfit.ops.attention  # noqa: F401  (registers torch.ops.memfit.flash_attn_forward)

CheckpointingMode = Literal["none", "full", "selective"]

_ATTENTION_OPS = [torch.ops.memfit.flash_attn_forward.default] + [
    getattr(torch.ops.aten, name).default
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    if hasattr(torch.ops.aten, name)
]


def _save_attention(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _ATTENTION_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _checkpointed(forward, mode: CheckpointingMode, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    context_fn = None
    if mode == "selective":
        context_fn = functools.partial(create_selective_checkpoint_contexts, _save_attention)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(model: nn.Module, mode: CheckpointingMode) -> nn.Module:
    """Make each block of `model.layers` recompute its activations in backward, in place.

    The module tree and state_dict are unchanged (the wrapper replaces the instance's forward),
    so checkpoints load with or without it."""
    if mode not in ("none", "full", "selective"):
        raise ValueError(
            f"activation checkpointing mode {mode!r} is not one of none, full, selective"
        )
    if mode == "none":
        return model
    for block in model.layers:
        block.forward = functools.partial(_checkpointed, block.forward, mode)
    return model
