"""`memfit profile`: run a few real training steps of a config on the present device, print the
measured memory breakdown beside the plan, and plot the memory timeline of a step (CUDA).

Every strategy the engine runs is profiled, ZeRO stages and offload included; under torchrun
every rank measures its own device and rank 0 prints its table and one line per rank."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from memfit.config import Config, check_at_least
from memfit.models.config import format_params
from memfit.profile.measure import CATEGORIES, PHASES, MemoryMeasurement, measure_memory
from memfit.profile.timeline import MatplotlibMissing, plot_timeline
from memfit.train.engine import Trainer


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
    planned_host = getattr(plan, "host_bytes", 0) if plan is not None else 0
    if measurement.host_bytes or planned_host:
        row("host memory (offload)", measurement.host_bytes, planned_host, end_section=True)
    planned_phases = getattr(plan, "phases", None) or {}
    for phase in PHASES:
        row(f"{phase} peak", measurement.phase_peaks.get(phase), planned_phases.get(phase))
    fragmentation = measurement.fragmentation
    if fragmentation:
        table.add_section()
        for phase in PHASES:
            if phase in fragmentation:
                held = measurement.phase_reserved[phase] - measurement.phase_peaks[phase]
                table.add_row(
                    f"{phase}: reserved - allocated",
                    f"{format_bytes(held)} ({fragmentation[phase]:.1%} of the peak)",
                    *(["", ""] if plan is not None else []),
                )
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
    check_at_least("--profile-steps", steps, 1)
    if png is not None and Path(png).is_dir():
        raise IsADirectoryError(f"--png {png!r} is a directory; give the path of a .png file")
    if png is not None and not Path(png).parent.is_dir():
        raise FileNotFoundError(f"--png {png!r}: {str(Path(png).parent)!r} is no directory")
    trainer = Trainer(config)
    main = trainer.world.is_main
    mc = trainer.model_config
    dist = config.distributed
    parallel = ""
    if trainer.world.distributed or dist.zero or dist.offload != "none":
        parallel = f", ZeRO {dist.zero} x {trainer.world.world_size} ranks, offload {dist.offload}"
    if main:
        console.print(
            f"[bold]memfit profile[/] model [cyan]{escape(mc.name)}[/] ({format_params(mc.num_params)} params) "
            f"on [cyan]{trainer.device}[/], {trainer.precision}, seq {config.data.seq_len} x "
            f"micro-batch {config.train.micro_batch} x accum {config.train.grad_accum}, checkpointing "
            f"{config.train.checkpointing_label()}, {'compiled' if trainer.compiled else 'eager'}"
            f"{parallel}: 1 warm-up + {steps} measured steps",
            highlight=False,
        )
    try:
        measurement = measure_memory(trainer, steps=steps)
        per_rank = [measurement]
        if trainer.world.distributed:  # every rank measured its own; rank 0 reports them all
            per_rank = [None] * trainer.world.world_size
            torch.distributed.all_gather_object(per_rank, measurement.to_json())
    except BaseException:
        trainer.close(failed=True)
        raise
    trainer.close()
    if not main:
        return 0
    plan = plan_fn(trainer) if plan_fn is not None else None
    title = escape(f"memfit profile: {mc.name} on {measurement.device}")
    if trainer.world.distributed:
        title += f", rank 0 of {trainer.world.world_size}"
    console.print(measurement_table(measurement, plan, title=title))
    if trainer.world.distributed:
        for rank, measured in enumerate(per_rank):
            peak = measured["peak_allocated_bytes"]
            console.print(
                f"rank {rank}: categories {format_bytes(measured['total_bytes'])}, peak "
                f"allocated {format_bytes(peak)}, host {format_bytes(measured['host_bytes'])}",
                highlight=False,
            )
    for note in measurement.notes:
        console.print(f"[dim]note: {escape(note)}[/]", highlight=False)

    timeline = measurement.timeline
    if timeline is None:
        if png is not None:
            console.print(
                f"[yellow]warning:[/] no memory timeline on {trainer.device} (it is recorded from "
                f"CUDA's allocator); {escape(png)} not written",
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
            f"{config.data.seq_len}, checkpointing {config.train.checkpointing_label()}: one step",
            reserved=timeline.reserved,
        )
    except MatplotlibMissing:
        console.print(
            "[yellow]warning:[/] no timeline plot: pip install matplotlib to get the plot",
            highlight=False,
        )
    else:
        console.print(f"memory timeline: [cyan]{escape(str(path))}[/]", highlight=False)
    return 0
