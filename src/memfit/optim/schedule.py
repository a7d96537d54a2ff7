"""Parameter groups, the configured optimizer (built from the registry) and the learning-rate
schedule. Weight decay applies to matrices and embeddings only, not to norm weights or biases.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from memfit.optim.registry import get_optimizer

if TYPE_CHECKING:
    from memfit.config import TrainSection


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Matrices (decayed), vectors (not), and, where the model has any, the embedding tables
    in a group of their own marked "embedding" (decayed; 8-bit AdamW keeps their states in
    32 bits: a row sees a gradient only when its token occurs)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay, embedding = [], [], []
    for param in model.parameters():
        if not param.requires_grad:
            continue
        if id(param) in embeddings:
            embedding.append(param)
        else:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if embedding:
        groups.append({"params": embedding, "weight_decay": weight_decay, "embedding": True})
    return groups


def make_optimizer(
    groups: list[dict], train: TrainSection, device: torch.device
) -> torch.optim.Optimizer:
    """The configured optimizer (`train.optimizer`, from the registry) over `groups`, tensors on
    `device` (the CPU for ZeRO-Offload's step)."""
    return get_optimizer(train.optimizer).build(
        groups,
        lr=train.lr,
        betas=(train.beta1, train.beta2),
        momentum=train.momentum,
        device=device,
    )


def lr_multiplier(step: int, *, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Linear warmup from 0 over `warmup_steps`, then cosine decay to `min_lr_ratio`."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, train: TrainSection
) -> torch.optim.lr_scheduler.LambdaLR:
    warmup = min(train.warmup_steps, max(0, train.steps - 1))
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_multiplier(
            step, warmup_steps=warmup, total_steps=train.steps, min_lr_ratio=train.min_lr_ratio
        ),
    )
