"""Mixed precision: autocast contexts, fp32 parts, and the dynamic loss scaler for fp16.

- fp32: no autocast.
- bf16: torch.autocast to bfloat16 with fp32 master weights (the parameters stay fp32; the
  optimizer updates them; bf16 has fp32's exponent range, so no loss scaling is needed).
- fp16: autocast to float16 with fp32 master weights and dynamic loss scaling (Micikevicius et
  al. 2018, "Mixed Precision Training", section 3.2): the loss is multiplied by a scale S before
  backward so small gradients survive fp16's range; gradients are unscaled before clipping and
  the step; a step whose gradients hold inf/NaN is skipped (weights and optimizer untouched) and
  S is multiplied by `backoff_factor`; after `growth_interval` clean steps S grows by
  `growth_factor`.
- fp32 parts (`--fp32-parts head,first:N,last:N`, `apply_fp32_parts`): under bf16 or fp16 those
  parts compute in fp32 from the fp32 master weights, autocast off, as precision-sensitive ends
  of a model are kept in higher precision (Megatron-LM's bf16 first and last layers under fp8,
  transformers' `_keep_in_fp32_modules`). Between two fp32 parts the residual stream stays fp32
  (the embedding's rows enter fp32 first blocks unrounded); a block in the compute dtype rounds
  what it takes. Their cost: fp32 products run at a fraction of the bf16 rate, their activations
  take twice the bytes, and no bf16 weight copies are made for them (memfit.planner prices it).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterable

import torch
import torch.nn as nn
from torch import Tensor

from memfit.config import Fp32Parts
from memfit.distributed.launch import agree

logger = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_precision(precision: str, device: torch.device) -> str:
    """'auto' becomes bf16 on a CUDA device that supports it, else fp32."""
    if precision != "auto":
        if precision == "fp16" and device.type == "cpu":
            logger.warning(
                "fp16 on CPU is slow and meant for testing; bf16 or fp32 is faster there"
            )
        return precision
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return "bf16"
    return "fp32"


def autocast(
    precision: str, device: torch.device, *, cache: bool = True
) -> contextlib.AbstractContextManager:
    """`precision`'s autocast on `device` (none for fp32); cache=False: no cache of cast weights
    (a step captured in a CUDA graph, memfit.train.graphs)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[precision], cache_enabled=cache)


def apply_fp32_parts(model: nn.Module, parts: Fp32Parts) -> nn.Module:
    """Make `parts` of `model` (a memfit decoder: `embed_tokens`, `layers`, `output`) compute in
    fp32 under autocast, in place: each fp32 block's forward (and with first:N the embedding's)
    runs with autocast off on its input in fp32, and so does `output` with head; a block in the
    compute dtype right after an fp32 one rounds its input to that dtype. Like activation
    checkpointing, the wrapper replaces the instance's forward: the module tree and state_dict
    are unchanged. Apply it after checkpointing and compile, around them: a compiled graph
    traced inside autocast would trace its backward with autocast on (bf16 gradients of an
    fp32 block), and a checkpoint then keeps the block's input in the block's precision."""
    if not parts:
        return model
    layers = list(model.layers)
    fp32 = set(parts.blocks(len(layers)))
    if 0 in fp32:
        model.embed_tokens = functools.partial(_in_fp32, model.embed_tokens)
    for index, block in enumerate(layers):
        if index in fp32:
            block.forward = functools.partial(_in_fp32, block.forward)
        elif index - 1 in fp32:
            block.forward = functools.partial(_in_compute_dtype, block.forward)
    if parts.head:
        model.output = functools.partial(_in_fp32, model.output)
    return model


def _in_fp32(forward, x: Tensor, *args, **kwargs):
    """forward(x, ...) with autocast off, a floating x in fp32 (token ids stay ids)."""
    if x.is_floating_point():
        x = x.float()
    with torch.autocast(x.device.type, enabled=False):
        return forward(x, *args, **kwargs)


def _in_compute_dtype(forward, x: Tensor, *args, **kwargs):
    """forward(x, ...) with x rounded to the autocast dtype (an fp32 part's output)."""
    if torch.is_autocast_enabled(x.device.type):
        x = x.to(torch.get_autocast_dtype(x.device.type))
    return forward(x, *args, **kwargs)


class DynamicLossScaler:
    """Loss scaling for fp16 training. Use:

    scaler.scale(loss).backward()
    if scaler.unscale_and_check(params):   # False: inf/NaN found, skip the step
        optimizer.step()
    scaler.update()
    """

    def __init__(
        self,
        *,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float = 1.0,
        enabled: bool = True,
    ) -> None:
        self.scale_value = float(init_scale) if enabled else 1.0
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self.enabled = enabled
        self.clean_steps = 0
        self.found_inf = False
        self.skipped_steps = 0

    def scale(self, loss: Tensor) -> Tensor:
        return loss * self.scale_value if self.enabled else loss

    @torch.no_grad()
    def unscale_and_check(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """Divide gradients by the scale in place; return False if any is inf or NaN.

        One fused multiply and one finiteness reduction over all gradients (foreach kernels),
        then a single host sync for the decision."""
        return self.unscale_and_check_grads([p.grad for p in params if p.grad is not None])

    @torch.no_grad()
    def unscale_and_check_grads(self, grads: list[Tensor], *, across_ranks: bool = False) -> bool:
        """unscale_and_check on gradient tensors themselves (e.g. ZeRO's flat shards). With
        across_ranks, an overflow on any rank of the process group counts on all of them, so
        that every rank skips the same steps and keeps the same scale."""
        if not self.enabled:
            self.found_inf = False
            return True
        found = torch.zeros((), dtype=torch.bool, device=grads[0].device if grads else "cpu")
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scale_value)
            norms = torch._foreach_norm(grads, float("inf"))
            found = ~torch.isfinite(torch.stack(norms)).all()
        if across_ranks:
            found = agree(found)
        self.found_inf = bool(found)
        return not self.found_inf

    def update(self) -> None:
        """Back off after an overflow, grow after `growth_interval` clean steps."""
        if not self.enabled:
            return
        if self.found_inf:
            self.scale_value = max(self.scale_value * self.backoff_factor, self.min_scale)
            self.clean_steps = 0
            self.skipped_steps += 1
            logger.info(
                "fp16 overflow: step skipped, loss scale backed off to %g", self.scale_value
            )
        else:
            self.clean_steps += 1
            if self.clean_steps >= self.growth_interval:
                self.scale_value *= self.growth_factor
                self.clean_steps = 0
        self.found_inf = False

    def state_dict(self) -> dict[str, float | int]:
        return {
            "scale": self.scale_value,
            "clean_steps": self.clean_steps,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale_value = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
