"""`memfit plan`: predicted per-GPU memory of a training strategy, by category and phase."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from rich.console import Console
from rich.table import Table

from memfit.models.config import format_params, load_model_config
from memfit.planner import (
    CATEGORIES,
    Strategy,
    get_gpu,
    plan,
    rank_strategies,
    step_time,
    what_would_fit,
)
from memfit.planner.memory import gib


def run_rank_strategies(args: argparse.Namespace, console: Console) -> int:
    model = load_model_config(args.model)
    gpu = get_gpu(args.gpu)
    found = rank_strategies(
        model, gpu, seq_len=args.seq_len, gpus=args.gpus, optimizer=args.optimizer
    )
    if args.json:
        print(
            json.dumps(
                [
                    {
                        **r.plan.to_json(),
                        "tokens_per_s": r.time.tokens_per_s,
                        "step_s": r.time.total_s,
                    }
                    for r in found
                ]
            )
        )
        return 0 if found else 1
    if not found:
        console.print(
            f"[red]no single-GPU strategy of {model.name} at seq {args.seq_len} fits {gpu.name}[/]"
        )
        strategy = Strategy(
            seq_len=args.seq_len, micro_batch=1, checkpointing="full", optimizer=args.optimizer
        )
        for label, fixed in what_would_fit(model, strategy, gpu)[:5]:
            console.print(
                f"  with full checkpointing and {label}: peak {gib(fixed.peak_bytes)}",
                highlight=False,
            )
        return 1
    table = Table(
        title=f"memfit plan --recommend: {model.name} on {gpu.name}, seq {args.seq_len}, fastest first"
    )
    for column in (
        "strategy",
        "peak allocated",
        "tokens/s (predicted)",
        "MFU (predicted)",
        "step (s)",
    ):
        table.add_column(column)
    for r in found[:5]:
        mfu = r.time.tokens_per_s * model.flops_per_token(args.seq_len) / gpu.bf16_flops
        table.add_row(
            r.strategy.describe(),
            gib(r.plan.peak_bytes),
            f"{r.time.tokens_per_s:,.0f}",
            f"{mfu:.0%}",
            f"{r.time.total_s:.2f}",
        )
    console.print(table)
    return 0


def run_plan(args: argparse.Namespace, console: Console) -> int:
    if args.recommend:
        return run_rank_strategies(args, console)
    model = load_model_config(args.model)
    gpu = get_gpu(args.gpu)
    strategy = Strategy(
        precision=args.precision,
        micro_batch=args.micro_batch,
        seq_len=args.seq_len,
        grad_accum=args.grad_accum,
        checkpointing=args.checkpointing,
        optimizer=args.optimizer,
        zero=args.zero,
        offload=args.offload,
        world_size=args.gpus,
    )
    result = plan(model, strategy, gpu)
    time = step_time(model, strategy, gpu, host_cpus=args.host_cpus)
    fixes = [] if result.fits else what_would_fit(model, strategy, gpu)
    if args.json:
        out = result.to_json()
        out["step_time"] = {**asdict(time), "total_s": time.total_s}
        if fixes:
            out["would_fit"] = [
                {"change": label, "peak_bytes": p.peak_bytes} for label, p in fixes[:5]
            ]
        print(json.dumps(out))
        return 0

    console.print(
        f"[bold]memfit plan[/] {model.name} ({format_params(model.num_params)} params) on {args.gpus} x "
        f"{gpu.name} ({gib(gpu.memory_bytes)}): {strategy.describe()}",
        highlight=False,
    )
    table = Table(title="predicted memory per GPU (torch.cuda.max_memory_allocated)")
    table.add_column("category")
    table.add_column(f"at the peak ({max(result.phases, key=result.phases.get)})", justify="right")
    for category in CATEGORIES:
        table.add_row(category.replace("_", " "), gib(result.breakdown[category]))
    table.add_section()
    for phase, value in result.phases.items():
        table.add_row(f"phase: {phase}", gib(value))
    table.add_section()
    table.add_row("[bold]peak allocated", f"[bold]{gib(result.peak_bytes)}")
    table.add_row("needed (+5% allocator slack, CUDA context)", gib(result.required_bytes))
    console.print(table)
    console.print(
        f"step: {time.total_s:.3f} s, {time.tokens_per_s:,.0f} tokens/s per GPU "
        f"(compute {time.compute_s:.3f}, recompute {time.recompute_s:.3f}, optimizer "
        f"{time.optimizer_s:.3f}, communication {time.communication_s:.3f} s; memfit's time model)",
        highlight=False,
    )
    for note in result.notes:
        console.print(f"note: {note}")
    if result.fits:
        console.print(
            f"[green]fits[/]: {gib(gpu.memory_bytes - result.required_bytes)} to spare",
            highlight=False,
        )
        return 0
    console.print(
        f"[red]does not fit[/]: {gib(result.shortfall_bytes)} over {gpu.name}'s {gib(gpu.memory_bytes)}",
        highlight=False,
    )
    if fixes:
        console.print("these single changes would fit:")
        for label, fixed in fixes[:5]:
            console.print(f"  {label:<40} peak {gib(fixed.peak_bytes)}", highlight=False)
    else:
        console.print(
            "no single change makes it fit; combine checkpointing, ZeRO-3 and offload, or more GPUs"
        )
    return 1


def add_plan_parser(sub: argparse._SubParsersAction, handler) -> None:
    p = sub.add_parser(
        "plan",
        help="predict per-GPU memory of a training strategy",
        description="Predict the peak memory per GPU of training --model with a strategy, by category and "
        "phase, and whether it fits --gpu. Exits 1 when it does not fit.",
    )
    p.add_argument("--model", default="llama-1b", help="preset or path to a HF config.json")
    p.add_argument(
        "--gpu",
        default="h100-sxm",
        help="h100-sxm, h100-pcie, h200, a100-40gb, a100-80gb, l40s, ...",
    )
    p.add_argument("--gpus", type=int, default=1, help="data-parallel GPUs")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="bf16")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--checkpointing", choices=["none", "full", "selective"], default="none")
    p.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    p.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=0)
    p.add_argument("--offload", choices=["none", "optimizer", "params"], default="none")
    p.add_argument(
        "--host-cpus",
        type=int,
        default=16,
        help="CPU cores of each training node: the speed of offload's CPU step (default 16)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--recommend",
        action="store_true",
        help="list the fastest strategies that fit (micro-batch, accumulation, checkpointing)",
    )
    p.set_defaults(handler=handler)
