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
With `offload`, each block's input (full, selective), or without checkpointing each large tensor
the block saves, goes to pinned CPU memory during the forward and comes back one block ahead in
the backward (memfit.train.offload).

`blocks` checkpoints only the first N blocks (Megatron-LM's "block" recompute method): the others
keep their activations, so the recompute shrinks by (L - N)/L for (L - N) blocks' activations of
memory. The first ones, because the backward frees the unchecked blocks' activations before any
checkpointed block reruns: the step's peak is then the end of the forward, not a rerun beside
every stored block. The planner (memfit.planner) prices each N.
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
from memfit.train.offload import ActivationOffload

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


def _checkpointed(
    forward, mode: CheckpointingMode, offload: ActivationOffload | None, *args, **kwargs
):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    options = {"use_reentrant": False}
    if mode == "selective":
        options["context_fn"] = functools.partial(
            create_selective_checkpoint_contexts, _save_attention
        )
    if offload is None or not args or not isinstance(args[0], torch.Tensor):
        return checkpoint(forward, *args, **options, **kwargs)
    # The block input goes to CPU memory: the checkpoint must not hold it, so it is not one of
    # the checkpoint's arguments. The first call (the forward) runs on the tensor itself, whose
    # autograd graph the gradient follows; the recompute runs on the copy taken back, which only
    # supplies the values that the backward's saved tensors need. It is taken back when the
    # backward reaches the block's output, before the recompute starts: no copy runs inside the
    # recompute (selective checkpointing replays the forward's ops there, and only those).
    first, back = [args[0]], []
    saved = offload.offload(args[0])

    def run(*rest, **kw):
        x = first.pop() if first else (back.pop() if back else offload.take(saved))
        return forward(x, *rest, **kw)

    out = checkpoint(run, *args[1:], **options, **kwargs)
    if isinstance(out, torch.Tensor) and out.grad_fn is not None:
        out.grad_fn.register_prehook(lambda grads: back.append(offload.take(saved)))
    return out


def apply_activation_checkpointing(
    model: nn.Module,
    mode: CheckpointingMode,
    *,
    offload: ActivationOffload | None = None,
    blocks: int | None = None,
) -> nn.Module:
    """Make each block of `model.layers` (or the first `blocks` of them) recompute its
    activations in backward, in place; `offload`: the block inputs (or, with mode none, the
    blocks' large saved tensors) go to CPU memory meanwhile (memfit.train.offload).

    The module tree and state_dict are unchanged (the wrapper replaces the instance's forward),
    so checkpoints load with or without it."""
    if mode not in ("none", "full", "selective"):
        raise ValueError(
            f"activation checkpointing mode {mode!r} is not one of none, full, selective"
        )
    layers = len(model.layers)
    if blocks is not None and not 0 <= blocks <= layers:
        raise ValueError(f"checkpoint blocks = {blocks}: the model has {layers} blocks")
    if blocks is not None and offload is not None and blocks < layers:
        raise ValueError("activation offload checkpoints every block or none, not some")
    for block in list(model.layers)[: layers if blocks is None else blocks]:
        if mode != "none":
            block.forward = functools.partial(_checkpointed, block.forward, mode, offload)
    if mode == "none" and offload is not None:
        offload_saved_tensors(model, offload)
    return model


def offload_saved_tensors(model: nn.Module, offload: ActivationOffload) -> nn.Module:
    """Without checkpointing: each block's large saved tensors go to CPU memory (a saved-tensor
    hook around the block's forward). Apply it after torch.compile: the hooks then act on the
    compiled block's saved tensors at run time (inside a compiled frame they would be traced
    away)."""
    for block in model.layers:
        block.forward = functools.partial(_offloaded, block, block.forward, offload)
    return model


def _offloaded(block: nn.Module, forward, offload: ActivationOffload, *args, **kwargs):
    """A block without checkpointing whose large saved tensors go to CPU memory; its parameters,
    buffers and the arguments after its input (rotary tables and the like, which every block
    shares) stay."""
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    shared = [*block.parameters(), *block.buffers(), *args[1:], *kwargs.values()]
    keep = {t.untyped_storage().data_ptr() for t in shared if isinstance(t, torch.Tensor)}
    pack = functools.partial(offload.pack, offload.begin_block(), keep)
    with torch.autograd.graph.saved_tensors_hooks(pack, offload.unpack):
        return forward(*args, **kwargs)
