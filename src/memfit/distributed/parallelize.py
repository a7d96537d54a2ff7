"""The techniques the engine applies to a plain model, in one documented order (torchtitan's
`parallelize_llama` habit):

    1. activation checkpointing   each block recomputes its activations in backward (with
                                  activation offload: its input goes to CPU memory)
    2. torch.compile              each block's forward (not its call: module hooks stay outside)
       activation offload         without checkpointing: saved-tensor hooks around the compiled
                                  forward move the block's large saved tensors to CPU memory
       fp32 parts                 the blocks (and ends) kept in fp32 compute run all of the
                                  above with autocast off (memfit.train.precision), so that
                                  a compiled graph's backward and a rerun are fp32 too
    3. parameter sharding         ZeRO-3: module hooks around each block's call gather and
                                  release its parameters (distributed.sharding)

Each later technique wraps the earlier ones without knowing them: compile traces the
checkpointed forward, the sharding hooks run around the compiled one. The optimizer side (ZeRO's
gradient reduction and step, offload) is built after this, over the same parameter groups. A new
technique that transforms the model (tensor parallelism: before compile; a LoRA wrap: before
checkpointing) is a new step here, not a branch in the engine.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from memfit.config import Fp32Parts
from memfit.distributed.sharding import ShardedParameters, shard_parameters
from memfit.train.checkpointing import (
    CheckpointingMode,
    apply_activation_checkpointing,
    offload_saved_tensors,
)
from memfit.train.offload import ActivationOffload
from memfit.train.precision import apply_fp32_parts


def apply_compile(model: nn.Module) -> None:
    """Compile each block's forward. Inductor fuses the elementwise work (norms, RoPE, SwiGLU,
    residual adds) into a few kernels; blocks share one compiled graph (same code, same shapes).
    The forward is compiled, not the module's call, so module hooks (ZeRO-3's gathers) run
    around the compiled code instead of being traced into it."""
    for block in model.layers:
        block.forward = torch.compile(block.forward)


def compiles_blocks(
    compile: str, device: torch.device, checkpointing: str, checkpoint_blocks: int | None = None
) -> bool:
    """Whether `--compile` compiles the blocks. auto: on CUDA when no block is checkpointed
    (with some checkpointed, none is compiled).
    Compiled checkpointed blocks kept more memory than eager ones in our H100 measurements
    (llama-1b, micro-batch 8, full: 19.8 vs 15.4 GiB peak), while eager with memfit's kernels was
    within 3-12% of their speed (BENCHMARKS.md); --compile on still compiles them."""
    return compile == "on" or (
        compile == "auto"
        and device.type == "cuda"
        and (checkpointing == "none" or checkpoint_blocks == 0)
    )


def parallelize(
    model: nn.Module,
    *,
    checkpointing: CheckpointingMode,
    checkpoint_blocks: int | None = None,
    compile: bool,
    zero: int,
    param_groups: list[dict],
    param_dtype: torch.dtype,
    offload_params: bool = False,
    process_group: dist.ProcessGroup | None = None,
    offload_activations: ActivationOffload | None = None,
    fp32_parts: Fp32Parts | None = None,
) -> ShardedParameters | None:
    """Apply the techniques to `model` in place, in the order of the module docstring. Returns
    the ZeRO-3 sharding (for the optimizer side), or None below stage 3."""
    offload_saved = offload_activations if checkpointing == "none" else None
    apply_activation_checkpointing(
        model,
        checkpointing,
        offload=None if offload_saved else offload_activations,
        blocks=checkpoint_blocks,
    )
    if compile:
        apply_compile(model)
    if offload_saved is not None:  # (around the compiled forward: memfit.train.checkpointing)
        offload_saved_tensors(model, offload_saved)
    if fp32_parts:
        apply_fp32_parts(model, fp32_parts)
    if zero != 3:
        return None
    # each block is gathered on its own; the rest (embedding, final norm, output) with the model,
    # in the compute dtype (autocast then casts nothing)
    return shard_parameters(
        model,
        units=list(model.layers),
        param_groups=param_groups,
        process_group=process_group,
        param_dtype=param_dtype,
        offload_params=offload_params,
    )
