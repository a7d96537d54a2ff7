"""The optimizer registry: what each optimizer keeps per parameter, and how it is built.

One source of truth for optimizer memory. The engine builds optimizers from here, ZeRO shards
their states, the planner counts their bytes and the time model their traffic, all from the same
`OptimizerSpec`, so a new optimizer (8-bit AdamW, Adafactor, SM3) is one `register_optimizer`
call and every part of memfit knows its cost.

How states shard (`sharding`):
- "elementwise": every state tensor has its parameter's shape and is updated element by element
  (AdamW's two moments, SGD's momentum, a blockwise-quantized 8-bit moment whose blocks do not
  straddle a shard boundary). ZeRO hands the optimizer flat shards of the parameters, so its
  states shard with them: stage >= 1 keeps 1/N of them per rank.
- "per_tensor": a state depends on the whole parameter tensor (Adafactor's row and column
  statistics, SM3's covers). The optimizer must see whole tensors, and ZeroOptimizer (ZeRO,
  offload, any run of several processes) hands it flat buckets: it runs on one process until
  sharding by whole parameters exists; `check_sharding` says so.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = [
    "OPTIMIZERS",
    "OptimizerSpec",
    "check_sharding",
    "get_optimizer",
    "model_state_bytes",
    "register_optimizer",
]

OptimizerFactory = Callable[..., torch.optim.Optimizer]


@dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    name: str
    state_bytes_per_param: float
    """Bytes of optimizer state per trainable parameter (AdamW: two fp32 moments, 8)."""
    update_bytes_per_param: float
    """HBM bytes one update reads and writes per parameter, for the time model (AdamW: parameter,
    gradient and two moments read, three written: 7 fp32 values, 28)."""
    embedding_state_bytes_per_param: float | None = None
    """Bytes of state per parameter of the embedding table where they differ (8-bit AdamW keeps
    embeddings in 32 bits: 8); None: state_bytes_per_param."""
    step_temporary_bytes_per_param: float = 0
    """Bytes per parameter the step allocates while it runs (torch's foreach SGD applies weight
    decay out of place: one gradient-sized fp32 temporary)."""
    sharding: Literal["elementwise", "per_tensor"] = "elementwise"
    options: tuple[str, ...] = ()
    """The `train` options it takes of beta1, beta2 and momentum (setting another is an
    error)."""
    build: OptimizerFactory
    """build(param_groups, *, lr, betas, momentum, device) -> torch.optim.Optimizer."""


OPTIMIZERS: dict[str, OptimizerSpec] = {}


def register_optimizer(spec: OptimizerSpec) -> OptimizerSpec:
    if spec.name in OPTIMIZERS:
        raise ValueError(f"optimizer {spec.name!r} is already registered")
    OPTIMIZERS[spec.name] = spec
    return spec


def get_optimizer(name: str) -> OptimizerSpec:
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; registered: {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name]


def check_sharding(
    optimizer: str, zero: int, *, offload: str = "none", world_size: int | None = None
) -> None:
    """Raise ValueError when `optimizer`'s states cannot be kept by ZeRO `zero` with `offload`
    over `world_size` processes: per-tensor states need whole tensors, and ZeroOptimizer (any
    stage over several processes, or offload) hands the optimizer flat buckets of many."""
    spec = get_optimizer(optimizer)
    if spec.sharding == "per_tensor" and (zero >= 1 or offload != "none" or (world_size or 1) > 1):
        raise ValueError(
            f"optimizer {optimizer!r} keeps per-tensor states (row and column statistics), which "
            f"need whole tensors: it runs on one process without --zero and --offload (got "
            f"--zero {zero}, --offload {offload}, {world_size or 1} process(es))"
        )


def model_state_bytes(
    num_params: int,
    *,
    optimizer: str = "adamw",
    zero: int = 0,
    world_size: int = 1,
    offload: str = "none",
    param_bytes: int = 4,
    embedding_params: int = 0,
) -> dict[str, int]:
    """Bytes per rank of the model states of data-parallel training with ZeRO `zero` over
    `world_size` ranks (Rajbhandari et al. 2020, "ZeRO", section 5), memfit's layout: the fp32
    parameters are the master weights (autocast casts them per matmul), so with P parameters,
    N ranks and s state bytes per parameter

        stage 0:  params 4P    grads 4P           optimizer sP
        stage 1:  params 4P    grads 4P + 4P/N    optimizer sP/N   (the reduce-scatter's shard)
        stage 2:  params 4P    grads 4P/N         optimizer sP/N
        stage 3:  params 4P/N  grads 4P/N         optimizer sP/N

    on the GPU; `offload="optimizer"` moves the optimizer states to the host with an fp32 master
    copy of the shard and its gradient ("host": (8 + s) x the shard, stage 0 the whole model),
    `offload="params"` (stage 3) the parameter shards too. A shard is ceil(P/N) elements; real
    buckets each pad to a multiple of N (fewer than N elements more per bucket). param_bytes: 2
    for bf16 parameters without fp32 masters (`--master-weights none`, one process): their
    gradients are bf16 too. embedding_params: how many of the P are the embedding table's,
    whose states may take other bytes (`OptimizerSpec.embedding_state_bytes_per_param`)."""
    spec = get_optimizer(optimizer)
    P = num_params
    shard = math.ceil(P / world_size)
    s = spec.state_bytes_per_param
    if spec.embedding_state_bytes_per_param is not None and P:
        s += (spec.embedding_state_bytes_per_param - s) * embedding_params / P
    if param_bytes != 4:
        return {
            "params": param_bytes * P,
            "grads": param_bytes * P,
            "optimizer_states": math.ceil(s * P),
            "host": 0,
        }
    params = 4 * (shard if zero == 3 else P)
    grads = {0: 4 * P, 1: 4 * P + 4 * shard, 2: 4 * shard, 3: 4 * shard}[zero]
    states = math.ceil(s * (P if zero == 0 else shard))
    host = 0
    if offload != "none":
        host = (8 + math.ceil(s)) * (P if zero == 0 else shard)
        states = 0
    if offload == "params":
        params = 0
    return {"params": params, "grads": grads, "optimizer_states": states, "host": host}


def _adamw(groups, *, lr, betas, momentum, device) -> torch.optim.Optimizer:
    # fused: one launch for all parameters on CUDA; on the CPU (ZeRO-Offload's step) one
    # vectorized, multi-threaded pass per tensor, 5x the foreach path without its full-size
    # temporaries (measured)
    fast = {"fused": True} if torch.device(device).type in ("cuda", "cpu") else {"foreach": True}
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=1e-8, **fast)


def _adamw8bit(groups, *, lr, betas, momentum, device) -> torch.optim.Optimizer:
    from memfit.optim.adamw8bit import AdamW8bit

    if torch.device(device).type == "cpu" and torch.cuda.is_available():
        logging.getLogger(__name__).warning(
            "adamw8bit steps on the CPU (--offload optimizer) in plain torch ops, many times "
            "slower than adamw's fused CPU kernel; its 8-bit states save GPU memory, which the "
            "offload already does: --optimizer adamw is the faster choice with offload"
        )
    # bf16 parameters (no fp32 masters) take their updates with stochastic rounding
    bf16 = any(p.dtype == torch.bfloat16 for group in groups for p in group["params"])
    # embeddings keep 32-bit states (bitsandbytes' advice: a row's moments stay stale between
    # the steps where its token occurs, and share a block's scale with rows that move)
    groups = [{**g, "states_32bit": True} if g.get("embedding") else g for g in groups]
    return AdamW8bit(groups, lr=lr, betas=betas, eps=1e-8, stochastic_rounding=bf16)


def _adafactor(groups, *, lr, betas, momentum, device) -> torch.optim.Optimizer:
    from memfit.optim.adafactor import Adafactor

    # the schedule gives an absolute lr: no relative step, no scaling by the parameter's RMS
    return Adafactor(groups, lr=lr, scale_parameter=False, relative_step=False)


def _sm3(groups, *, lr, betas, momentum, device) -> torch.optim.Optimizer:
    from memfit.optim.sm3 import SM3

    return SM3(groups, lr=lr, beta1=momentum)


def _sgd(groups, *, lr, betas, momentum, device) -> torch.optim.Optimizer:
    return torch.optim.SGD(groups, lr=lr, momentum=momentum, foreach=True)


register_optimizer(
    OptimizerSpec(
        name="adamw",
        state_bytes_per_param=8,
        update_bytes_per_param=28,
        options=("beta1", "beta2"),
        build=_adamw,
    )
)
register_optimizer(
    OptimizerSpec(
        name="adamw8bit",
        # a byte per element for each moment and an fp32 absmax per block of 256 (tensors under
        # 4096 elements keep fp32 moments: norms and biases, a negligible share)
        state_bytes_per_param=2 + 2 * 4 / 256,
        embedding_state_bytes_per_param=8,
        # parameter and gradient read and written (fp32), a byte of each moment read and written
        update_bytes_per_param=16 + 4 * 4 / 256,
        options=("beta1", "beta2"),
        build=_adamw8bit,
    )
)
# Factored statistics: a row and a column of fp32 per matrix, (R + C) x 4 bytes for R x C
# parameters: 0.002-0.004 bytes per parameter for llama's matrices (2048 x 2048 to 128256 x 2048),
# vectors a full fp32 statistic (norm weights: a negligible share). They need whole tensors.
register_optimizer(
    OptimizerSpec(
        name="adafactor",
        state_bytes_per_param=0.004,
        # three passes over the gradient (sums, clipping, update), the parameter read and written
        update_bytes_per_param=24,
        sharding="per_tensor",
        build=_adafactor,
    )
)
register_optimizer(
    OptimizerSpec(
        name="sm3",
        # row and column maxima (as Adafactor's statistics) and an fp32 momentum (train.momentum;
        # 0 drops it and its 4 bytes, which this estimate still counts)
        state_bytes_per_param=4.004,
        update_bytes_per_param=20,
        sharding="per_tensor",
        options=("momentum",),
        build=_sm3,
    )
)
register_optimizer(
    OptimizerSpec(
        name="sgd",
        state_bytes_per_param=4,
        update_bytes_per_param=16,  # parameter, gradient, momentum read; parameter, momentum written
        step_temporary_bytes_per_param=4,
        options=("momentum",),
        build=_sgd,
    )
)
