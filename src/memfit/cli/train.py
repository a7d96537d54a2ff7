"""`memfit train`: build the Trainer, show progress (loss, tokens/s, memory), print a summary."""

from __future__ import annotations

import dataclasses
import os
import signal
import statistics

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from memfit.config import Config
from memfit.models.config import format_params
from memfit.train.engine import StepMetrics, Trainer


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def choose_strategy(config: Config, console: Console) -> Config:
    """--auto: the planner's fastest strategy that fits the present GPU, times the processes of
    a torchrun launch (WORLD_SIZE), keeping the tokens per optimizer step of the configuration
    (micro-batch x accumulation x sequence x processes): the micro-batch, accumulation,
    checkpointing, optimizer, ZeRO stage and offload. Every rank plans alike, so all choose
    the same."""
    from memfit.models.config import load_model_config
    from memfit.planner import detect_gpu, fine_tuning_fields, rank_strategies

    if config.train.fp32_parts or config.train.fp32_matmul != "fp32":
        raise ValueError(
            "--auto ranks bf16 strategies and takes no --fp32-parts or --fp32-matmul yet: "
            "set the strategy yourself (`memfit plan --fp32-parts ...` prices it)"
        )
    gpu = detect_gpu()
    if gpu is None:
        raise ValueError(
            "--auto plans for the present GPU, and none of the planner's catalog is present; "
            "set --micro-batch / --checkpointing yourself, or see `memfit plan --recommend --gpu NAME`"
        )
    train = config.train
    model = load_model_config(config.model.name)
    gpus = int(os.environ.get("WORLD_SIZE", "1"))
    tokens_per_step = train.micro_batch * train.grad_accum * config.data.seq_len * gpus
    found = rank_strategies(
        model,
        gpu,
        seq_len=config.data.seq_len,
        gpus=gpus,
        tokens_per_step=tokens_per_step,
        optimizer=train.optimizer,
        **fine_tuning_fields(config),  # a LoRA / QLoRA run plans as one, with its teacher
    )
    if not found:
        on = gpu.name if gpus == 1 else f"{gpus} x {gpu.name}"
        raise ValueError(
            f"--auto: no strategy of {model.name} at seq {config.data.seq_len} fits {on}; "
            f"`memfit plan --model {config.model.name} --recommend --gpus {gpus}` says what would"
        )
    best = found[0]
    console.print(
        f"[bold]--auto[/]: {escape(best.strategy.describe())} — {escape(best.why())}",
        highlight=False,
    )
    chosen = dataclasses.replace(
        train,
        micro_batch=best.strategy.micro_batch,
        grad_accum=best.strategy.grad_accum,
        checkpointing=best.strategy.checkpointing,
        checkpoint_blocks=best.strategy.checkpoint_blocks,
        offload_activations=best.strategy.offload_activations,
        cuda_graphs=best.strategy.cuda_graphs,
        precision=best.strategy.precision,
        optimizer=best.strategy.optimizer,
        master_weights=best.strategy.master_weights,
    )
    distributed = dataclasses.replace(
        config.distributed, zero=best.strategy.zero, offload=best.strategy.offload
    )
    return dataclasses.replace(config, train=chosen, distributed=distributed)


def run_train(config: Config, console: Console, *, auto: bool = False) -> int:
    if auto:
        config = choose_strategy(config, console)
    trainer = Trainer(config)
    config = trainer.config  # (as resolved: the learning rate, --checkpointing auto's choice)
    if not trainer.world.is_main:  # torchrun: rank 0 reports for the run
        console.quiet = True
    mc = trainer.model_config
    console.print(
        f"[bold]memfit train[/] model [cyan]{escape(mc.name)}[/] ({format_params(mc.num_params)} params) on "
        f"[cyan]{trainer.device}[/], {trainer.precision}, seq {config.data.seq_len} x micro-batch "
        f"{config.train.micro_batch} x accum {config.train.grad_accum}, checkpointing {config.train.checkpointing_label()}, "
        f"{'compiled' if trainer.compiled else 'eager'}, "
        f"run dir [cyan]{escape(str(trainer.run_dir))}[/]",
        highlight=False,
    )
    if trainer.resumed_from is not None:
        console.print(
            f"resumed from [cyan]{escape(str(trainer.resumed_from))}[/] at step {trainer.step}",
            highlight=False,
        )

    progress = Progress(
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(
            "loss [bold]{task.fields[loss]}[/]  {task.fields[speed]} tok/s  mem {task.fields[mem]}"
        ),
        TimeRemainingColumn(),
        console=console,
    )
    task = progress.add_task(
        "train", total=config.train.steps, completed=trainer.step, loss="-", speed="-", mem="-"
    )

    def on_step(m: StepMetrics) -> None:
        progress.update(
            task,
            completed=m.step,
            loss=f"{m.loss:.4f}" + (" (skipped)" if m.skipped else ""),
            speed=f"{m.tokens_per_s:,.0f}",
            mem=gib(m.mem_peak_bytes),
        )
        if m.step % max(1, config.train.steps // 10) == 0 or m.step == config.train.steps:
            progress.console.print(
                f"step {m.step:>6}  loss {m.loss:.4f}  lr {m.lr:.2e}  grad-norm {m.grad_norm:.3f}  "
                f"{m.tokens_per_s:,.0f} tok/s  mem {gib(m.mem_allocated_bytes)} (peak {gib(m.mem_peak_bytes)})"
                + (f"  MFU {m.mfu:.1%}" if m.mfu is not None else ""),
                highlight=False,
                soft_wrap=True,
            )

    try:
        with progress:
            history = trainer.fit(on_step)
    except BaseException:
        trainer.close(failed=True)
        raise
    trainer.close()

    table = Table(title="memfit train: summary", show_header=False)
    if history:
        timed = history[1:] if len(history) > 1 else history  # the first step includes warm-up
        speed = sum(m.tokens for m in timed) / sum(m.step_time_s for m in timed)
        table.add_row("steps", f"{history[0].step} .. {history[-1].step}")
        table.add_row("loss first / last", f"{history[0].loss:.4f} / {history[-1].loss:.4f}")
        table.add_row("tokens this run", f"{sum(m.tokens for m in history):,}")
        table.add_row("tokens/s (after first step)", f"{speed:,.0f}")
        table.add_row(
            "median step time", f"{statistics.median(m.step_time_s for m in timed) * 1e3:.1f} ms"
        )
        if history[-1].mfu is not None:
            table.add_row("MFU", f"{speed * trainer.flops_per_token / trainer.peak_flops:.1%}")
        table.add_row("peak memory", gib(max(m.mem_peak_bytes for m in history)))
        skipped = sum(m.skipped for m in history)
        if skipped:
            table.add_row("skipped steps (fp16 overflow)", str(skipped))
    if not history and trainer.resumed_from is not None:
        table.add_row(
            "steps", f"none: the run was already at step {trainer.step} of {config.train.steps}"
        )
    table.add_row("metrics", escape(str(trainer.run_dir / "metrics.jsonl")))
    table.add_row("checkpoint", escape(str(trainer.run_dir / "checkpoints")))
    console.print(table)
    if trainer.stopped_by is not None:
        console.print(
            f"[yellow]stopped by {trainer.stopped_by} after step {trainer.step}[/]: the checkpoint "
            f"of that step is saved; `--resume` goes on from it",
            highlight=False,
        )
        signum = getattr(signal, trainer.stopped_by, None)
        return 128 + int(signum) if signum is not None else 1
    return 0
