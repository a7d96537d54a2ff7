"""`memfit profile`: run a few real training steps of a config on the present device, print the
measured memory breakdown beside the plan, and plot the memory timeline of a step (CUDA)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from memfit.config import Config
from memfit.models.config import format_params
from memfit.profile.measure import CATEGORIES, PHASES, MemoryMeasurement, measure_memory
from memfit.profile.timeline import MatplotlibMissing, plot_timeline
from memfit.train.engine import ConfigError, Trainer


def format_bytes(n: int | None) -> str:
    """GiB from 1 GiB up, MiB below (a CPU demo model is a few MiB)."""
    if n is None:
        return "-"
    if abs(n) >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.1f} MiB"


def format_error(planned: int | None, measured: int | None) -> str:
    """(planned - measured) / measured: positive when the plan over-estimates."""
    if planned is None or measured is None:
        return "-"
    if measured == 0:
        return "0%" if planned == 0 else "-"
    return f"{(planned - measured) / measured:+.1%}"


def measurement_table(
    measurement: MemoryMeasurement, plan: Any | None = None, *, title: str = "memfit profile"
) -> Table:
    """One row per category (measured, and planned with the error if a plan is given), then the
    total, the peaks and the phase peaks. plan: any object with `.breakdown` (bytes per category)
    and `.peak_bytes`, optionally `.phases` (peak bytes per phase)."""
    table = Table(title=title)
    table.add_column("category")
    table.add_column("measured", justify="right")
    if plan is not None:
        table.add_column("planned", justify="right")
        table.add_column("error", justify="right")

    def row(name: str, measured: int | None, planned: int | None = None, **style: Any) -> None:
        cells = [name, format_bytes(measured)]
        if plan is not None:
            cells += [format_bytes(planned), format_error(planned, measured)]
        table.add_row(*cells, **style)

    # compare like with like: each category at its own peak over the phases, when the plan says
    planned_breakdown = (
        (getattr(plan, "category_peaks", None) or plan.breakdown) if plan is not None else {}
    )
    for category in CATEGORIES:
        row(category, measurement.breakdown[category], planned_breakdown.get(category))
    row(
        "total (sum of categories)",
        measurement.total_bytes,
        sum(planned_breakdown.values()) if plan is not None else None,
        end_section=True,
    )
    row("peak allocated", measurement.peak_allocated_bytes, getattr(plan, "peak_bytes", None))
    row("peak reserved", measurement.peak_reserved_bytes, None, end_section=True)
    planned_phases = getattr(plan, "phases", None) or {}
    for phase in PHASES:
        row(f"{phase} peak", measurement.phase_peaks.get(phase), planned_phases.get(phase))
    return table


def run_profile(
    config: Config,
    console: Console,
    *,
    steps: int,
    plan_fn: Callable[[Trainer], Any] | None = None,
    png: str | None = None,
) -> int:
    """Build the Trainer of `config`, measure `steps` steps (after one warm-up step), print the
    breakdown (beside `plan_fn(trainer)`'s if given) and, on CUDA, write the timeline plot to
    `png` (default RUN_DIR/memory_timeline.png)."""
    dist = config.distributed
    if dist.zero or dist.offload != "none":
        raise ConfigError(
            "memfit profile measures single-process runs; ZeRO and offload runs (--zero "
            f"{dist.zero} --offload {dist.offload}) are not profiled by it yet: "
            "benchmarks/zero.py measures their peak per rank against memfit plan"
        )
    trainer = Trainer(config)
    mc = trainer.model_config
    console.print(
        f"[bold]memfit profile[/] model [cyan]{mc.name}[/] ({format_params(mc.num_params)} params) "
        f"on [cyan]{trainer.device}[/], {trainer.precision}, seq {config.data.seq_len} x "
        f"micro-batch {config.train.micro_batch} x accum {config.train.grad_accum}, checkpointing "
        f"{config.train.checkpointing}, {'compiled' if trainer.compiled else 'eager'}: "
        f"1 warm-up + {steps} measured steps",
        highlight=False,
    )
    measurement = measure_memory(trainer, steps=steps)
    plan = plan_fn(trainer) if plan_fn is not None else None
    console.print(
        measurement_table(
            measurement, plan, title=f"memfit profile: {mc.name} on {measurement.device}"
        )
    )
    for note in measurement.notes:
        console.print(f"[dim]note: {note}[/]", highlight=False)

    timeline = measurement.timeline
    if timeline is None:
        if png is not None:
            console.print(
                f"[yellow]warning:[/] no memory timeline on {trainer.device} (it is recorded from "
                f"CUDA's allocator); {png} not written",
                highlight=False,
            )
        return 0
    path = Path(png) if png is not None else trainer.run_dir / "memory_timeline.png"
    try:
        plot_timeline(
            timeline.points,
            timeline.phases,
            path,
            f"{mc.name}, {trainer.precision}, micro-batch {config.train.micro_batch} x seq "
            f"{config.data.seq_len}, checkpointing {config.train.checkpointing}: one step",
            reserved=timeline.reserved,
        )
    except MatplotlibMissing:
        console.print(
            "[yellow]warning:[/] no timeline plot: pip install matplotlib to get the plot",
            highlight=False,
        )
    else:
        console.print(f"memory timeline: [cyan]{path}[/]", highlight=False)
    return 0
