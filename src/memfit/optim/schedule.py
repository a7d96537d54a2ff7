"""Parameter groups, the configured optimizer (built from the registry), the learning-rate
schedule and the default peak learning rate by model size. Weight decay applies to matrices and
embeddings only, not to norm weights or biases.
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
    `device` (the CPU for ZeRO-Offload's step). train.lr must be set (the engine sets one by
    the model's size, `default_lr`, when the config leaves it None)."""
    if train.lr is None:
        raise ValueError("train.lr is None: set it, or take default_lr(the model's parameters)")
    return get_optimizer(train.optimizer).build(
        groups,
        lr=train.lr,
        betas=(train.beta1, train.beta2),
        momentum=train.momentum,
        device=device,
    )


def default_lr(num_params: int) -> float:
    """The peak learning rate a run takes when none is given: 3e-3 up to a million parameters
    (the tiny preset), then falling as the cube root of the size: 6e-4 at 125M, 3e-4 at 1B,
    2e-4 at 3B, 1.5e-4 at 8B, 7e-5 at 70B. Published pretraining runs sit on this curve (GPT-3:
    6e-4 at 125M, 2e-4 at 1.3B, 1.2e-4 at 6.7B; Pythia-1B and TinyLlama 3e-4 and 4e-4); a
    larger model takes smaller steps, and 3e-3 makes a 3B model diverge in its first steps."""
    return 3e-3 / max(1.0, num_params / 1e6) ** (1 / 3)


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
