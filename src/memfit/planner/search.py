"""Strategy search: enumerate the strategies the engine can run, keep those that fit the GPU with
a safety margin, rank them by predicted tokens/s.

Enumerated: precision (bf16; fp16 where the GPU lacks bf16 is not in the catalog), activation
checkpointing none / selective / full, micro-batch 1, 2, 4, ... 64, with gradient accumulation
so that a step holds about `tokens_per_step` tokens. Single-GPU strategies only: the engine runs
ZeRO stages 0-3 and offload on several GPUs (torchrun), but the search does not enumerate them
yet, so `gpus > 1` is refused rather than answered with single-GPU strategies; `memfit plan
--gpus N --zero S [--offload ...]` plans one such strategy.
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.models.config import ModelConfig, check_seq_len
from memfit.planner.hardware import GPU
from memfit.planner.memory import MemoryPlan, Strategy, plan
from memfit.planner.time import StepTime, step_time

SAFETY_MARGIN = 0.05
"""Fraction of the GPU's memory left unplanned on top of MemoryPlan.required_bytes."""


@dataclass
class Recommendation:
    strategy: Strategy
    plan: MemoryPlan
    time: StepTime

    def why(self) -> str:
        return (
            f"fastest predicted of the strategies that fit: {self.time.tokens_per_s:,.0f} tokens/s, "
            f"peak {self.plan.peak_bytes / 2**30:.1f} GiB of {self.plan.capacity_bytes / 2**30:.1f} GiB"
        )


def rank_strategies(
    model: ModelConfig,
    gpu: GPU,
    *,
    seq_len: int = 2048,
    gpus: int = 1,
    tokens_per_step: int = 2**19,
    optimizer: str = "adamw",
    limit: int = 10,
) -> list[Recommendation]:
    """Strategies that fit `gpu` with the safety margin, fastest first (at most `limit`)."""
    if gpus != 1:
        raise ValueError(
            f"--gpus {gpus}: --recommend searches single-GPU strategies only (micro-batch, "
            "accumulation, checkpointing), not ZeRO stages or offload; plan a data-parallel run "
            f"with `memfit plan --gpus {gpus} --zero S [--offload optimizer|params]` instead"
        )
    check_seq_len(model, seq_len, "seq_len")
    # the optimizer asked for first; where nothing fits with AdamW, its memory-lean forms: 8-bit
    # states (6 bytes per parameter fewer), then bf16 weights without fp32 masters (4 more)
    tries = [(optimizer, "fp32")]
    if optimizer == "adamw":
        tries += [("adamw8bit", "fp32"), ("adamw8bit", "none")]
    for name, master_weights in tries:
        found = _search(model, gpu, seq_len, tokens_per_step, name, master_weights)
        if found:
            break
    found.sort(key=lambda r: r.time.tokens_per_s, reverse=True)
    return found[:limit]


def _search(
    model: ModelConfig,
    gpu: GPU,
    seq_len: int,
    tokens_per_step: int,
    optimizer: str,
    master_weights: str,
) -> list[Recommendation]:
    budget = gpu.memory_bytes * (1 - SAFETY_MARGIN)
    found = []
    # (activation offload after each checkpointing mode alone: at equal predicted speed the
    # one without it ranks first)
    modes = [("none", False), ("none", True), ("selective", False), ("selective", True)]
    for checkpointing, offload_activations in [*modes, ("full", False), ("full", True)]:
        micro_batch = 1
        while micro_batch <= 64:
            grad_accum = max(1, tokens_per_step // (micro_batch * seq_len))
            strategy = Strategy(
                precision="bf16",
                micro_batch=micro_batch,
                seq_len=seq_len,
                grad_accum=grad_accum,
                checkpointing=checkpointing,
                offload_activations=offload_activations,
                optimizer=optimizer,
                master_weights=master_weights,
            )
            memory = plan(model, strategy, gpu)
            if memory.required_bytes > budget:
                break  # larger micro-batches need more still
            found.append(Recommendation(strategy, memory, step_time(model, strategy, gpu)))
            micro_batch *= 2
    return found


def recommend(model: ModelConfig, gpu: GPU, **options) -> list[Strategy]:
    """The strategies of `rank_strategies`, fastest first (DESIGN.md's `memfit.recommend`)."""
    return [r.strategy for r in rank_strategies(model, gpu, **options)]
