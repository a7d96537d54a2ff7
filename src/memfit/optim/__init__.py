"""Optimizers: the registry (state bytes, sharding, builder: read by the engine, ZeRO and the
planner), the single-process optimizer driver, parameter groups and the LR schedule."""

from memfit.optim.local import LocalOptimizer
from memfit.optim.registry import (
    OPTIMIZERS,
    OptimizerSpec,
    check_sharding,
    get_optimizer,
    model_state_bytes,
    register_optimizer,
)
from memfit.optim.schedule import (
    build_scheduler,
    default_lr,
    lr_multiplier,
    make_optimizer,
    parameter_groups,
)

__all__ = [
    "OPTIMIZERS",
    "LocalOptimizer",
    "OptimizerSpec",
    "build_scheduler",
    "check_sharding",
    "default_lr",
    "get_optimizer",
    "lr_multiplier",
    "make_optimizer",
    "model_state_bytes",
    "parameter_groups",
    "register_optimizer",
]
