"""`memfit plan`: predicted per-GPU memory of a training strategy, by category and phase; with
`--serve`, the memory of serving the model and the KV cache pool that fits (planner/serve.py)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from memfit.config import check_at_least, check_between
from memfit.models.config import ModelConfig, check_seq_len, format_params, load_model_config
from memfit.optim.registry import OPTIMIZERS
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
from memfit.planner.serve import ServePlan, plan_serve, serve_fixes

# --seq-len's default for training plans, or the model's max_seq_len if shorter (--serve defaults
# to the model's max_seq_len)
TRAIN_SEQ_LEN = 2048


def run_rank_strategies(args: argparse.Namespace, console: Console, model: ModelConfig) -> int:
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
            f"[red]no single-GPU strategy of {escape(model.name)} at seq {args.seq_len} fits "
            f"{gpu.name}[/]"
        )
        strategy = Strategy(
            seq_len=args.seq_len, micro_batch=1, checkpointing="full", optimizer=args.optimizer
        )
        for label, fixed in what_would_fit(model, strategy, gpu)[:5]:
            console.print(
                f"  with full checkpointing and {escape(label)}: peak {gib(fixed.peak_bytes)}",
                highlight=False,
            )
        return 1
    table = Table(
        title=f"memfit plan --recommend: {escape(model.name)} on {gpu.name}, seq {args.seq_len}, "
        "fastest first"
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
    best = found[0].strategy
    if best.optimizer != args.optimizer:
        console.print(
            f"nothing fits with {args.optimizer}: these keep {best.optimizer}'s states"
            + (" and bf16 weights without fp32 masters" if best.master_weights == "none" else "")
        )
    console.print(f"run the first: {escape(train_command(model.name, best))}", highlight=False)
    return 0


def train_command(model: str, strategy: Strategy) -> str:
    """The `memfit train` command line of a single-GPU strategy."""
    parts = [
        f"memfit train --model {model} --precision {strategy.precision}",
        f"--seq-len {strategy.seq_len} --micro-batch {strategy.micro_batch}",
        f"--grad-accum {strategy.grad_accum} --checkpointing {strategy.checkpointing}",
    ]
    if strategy.optimizer != "adamw":
        parts.append(f"--optimizer {strategy.optimizer}")
    if strategy.master_weights != "fp32":
        parts.append(f"--master-weights {strategy.master_weights}")
    if strategy.offload_activations:
        parts.append("--offload-activations")
    return " ".join(parts)


def check_plan_flags(args: argparse.Namespace) -> None:
    """Refuse counts below 1 and fractions outside (0, 1], naming the flag and the value, before
    anything is planned."""
    counts = ["gpus", "micro_batch", "grad_accum", "host_cpus"]
    if args.serve:
        counts += ["block_size", "max_step_tokens", "max_running"]
        check_between("--memory-fraction", args.memory_fraction, 0, 1, low_open=True)
    for flag in counts:
        check_at_least("--" + flag.replace("_", "-"), getattr(args, flag), 1)
    if args.seq_len is not None:
        check_at_least("--seq-len", args.seq_len, 1)


def run_plan(args: argparse.Namespace, console: Console) -> int:
    check_plan_flags(args)
    if args.serve:
        return run_plan_serve(args, console)
    model = load_model_config(args.model)
    if args.seq_len is None:
        args.seq_len = min(TRAIN_SEQ_LEN, model.max_seq_len)
    check_seq_len(model, args.seq_len)  # the engine refuses the same lengths
    if args.recommend:
        return run_rank_strategies(args, console, model)
    gpu = get_gpu(args.gpu)
    strategy = Strategy(
        precision=args.precision,
        micro_batch=args.micro_batch,
        seq_len=args.seq_len,
        grad_accum=args.grad_accum,
        checkpointing=args.checkpointing,
        optimizer=args.optimizer,
        master_weights=args.master_weights,
        zero=args.zero,
        offload=args.offload,
        offload_activations=args.offload_activations,
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
        f"[bold]memfit plan[/] {escape(model.name)} ({format_params(model.num_params)} params) on {args.gpus} x "
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
        console.print(f"note: {note}", highlight=False, markup=False)
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
            console.print(f"  {escape(label):<40} peak {gib(fixed.peak_bytes)}", highlight=False)
    else:
        console.print(
            "no single change makes it fit; combine checkpointing, ZeRO-3 and offload, or more GPUs"
        )
    return 1


def run_plan_serve(args: argparse.Namespace, console: Console) -> int:
    """`memfit plan --serve`: what one GPU holds while serving, and the KV cache pool."""
    if args.recommend or args.gpus != 1:
        raise ValueError(
            "--serve plans one GPU serving the whole model: drop --recommend and --gpus "
            f"(got --gpus {args.gpus}{' --recommend' if args.recommend else ''})"
        )
    model = load_model_config(args.model)
    result = plan_serve(
        model,
        get_gpu(args.gpu),
        dtype=args.precision,
        block_size=args.block_size,
        memory_fraction=args.memory_fraction,
        max_step_tokens=args.max_step_tokens,
        max_running=args.max_running,
        seq_len=args.seq_len,
        cuda_graph_batch_sizes=() if args.no_cuda_graphs else None,
    )
    fixes = [] if result.fits else serve_fixes(result)
    if args.json:
        out = result.to_json()
        if fixes:
            out["would_fit"] = [
                {"change": label, "max_sequences": p.max_sequences, "seq_len": p.seq_len}
                for label, p in fixes
            ]
        print(json.dumps(out))
        return 0 if result.fits else 1

    console.print(
        f"[bold]memfit plan --serve[/] {escape(model.name)} ({format_params(model.num_params)} "
        f"params) on {result.gpu} ({gib(result.gpu_memory_bytes)}): {escape(result.describe())}",
        highlight=False,
    )
    console.print(_serve_table(result))
    for note in result.notes:
        console.print(f"note: {note}", highlight=False, markup=False)
    if result.fits:
        console.print(
            f"[green]KV cache[/]: {result.num_blocks:,} blocks of {result.block_size} tokens = "
            f"{result.kv_tokens:,} tokens ({result.kv_bytes_per_token / 2**10:,.0f} KiB per "
            f"token); {result.max_sequences:,} sequences of {result.seq_len:,} tokens at once "
            f"({result.blocks_per_sequence} blocks each)",
            highlight=False,
        )
        return 0
    console.print(
        f"[red]does not fit[/]: {escape(result.error_message().splitlines()[0])}", highlight=False
    )
    if fixes:
        console.print("these single changes would fit:")
        for label, fixed in fixes:
            console.print(
                f"  {escape(label):<28} {fixed.max_sequences:,} sequences of {fixed.seq_len:,} "
                "tokens",
                highlight=False,
            )
    else:
        console.print(
            "no single change makes it fit: a GPU with more memory, or the model split over "
            "several GPUs or quantized (not planned yet)"
        )
    return 1


def _serve_table(result: ServePlan) -> Table:
    table = Table(title="predicted memory of one GPU serving")
    table.add_column("what")
    table.add_column("GiB", justify="right")
    table.add_column("how", style="dim")
    phases = result.step_phases
    forward, sampler = phases["forward"], phases["held"] - phases["forward"]
    graphs = result.cuda_graph_batch_sizes
    rows = [
        (
            "weights",
            result.weights_bytes,
            f"{format_params(result.model.num_params)} x {result.dtype}",
        ),
        (
            "KV cache pool",
            result.kv_pool_bytes,
            f"{result.num_blocks:,} blocks + 1 scratch x {result.kv_bytes_per_block / 2**20:.2f} MiB",
        ),
        (
            "step activations",
            result.step_held_bytes,
            f"{result.step_tokens} tokens, {result.step_rows} logit rows: forward "
            f"{forward / 2**20:,.0f} MiB + sampler {sampler / 2**20:,.0f} MiB",
        ),
        ("cuBLAS workspace", result.workspace_bytes, "one handle"),
        (
            "CUDA graphs",
            result.cuda_graph_bytes,
            f"{len(graphs)} decode batch sizes up to {max(graphs)}: pool "
            f"{result.cuda_graph_pool_bytes / 2**20:,.0f} MiB + driver "
            f"{result.cuda_graph_driver_bytes / 2**20:,.0f} MiB"
            if graphs
            else "none",
        ),
        ("allocator slack", result.allocator_slack_bytes, "5% of step and graph pool"),
        ("CUDA context", result.cuda_context_bytes, ""),
        ("kernel modules", result.kernel_modules_bytes, "device code of the step's kernels"),
    ]
    for label, value, how in rows:
        table.add_row(label, f"{value / 2**30:.2f}", how)
    if result.fits:
        unused = result.breakdown["unused"]
        rows.append(("unused", unused, "less than one KV block"))
        table.add_row("unused", f"{unused / 2**30:.2f}", "less than one KV block")
    table.add_section()
    used = sum(value for _, value, _ in rows)
    table.add_row("[bold]total", f"[bold]{used / 2**30:.2f}", "")
    table.add_row(
        f"budget ({result.memory_fraction:.0%} of the GPU)",
        f"{result.budget_bytes / 2**30:.2f}",
        "",
    )
    return table


def add_plan_parser(sub: argparse._SubParsersAction, handler) -> None:
    p = sub.add_parser(
        "plan",
        help="predict per-GPU memory of a training strategy, or of serving (--serve)",
        description="Predict the peak memory per GPU of training --model with a strategy, by category and "
        "phase, and whether it fits --gpu; with --serve, what one GPU holds while serving --model and "
        "the KV cache pool that fills the rest (tokens, blocks, sequences of --seq-len). Exits 1 when "
        "it does not fit.",
    )
    p.add_argument("--model", default="llama-1b", help="preset or path to a HF config.json")
    p.add_argument(
        "--gpu",
        default="h100-sxm",
        help="h100-sxm, h100-pcie, h200, a100-40gb, a100-80gb, l40s, ...",
    )
    p.add_argument("--gpus", type=int, default=1, help="data-parallel GPUs")
    p.add_argument(
        "--precision",
        choices=["fp32", "bf16", "fp16"],
        default="bf16",
        help="training precision; with --serve, the weights' and KV cache's dtype",
    )
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument(
        "--seq-len",
        type=int,
        help=f"tokens per sequence, at most the model's max_seq_len (default {TRAIN_SEQ_LEN} or "
        "that if shorter; with --serve, the model's max_seq_len)",
    )
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--checkpointing", choices=["none", "full", "selective"], default="none")
    p.add_argument("--optimizer", choices=list(OPTIMIZERS), default="adamw")
    p.add_argument(
        "--master-weights",
        choices=["fp32", "none"],
        default="fp32",
        help="none: bf16 parameters without fp32 masters (bf16, adamw8bit, one GPU)",
    )
    p.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=0)
    p.add_argument("--offload", choices=["none", "optimizer", "params"], default="none")
    p.add_argument(
        "--offload-activations",
        action="store_true",
        help="activations in pinned CPU memory (with --checkpointing: the block inputs)",
    )
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
    serve = p.add_argument_group("serving (--serve)")
    serve.add_argument(
        "--serve",
        action="store_true",
        help="plan serving instead of training: weights, a step, CUDA graphs and the KV cache pool",
    )
    serve.add_argument(
        "--memory-fraction",
        type=float,
        default=0.9,
        help="share of the GPU's memory the server may use, KV cache included (default 0.9)",
    )
    serve.add_argument("--block-size", type=int, default=16, help="KV cache block size in tokens")
    serve.add_argument(
        "--max-step-tokens",
        type=int,
        default=2048,
        help="tokens one engine step runs at most, prefill chunks included (default 2048)",
    )
    serve.add_argument(
        "--max-running", type=int, default=256, help="sequences running at once (default 256)"
    )
    serve.add_argument(
        "--no-cuda-graphs",
        action="store_true",
        help="plan no CUDA graphs of decode steps (default: batch sizes 1, 2, 4, 8, 16, ... up "
        "to --max-running)",
    )
    p.set_defaults(handler=handler)
