"""What the planner says of a run before it starts and when it runs out of memory: its size
against the GPU's and the single changes that would make it fit (`what_would_fit`)."""

from __future__ import annotations

from memfit.models.config import ModelConfig
from memfit.planner.hardware import GPU
from memfit.planner.memory import Strategy, plan, what_would_fit

# The planner's peaks are within about 5% of measured ones (BENCHMARKS.md): a run it puts this
# far over the GPU is refused before anything is allocated; one over but closer gets a warning.
PREFLIGHT_REFUSE = 1.25


def planner_advice(
    model_config: ModelConfig, strategy: Strategy, gpu: GPU
) -> tuple[int, list[str]]:
    """The bytes per GPU the planner puts `strategy` at on `gpu`, and two lines saying so and
    which single changes would fit (`what_would_fit`)."""
    need = plan(model_config, strategy, gpu).required_bytes
    lines = [
        f"memfit's planner puts this run at {need / 2**30:.1f} GiB per GPU, the {gpu.name} has "
        f"{gpu.memory_bytes / 2**30:.1f} GiB"
    ]
    fixes = what_would_fit(model_config, strategy, gpu)[:3]
    if fixes:
        lines.append(
            "single changes that fit: "
            + "; ".join(f"{label} ({p.required_bytes / 2**30:.1f} GiB)" for label, p in fixes)
        )
    else:
        lines.append(
            "no single change fits: `memfit plan --recommend` ranks combined strategies "
            "(checkpointing, ZeRO across GPUs, offload)"
        )
    return need, lines


def preflight(model_config: ModelConfig, strategy: Strategy, gpu: GPU) -> tuple[str, str | None]:
    """What the planner says of a run before it starts: ("ok", None), or ("warn" | "refuse",
    the message: the run's size against the GPU's and the single changes that would fit)."""
    need, lines = planner_advice(model_config, strategy, gpu)
    if need <= gpu.memory_bytes:
        return "ok", None
    verdict = "refuse" if need > PREFLIGHT_REFUSE * gpu.memory_bytes else "warn"
    lines[0] = f"{model_config.name} ({strategy.describe()}): {lines[0]}" + (
        ": it cannot fit" if verdict == "refuse" else ": it may run out of memory"
    )
    return verdict, "\n".join(lines)
