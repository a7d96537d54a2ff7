"""Strategy search: enumerate the strategies the engine can run, keep those that fit the GPU with
a safety margin, rank them by predicted tokens/s.

Enumerated: precision (bf16; fp16 where the GPU lacks bf16 is not in the catalog), the layout of
the training state over the `gpus` data-parallel GPUs (ZeRO stage 0-3, the optimizer's state or
also the parameters offloaded to CPU memory: every pair `check_parallelism` accepts for that
optimizer and GPU count; on one GPU, none, optimizer offload and stage 3 with parameter
offload), activation checkpointing none / selective / full, each also with activation offload,
and where a micro-batch fits with checkpointing but not without, checkpointing of only as many
blocks as it needs to fit (the fewest: the least recompute), micro-batch 1, 2, 4, ... 64 (none
larger than a step's tokens), with gradient accumulation so that a step of all the GPUs holds
about `tokens_per_step` tokens.
The optimizer asked for is searched first; only where nothing fits with it do the memory-lean
optimizers follow, in order (8-bit AdamW, the same without fp32 master weights, Adafactor, SM3),
since they train differently and are not to be traded for speed alone.

A strategy trains the whole model or, with LoRA fields (`lora_rank`, `quantize_base`: QLoRA),
adapters on a frozen base, and may distill from a teacher (`teacher`): `rank_strategies` keeps
those fields as given (what `memfit train --auto` runs: the configuration's goal, never another),
`rank_goals` ranks each goal apart (full fine-tuning, LoRA, QLoRA), since they train different
things and are not to be compared by speed alone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

from memfit.models.config import ModelConfig, check_seq_len
from memfit.planner.hardware import GPU
from memfit.planner.memory import MemoryPlan, Strategy, fewest_checkpointed_blocks, plan
from memfit.planner.time import StepTime, host_share, step_time

LORA_RANK = 16
"""The adapters' rank `rank_goals` plans LoRA and QLoRA with unless told (peft's examples, the
benchmarks)."""

SAFETY_MARGIN = 0.05
"""Fraction of the GPU's memory left unplanned on top of MemoryPlan.required_bytes."""

HOST_PINNED_FRACTION = 0.5
"""Of the host's memory, the most that a strategy may pin (activation offload, offload's CPU
state): pinned pages cannot be swapped out, and the process, the data and the OS need the rest."""


def host_memory_bytes() -> int | None:
    """This machine's physical memory (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


@dataclass
class Recommendation:
    strategy: Strategy
    plan: MemoryPlan
    time: StepTime
    reasons: str = ""
    """Why it is listed: its place against the first, and what each of its choices buys (the
    memory the strategy without it would need); `rank_strategies` fills it in."""

    def why(self) -> str:
        head = (
            f"{self.time.tokens_per_s:,.0f} tokens/s, peak {self.plan.peak_bytes / 2**30:.1f} "
            f"GiB of {self.plan.capacity_bytes / 2**30:.1f} GiB"
        )
        return f"{head}: {self.reasons}" if self.reasons else head


GRAPHS_GAIN = 0.05
"""A strategy the engine can capture is listed captured (`--cuda-graphs`) where the time model
puts that at least this much faster than its eager step (the host sets that one's pace), or
where the eager step's host launches take GRAPHS_HOST_SHARE of the GPU's time or more."""
GRAPHS_HOST_SHARE = 0.5
"""From this share of the GPU's time (memfit.planner.time.host_share) the eager step's host
launches set its pace on a slower host (their speed varied 2x between machines of one kind):
held-out steps at 68-70% on an H100 ran up to 12.3% slower than the time model eager (within 6%
captured, on an H200), those at 41-49% within 7% eager (BENCHMARKS.md, the time model)."""


def rank_strategies(
    model: ModelConfig,
    gpu: GPU,
    *,
    seq_len: int = 2048,
    gpus: int = 1,
    tokens_per_step: int = 2**19,
    optimizer: str = "adamw",
    limit: int = 10,
    host_memory: int | None = None,
    **fine_tuning: Any,
) -> list[Recommendation]:
    """Strategies that fit each of `gpus` GPUs of type `gpu` with the safety margin, fastest
    first (at most `limit`), pinning at most HOST_PINNED_FRACTION of `host_memory` bytes
    (default: this machine's; offload's and activation offload's, each GPU's share).
    fine_tuning: Strategy fields every strategy keeps (lora_rank, lora_targets, lora_dropout,
    quantize_base, teacher, teacher_quantize, distill_kind, distill_temperature): LoRA or QLoRA
    search those, with `optimizer` over the adapters; full fine-tuning falls back to memory-lean
    optimizers where nothing fits."""
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus}")
    check_seq_len(model, seq_len, "seq_len")
    # the optimizer asked for first; where nothing fits with AdamW, its memory-lean forms: 8-bit
    # states (6 bytes per parameter fewer), then bf16 weights without fp32 masters (4 more, one
    # GPU only), then the factored optimizers' states of about one row and column a matrix
    # (LoRA's states are a few MB: its adapters keep fp32 weights and the optimizer asked for)
    tries = [(optimizer, "fp32")]
    if optimizer == "adamw" and not fine_tuning.get("lora_rank"):
        tries += [("adamw8bit", "fp32"), ("adamw8bit", "none"), ("adafactor", "fp32")]
        tries += [("sm3", "fp32")]
    host = host_memory if host_memory is not None else host_memory_bytes()
    pinned = int(host * HOST_PINNED_FRACTION) if host else None
    for name, master_weights in tries:
        found = _search(
            model, gpu, gpus, seq_len, tokens_per_step, name, master_weights, fine_tuning, pinned
        )
        if found:
            break
    found.sort(key=lambda r: r.time.tokens_per_s, reverse=True)
    budget = gpu.memory_bytes * (1 - SAFETY_MARGIN)
    for r in found[:limit]:
        r.reasons = _reasons(model, gpu, r, found[0], budget, optimizer)
    return found[:limit]


def _reasons(
    model: ModelConfig,
    gpu: GPU,
    r: Recommendation,
    first: Recommendation,
    budget: float,
    asked: str,
) -> str:
    """Why `r` is listed: its place against `first`, and for each of its choices that the plain
    strategy (AdamW, stage 0, nothing offloaded, no checkpointing) would not make, the memory
    that strategy without it would need, where that is over the budget."""
    s = r.strategy
    said = []
    if r is first:
        said.append("the fastest predicted")
    else:
        slower = 1 - r.time.tokens_per_s / first.time.tokens_per_s
        saved = first.plan.peak_bytes - r.plan.peak_bytes
        said.append(
            f"{slower:.1%} slower than the first"
            + (f", {saved / 2**30:.1f} GiB less memory" if saved > 2**30 / 10 else "")
        )

    def without(**changes) -> str | None:
        try:
            need = plan(model, replace(s, **changes), gpu).required_bytes
        except ValueError:
            return None
        return f"{need / 2**30:.1f} GiB" if need > budget else None

    if s.optimizer != asked:
        said.append(f"{s.optimizer}: nothing fits with {asked}")
    if s.master_weights == "none":
        said.append("bf16 weights: nothing fits with fp32 masters")
    if s.zero or s.offload != "none":
        need = without(zero=0, offload="none")
        layout = f"ZeRO-{s.zero}" + (f" with {s.offload} offload" if s.offload != "none" else "")
        if need:
            said.append(f"{layout}: stage 0 on the GPU needs {need}")
        else:  # (it fits at stage 0 too: the trade)
            plain = replace(s, zero=0, offload="none")
            more = plan(model, plain, gpu).peak_bytes - r.plan.peak_bytes
            faster = r.time.total_s / step_time(model, plain, gpu).total_s - 1
            said.append(
                f"{layout}: {more / 2**30:.1f} GiB less than stage 0, whose step the time "
                f"model puts {abs(faster):.1%} {'shorter' if faster > 0 else 'longer'}"
            )
    if s.checkpointing != "none":
        need = without(checkpointing="none", checkpoint_blocks=None, offload_activations=False)
        blocks = (
            f" on the fewest blocks that fit ({s.checkpoint_blocks} of {model.num_layers})"
            if s.checkpoint_blocks is not None
            else ""
        )
        if need:
            said.append(f"{s.checkpointing} checkpointing{blocks}: without it {need}")
    if s.offload_activations:
        need = without(offload_activations=False)
        if need:
            said.append(f"activations in host memory: on the GPU {need}")
    if s.cuda_graphs:
        eager = replace(s, cuda_graphs=False)
        longer = step_time(model, eager, gpu).total_s / r.time.total_s - 1
        if longer >= GRAPHS_GAIN:
            said.append(
                f"captured in a CUDA graph: the eager step, whose pace the host sets, "
                f"{longer:.0%} longer"
            )
        else:
            said.append(
                f"captured in a CUDA graph: the eager step's host launches take "
                f"{host_share(model, eager, gpu):.0%} of the GPU's time, and set its pace on a "
                "slower host"
            )
    if s.micro_batch < 64:
        larger = without(micro_batch=s.micro_batch * 2, grad_accum=max(1, s.grad_accum // 2))
        if larger and s.grad_accum > 1:
            said.append(f"micro-batch {s.micro_batch * 2} would need {larger}")
    return "; ".join(said)


def rank_goals(
    model: ModelConfig,
    gpu: GPU,
    *,
    goals: tuple[str, ...] = ("full", "lora", "qlora"),
    lora_rank: int = LORA_RANK,
    quantize: str = "nf4",
    limit: int = 5,
    **options: Any,
) -> dict[str, list[Recommendation]]:
    """`rank_strategies` for each of `goals`: "full" (every weight trains), "lora" (adapters of
    `lora_rank` on a base in the compute dtype), "qlora" (the same on a base stored as
    `quantize`), keyed by the strategies' `Strategy.goal` label ("full", "LoRA r16", "QLoRA nf4
    r16"), each fastest first; a goal nothing fits maps to []. options: rank_strategies'
    (seq_len, gpus, tokens_per_step, optimizer) and the fields each goal keeps (lora_targets,
    lora_dropout, teacher, ...)."""
    unknown = [g for g in goals if g not in ("full", "lora", "qlora")]
    if unknown:
        raise ValueError(f"unknown goal {unknown[0]!r}: choose among full, lora, qlora")
    found = {}
    for goal in goals:
        fields: dict[str, Any] = dict(options)
        if goal == "full":
            for name in ("lora_targets", "lora_dropout"):
                fields.pop(name, None)
        else:
            fields["lora_rank"] = lora_rank
            fields["quantize_base"] = quantize if goal == "qlora" else "none"
        label = Strategy(
            lora_rank=fields.get("lora_rank", 0), quantize_base=fields.get("quantize_base", "none")
        ).goal
        found[label] = rank_strategies(model, gpu, limit=limit, **fields)
    return found


def layouts(gpus: int, optimizer: str = "adamw", **fields: Any) -> list[tuple[int, str]]:
    """The (ZeRO stage, offload) pairs the engine runs `optimizer` with on `gpus` GPUs, in the
    order the search prefers at equal speed (less sharding and offload first); fields: other
    Strategy fields that restrict them (lora_rank: no stage 3, no offload)."""
    if gpus == 1:  # (stages 1 and 2 shard nothing on one GPU: stage 0 with offload is the same)
        pairs = [(0, "none"), (0, "optimizer"), (3, "params")]
    else:
        pairs = [(z, o) for o in ("none", "optimizer") for z in range(4)] + [(3, "params")]
    kept = []
    for zero, offload in pairs:
        try:
            Strategy(zero=zero, offload=offload, optimizer=optimizer, world_size=gpus, **fields)
        except ValueError:
            continue
        kept.append((zero, offload))
    return kept


def _search(
    model: ModelConfig,
    gpu: GPU,
    gpus: int,
    seq_len: int,
    tokens_per_step: int,
    optimizer: str,
    master_weights: str,
    fine_tuning: dict[str, Any],
    pinned: int | None,
) -> list[Recommendation]:
    budget = gpu.memory_bytes * (1 - SAFETY_MARGIN)
    found = []
    # (activation offload after each checkpointing mode alone: at equal predicted speed the
    # one without it ranks first)
    modes = [("none", False), ("none", True), ("selective", False), ("selective", True)]
    fields = {"master_weights": master_weights, **fine_tuning}
    for zero, offload in layouts(gpus, optimizer, **fields):  # (masters "none": one layout)
        for checkpointing, offload_activations in [*modes, ("full", False), ("full", True)]:
            micro_batch = 1
            # (a micro-batch past the step's tokens would train on more than were asked for)
            while micro_batch <= 64 and (
                micro_batch == 1 or micro_batch * seq_len * gpus <= tokens_per_step
            ):
                grad_accum = max(1, tokens_per_step // (micro_batch * seq_len * gpus))
                strategy = Strategy(
                    precision="bf16",
                    micro_batch=micro_batch,
                    seq_len=seq_len,
                    grad_accum=grad_accum,
                    checkpointing=checkpointing,
                    offload_activations=offload_activations,
                    optimizer=optimizer,
                    zero=zero,
                    offload=offload,
                    world_size=gpus,
                    **fields,
                )
                memory = plan(model, strategy, gpu)
                if memory.required_bytes > budget or (pinned and memory.host_bytes > pinned):
                    break  # larger micro-batches need more still
                found.append(Recommendation(strategy, memory, step_time(model, strategy, gpu)))
                micro_batch *= 2
    # where a micro-batch fits with a checkpointing mode but not without: that mode on only as
    # many blocks as it needs
    for r in list(found):
        partial = fewest_checkpointed_blocks(model, r.strategy, gpu, budget=budget)
        if partial is not None:
            memory = plan(model, partial, gpu)
            found.append(Recommendation(partial, memory, step_time(model, partial, gpu)))
    # the step captured in a CUDA graph where the engine captures it and the host sets (or on
    # a slower host would set) the eager step's pace: the same memory, the host's launches out
    # of the step
    for index, r in enumerate(found):
        if capture_refusal(r.strategy) is None:
            graphed = replace(r.strategy, cuda_graphs=True)
            time = step_time(model, graphed, gpu)
            faster = time.total_s < (1 - GRAPHS_GAIN) * r.time.total_s
            if faster or host_share(model, r.strategy, gpu) >= GRAPHS_HOST_SHARE:
                found[index] = Recommendation(graphed, r.plan, time)
    return found


def capture_refusal(strategy: Strategy) -> str | None:
    """Why the engine cannot capture this strategy's step in a CUDA graph (`--cuda-graphs`,
    memfit.train.graphs), or None where it can: the one rule the engine and the search share.
    The step must read nothing back on the host and talk to no other rank or to the CPU."""
    s = strategy
    if s.precision == "fp16":
        return (
            "fp16's dynamic loss scaling decides on the host whether a step is skipped; use "
            "--precision bf16"
        )
    if s.world_size > 1 or s.zero or s.offload != "none":
        return "ZeRO, data parallelism and offload talk to other ranks or the CPU inside the step"
    if s.offload_activations:
        return "--offload-activations copies to and from the CPU inside the step"
    if s.teacher is not None:
        return "distillation is not captured yet"
    if s.optimizer != "adamw":  # (the registry's adamw is torch's fused AdamW on a GPU)
        return (
            f"only the fused AdamW (--optimizer adamw) updates inside a graph; this run has "
            f"--optimizer {s.optimizer}"
        )
    return None


def choose_checkpointing(
    model: ModelConfig, strategy: Strategy, gpu: GPU, *, budget: float | None = None
) -> tuple[Strategy, str]:
    """`--checkpointing auto`: `strategy` with the checkpointing that the time model puts fastest
    among those whose MemoryPlan.required_bytes fit `budget` (default: the GPU's memory less
    SAFETY_MARGIN): none, selective or full on every block, or selective or full on only as many
    of the first blocks as it takes to fit (`fewest_checkpointed_blocks`: the least recompute).
    Where none fits, full on every block (the leanest; the engine's preflight then says what
    would fit). Returns the strategy and a line saying why."""
    if budget is None:
        budget = gpu.memory_bytes * (1 - SAFETY_MARGIN)
    base = replace(strategy, checkpointing="none", checkpoint_blocks=None)
    candidates = [base]
    for mode in ("selective", "full"):
        whole = replace(base, checkpointing=mode)
        candidates.append(whole)
        fewest = fewest_checkpointed_blocks(model, whole, gpu, budget=budget)
        if fewest is not None:
            candidates.append(fewest)
    needs = [plan(model, c, gpu).required_bytes for c in candidates]
    fitting = [i for i, need in enumerate(needs) if need <= budget]
    if not fitting:
        full = replace(base, checkpointing="full")
        return full, (
            f"nothing fits {budget / 2**30:.1f} GiB of the {gpu.name} (full checkpointing of "
            f"every block needs {plan(model, full, gpu).required_bytes / 2**30:.1f} GiB): full "
            "checkpointing, the leanest"
        )
    times = {i: step_time(model, candidates[i], gpu).total_s for i in fitting}
    # (the fastest; at equal time the first listed: the less checkpointed)
    chosen = min(fitting, key=lambda i: (times[i], i))
    best = candidates[chosen]
    if best.checkpointing == "none":
        why = "it fits without"
    else:
        why = (
            f"none needs {needs[0] / 2**30:.1f} GiB"
            if needs[0] > budget
            else "the time model puts it faster than none"
        )
        full = next(
            i for i, c in enumerate(candidates)
            if c.checkpointing == "full" and c.checkpoint_blocks is None
        )  # fmt: skip
        if chosen != full and full in times:
            why += f"; {times[full] / times[chosen] - 1:.0%} faster than full on every block"
    tokens_per_s = best.micro_batch * best.seq_len * best.grad_accum / times[chosen]
    return best, (
        f"{_checkpointing_label(model, best)}: {needs[chosen] / 2**30:.1f} of "
        f"{budget / 2**30:.1f} GiB on the {gpu.name}, {tokens_per_s:,.0f} tokens/s predicted "
        f"({why})"
    )


def _checkpointing_label(model: ModelConfig, strategy: Strategy) -> str:
    if strategy.checkpointing == "none":
        return "no checkpointing"
    if strategy.checkpoint_blocks is None:
        return f"{strategy.checkpointing} checkpointing of every block"
    return (
        f"{strategy.checkpointing} checkpointing of the first {strategy.checkpoint_blocks} of "
        f"{model.num_layers} blocks"
    )


def recommend(model: ModelConfig, gpu: GPU, **options) -> list[Strategy]:
    """The strategies of `rank_strategies`, fastest first (DESIGN.md's `memfit.recommend`)."""
    return [r.strategy for r in rank_strategies(model, gpu, **options)]
