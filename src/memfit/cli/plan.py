"""`memfit plan`: predicted per-GPU memory of a training strategy, by category and phase; with
`--serve`, the memory of serving the model and the KV cache pool that fits (planner/serve.py).

The strategy comes from the flags, or from a run's `--config FILE.toml` (what `memfit train
--config` would run: its [model], [data], [train], [distributed], [lora] and [distill]), the flags
given beside it overriding the file. LoRA, QLoRA and a distillation teacher take `memfit train`'s
flags (--lora-rank, --quantize-base, --teacher, ...). `--recommend` ranks each goal apart: full
fine-tuning, LoRA and QLoRA (rank 16, or --lora-rank), or only the one the flags or the file ask
for.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
from dataclasses import asdict

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from memfit.config import build_config, check_at_least, check_between
from memfit.models.config import ModelConfig, check_seq_len, format_params, load_model_config
from memfit.optim.registry import OPTIMIZERS
from memfit.planner import (
    CATEGORIES,
    GPU,
    Recommendation,
    Strategy,
    get_gpu,
    plan,
    step_time,
    what_would_fit,
)
from memfit.planner.memory import LORA_TARGETS, fine_tuning_fields, gib, teacher_model
from memfit.planner.search import LORA_RANK, choose_checkpointing, rank_goals
from memfit.planner.serve import ServePlan, plan_serve, serve_fixes
from memfit.planner.time import model_flops_per_token

# --seq-len's default for training plans, or the model's max_seq_len if shorter (--serve defaults
# to the model's max_seq_len)
TRAIN_SEQ_LEN = 2048
# the strategy flags' values when neither they nor a --config give one
PLAN_DEFAULTS = {
    "model": "llama-1b", "precision": "bf16", "micro_batch": 1, "grad_accum": 1,
    "checkpointing": "none", "checkpoint_blocks": None, "optimizer": "adamw",
    "attention_pattern": "", "pattern_layers": "all", "master_weights": "fp32", "zero": 0,
    "offload": "none", "offload_activations": False, "fp32_parts": "", "fp32_matmul": "fp32",
    "cuda_graphs": False, "lora_rank": 0,
    "lora_targets": "all-linear", "lora_dropout": 0.0, "quantize_base": "none", "teacher": None,
    "teacher_quantize": "none", "distill_kind": "kl", "distill_temperature": 1.0,
}  # fmt: skip
# each strategy flag's place in a run configuration (memfit.config.Config)
CONFIG_KEYS = {
    "model": ("model", "name"), "seq_len": ("data", "seq_len"),
    "micro_batch": ("train", "micro_batch"), "grad_accum": ("train", "grad_accum"),
    "precision": ("train", "precision"), "checkpointing": ("train", "checkpointing"),
    "checkpoint_blocks": ("train", "checkpoint_blocks"),
    "attention_pattern": ("model", "attention_pattern"),
    "pattern_layers": ("model", "pattern_layers"),
    "optimizer": ("train", "optimizer"), "master_weights": ("train", "master_weights"),
    "offload_activations": ("train", "offload_activations"),
    "cuda_graphs": ("train", "cuda_graphs"),
    "fp32_parts": ("train", "fp32_parts"), "fp32_matmul": ("train", "fp32_matmul"),
    "zero": ("distributed", "zero"), "offload": ("distributed", "offload"),
}  # fmt: skip
# the fine-tuning flags, as `memfit train` names them (cli/main.py's _TRAIN_FLAGS)
FINE_TUNING_FLAGS = (
    "lora_rank", "lora_targets", "lora_dropout", "quantize_base", "teacher", "teacher_quantize",
    "distill_kind", "distill_temperature",
)  # fmt: skip


def resolve_strategy_flags(args: argparse.Namespace) -> dict:
    """Fill the strategy flags not given: from --config (the run's values, its defaults
    included), else PLAN_DEFAULTS. Returns the fine-tuning fields a --config gave (LoRA, QLoRA,
    the teacher), which the flags override."""
    config = build_config(args.config) if args.config else None
    from_config: dict = fine_tuning_fields(config) if config is not None else {}
    args.given = {name for name in PLAN_DEFAULTS if getattr(args, name, None) is not None}
    for name, default in PLAN_DEFAULTS.items():
        if name in args.given:
            continue
        value = default
        if config is not None and name in CONFIG_KEYS:
            section, key = CONFIG_KEYS[name]
            value = getattr(getattr(config, section), key)
        setattr(args, name, value)
    if config is not None:
        if args.seq_len is None:
            args.seq_len = config.data.seq_len
        if args.precision == "auto":  # what a GPU with bf16 resolves it to
            args.precision = "bf16"
        args.attention = config.model.attention
    return from_config


def fine_tuning(args: argparse.Namespace, from_config: dict) -> dict:
    """The Strategy fields of LoRA, QLoRA and the teacher: the --config's, overridden by the
    flags given."""
    fields = dict(from_config)
    for name in FINE_TUNING_FLAGS:
        if name in args.given or name not in fields:
            fields[name] = getattr(args, name)
    if isinstance(fields.get("teacher"), str):
        fields["teacher"] = teacher_model(fields["teacher"])
    return fields


def run_rank_strategies(
    args: argparse.Namespace, console: Console, model: ModelConfig, fields: dict
) -> int:
    """--recommend: each goal's fastest strategies that fit. The goal asked for comes first: full
    fine-tuning, with LoRA and QLoRA (rank 16, or --lora-rank) as alternatives; or the LoRA or
    QLoRA goal the flags or the --config ask for, alone. Exits 1 when the goal asked for does
    not fit (the alternatives listed or not)."""
    gpu = get_gpu(args.gpu)
    shared = {
        key: fields[key]
        for key in ("lora_targets", "lora_dropout", "teacher", "teacher_quantize",
                    "distill_kind", "distill_temperature")
        if key in fields
    }  # fmt: skip
    rank = fields.get("lora_rank") or LORA_RANK
    quantize = fields.get("quantize_base", "none")
    if fields.get("lora_rank") or quantize != "none":  # the goal asked for, alone
        goals: tuple[str, ...] = ("qlora",) if quantize != "none" else ("lora",)
    else:
        goals = ("full", "lora", "qlora")
    found = rank_goals(
        model, gpu, goals=goals, lora_rank=rank, quantize=quantize if quantize != "none" else "nf4",
        seq_len=args.seq_len, gpus=args.gpus, optimizer=args.optimizer,
        host_memory=int(args.host_memory * 2**30) if args.host_memory else None, **shared,
    )  # fmt: skip
    asked = next(iter(found))
    rc = 0 if found[asked] else 1
    fitting = sorted(
        (r for recommendations in found.values() for r in recommendations),
        key=lambda r: r.time.tokens_per_s,
        reverse=True,
    )
    if args.json:  # every strategy that fits, fastest first, each with its goal
        print(
            json.dumps(
                [
                    {
                        **r.plan.to_json(),
                        "tokens_per_s": r.time.tokens_per_s,
                        "step_s": r.time.total_s,
                        "why": r.reasons,
                    }
                    for r in fitting
                ]
            )
        )
        return rc
    if fitting:
        table, why = _goals_table(model, gpu, args.gpus, args.seq_len, found)
        console.print(table)
        console.print("why each is there:", highlight=False)
        for line in why:
            console.print(f"  {escape(line)}", highlight=False)
    if not found[asked]:
        others = [goal for goal, recommendations in found.items() if recommendations]
        instead = (
            f": {' and '.join(others)} above train adapters on a frozen base" if others else ""
        )
        what = "full fine-tuning" if asked == "full" else asked
        on = gpu.name if args.gpus == 1 else f"{args.gpus} x {gpu.name}"
        console.print(
            f"[red]no strategy of {escape(model.name)} ({what}) at seq {args.seq_len} "
            f"fits {on}[/]{instead}",
            highlight=False,
        )
        strategy = Strategy(
            seq_len=args.seq_len, micro_batch=1, checkpointing="full", optimizer=args.optimizer,
            world_size=args.gpus, zero=3 if args.gpus > 1 and asked == "full" else 0,
            **(shared if asked == "full" else {"lora_rank": rank, **shared}),
            **({"quantize_base": quantize} if asked.startswith("QLoRA") else {}),
        )  # fmt: skip
        for label, fixed in what_would_fit(model, strategy, gpu)[:5]:
            if others and ("--lora-rank" in label or "--quantize-base" in label):
                continue  # (the goals listed above)
            console.print(
                f"  with full checkpointing and {escape(label)}: peak {gib(fixed.peak_bytes)}",
                highlight=False,
            )
    for goal, recommendations in found.items():
        if not recommendations:
            continue
        best = recommendations[0].strategy
        if goal == "full" and best.optimizer != args.optimizer:
            console.print(
                f"full: nothing fits with {args.optimizer}: these keep {best.optimizer}'s states"
                + (
                    " and bf16 weights without fp32 masters"
                    if best.master_weights == "none"
                    else ""
                )
            )
        console.print(
            f"{goal}: run the first: {escape(train_command(args.model, best))}", highlight=False
        )
    return rc


def _goals_table(
    model: ModelConfig, gpu: GPU, gpus: int, seq_len: int, found: dict[str, list[Recommendation]]
) -> tuple[Table, list[str]]:
    """Each goal's fastest strategies (3 a goal where there are several goals) and, when these
    all put activations in pinned host memory, the fastest that does not; a row saying so for a
    goal that nothing fits. And a line for each numbered row: why it is there."""
    per_goal = 5 if len(found) == 1 else 3
    on = gpu.name if gpus == 1 else f"{gpus} x {gpu.name}"
    table = Table(
        title=f"memfit plan --recommend: {escape(model.name)} on {on} "
        f"({gib(gpu.memory_bytes)} each), seq {seq_len}, each goal fastest first"
    )
    for column in ("", "goal", "strategy", "peak allocated", "tokens/s (predicted)", "MFU",
                   "step (s)"):  # fmt: skip
        table.add_column(column)
    why = []
    for goal, recommendations in found.items():
        if not recommendations:
            table.add_row("", goal, "[red]nothing fits[/]", "", "", "", "")
        rows = recommendations[:per_goal]
        if all(r.strategy.offload_activations for r in rows):
            rows += [r for r in recommendations if not r.strategy.offload_activations][:1]
        for r in rows:
            flops = model_flops_per_token(model, r.strategy)
            mfu = r.time.tokens_per_s * flops / gpu.bf16_flops
            described = escape(r.strategy.describe())
            if r.plan.host_bytes:
                described += f" ({gib(r.plan.host_bytes)} pinned host memory)"
            why.append(f"{len(why) + 1}. {goal}: {r.reasons}")
            table.add_row(
                str(len(why)),
                goal,
                described,
                gib(r.plan.peak_bytes),
                f"{r.time.tokens_per_s:,.0f}",
                f"{mfu:.0%}",
                f"{r.time.total_s:.2f}",
            )
        table.add_section()
    return table, why


def train_command(model: str, strategy: Strategy) -> str:
    """The `memfit train` command line of a strategy (under torchrun on several GPUs); `model`:
    what --model was given (a preset, or the path of a config.json)."""
    launch = "memfit train"
    if strategy.world_size > 1:
        launch = f"torchrun --nproc_per_node {strategy.world_size} -m memfit train"
    parts = [
        f"{launch} --model {shlex.quote(model)} --precision {strategy.precision}",
        f"--seq-len {strategy.seq_len} --micro-batch {strategy.micro_batch}",
        f"--grad-accum {strategy.grad_accum} --checkpointing {strategy.checkpointing}",
    ]
    if strategy.checkpoint_blocks is not None:
        parts.append(f"--checkpoint-blocks {strategy.checkpoint_blocks}")
    if strategy.zero:
        parts.append(f"--zero {strategy.zero}")
    if strategy.offload != "none":
        parts.append(f"--offload {strategy.offload}")
    if strategy.optimizer != "adamw":
        parts.append(f"--optimizer {strategy.optimizer}")
    if strategy.master_weights != "fp32":
        parts.append(f"--master-weights {strategy.master_weights}")
    if strategy.offload_activations:
        parts.append("--offload-activations")
    if strategy.cuda_graphs:
        parts.append("--cuda-graphs")
    if strategy.fp32_parts:
        parts.append(f"--fp32-parts {strategy.fp32_parts}")
    if strategy.fp32_matmul != "fp32":
        parts.append(f"--fp32-matmul {strategy.fp32_matmul}")
    if strategy.lora_rank:
        parts.append(f"--lora-rank {strategy.lora_rank}")
        if strategy.lora_targets != LORA_TARGETS:
            parts.append(f"--lora-targets {','.join(strategy.lora_targets)}")
        if strategy.lora_dropout:
            parts.append(f"--lora-dropout {strategy.lora_dropout:g}")
    if strategy.quantize_base != "none":
        parts.append(f"--quantize-base {strategy.quantize_base}")
    if strategy.teacher is not None:
        parts.append("--teacher TEACHER_CHECKPOINT")
        if strategy.teacher_quantize != "none":
            parts.append(f"--teacher-quantize {strategy.teacher_quantize}")
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
    check_at_least("--lora-rank", args.lora_rank, 0, what=" (0: no LoRA)")


def run_plan(args: argparse.Namespace, console: Console) -> int:
    from_config = resolve_strategy_flags(args)
    check_plan_flags(args)
    if args.serve:
        return run_plan_serve(args, console)
    model = load_model_config(args.model)
    if args.attention_pattern:  # (the run's sparse attention: its attention FLOPs)
        model = dataclasses.replace(
            model, attention_pattern=args.attention_pattern, pattern_layers=args.pattern_layers
        )
    if args.seq_len is None:
        args.seq_len = min(TRAIN_SEQ_LEN, model.max_seq_len)
    check_seq_len(model, args.seq_len)  # the engine refuses the same lengths
    fields = fine_tuning(args, from_config)
    if args.recommend:
        if args.fp32_parts or args.fp32_matmul != "fp32":
            raise ValueError(
                "--recommend ranks bf16 strategies and takes no --fp32-parts or --fp32-matmul "
                "yet: plan the strategy it lists with them (memfit plan ... --fp32-parts ...)"
            )
        return run_rank_strategies(args, console, model, fields)
    gpu = get_gpu(args.gpu)
    if args.checkpointing == "auto" and args.checkpoint_blocks is not None:
        raise ValueError(
            f"--checkpoint-blocks {args.checkpoint_blocks} with --checkpointing auto: auto "
            "chooses the blocks; drop one of them"
        )
    strategy = Strategy(
        precision=args.precision,
        micro_batch=args.micro_batch,
        seq_len=args.seq_len,
        grad_accum=args.grad_accum,
        checkpointing="none" if args.checkpointing == "auto" else args.checkpointing,
        checkpoint_blocks=args.checkpoint_blocks,
        optimizer=args.optimizer,
        master_weights=args.master_weights,
        attention=getattr(args, "attention", "auto"),
        zero=args.zero,
        offload=args.offload,
        offload_activations=args.offload_activations,
        cuda_graphs=args.cuda_graphs,
        fp32_parts=args.fp32_parts,
        fp32_matmul=args.fp32_matmul,
        world_size=args.gpus,
        **fields,
    )
    chose = None
    if args.checkpointing == "auto":
        strategy, chose = choose_checkpointing(model, strategy, gpu)
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
        f"{gpu.name} ({gib(gpu.memory_bytes)}): {escape(strategy.describe())}",
        highlight=False,
    )
    if chose is not None:
        console.print(f"checkpointing auto: {escape(chose)}", highlight=False)
    if strategy.lora_rank:
        stored = strategy.quantize_base if strategy.quantize_base != "none" else strategy.precision
        console.print(
            f"trains {format_params(result.trainable_params)} adapter parameters "
            f"({result.trainable_params / model.num_params:.2%}) on a frozen base in {stored}",
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
    table.add_row(
        f"needed (+{result.slack:.0%} allocator slack, CUDA context)", gib(result.required_bytes)
    )
    console.print(table)
    teacher = f", teacher {time.teacher_s:.3f}" if strategy.teacher is not None else ""
    host = f", host launches beyond the GPU's work {time.host_s:.3f}" if time.host_s else ""
    console.print(
        f"step: {time.total_s:.3f} s, {time.tokens_per_s:,.0f} tokens/s per GPU "
        f"(compute {time.compute_s:.3f}, recompute {time.recompute_s:.3f}, optimizer "
        f"{time.optimizer_s:.3f}, communication {time.communication_s:.3f}{teacher}{host} s; "
        "memfit's "
        "time model)",
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
        kv_cache_dtype=args.kv_cache_dtype,
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
            f"{result.num_blocks:,} blocks + 1 scratch x {result.kv_bytes_per_block / 2**20:.2f} MiB"
            + (f" ({result.kv_cache_dtype})" if result.kv_cache_dtype != "auto" else ""),
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
    p.add_argument(
        "--config",
        metavar="FILE.toml",
        help="plan the run this `memfit train --config` file describes ([model], [data], "
        "[train], [distributed], [lora], [distill]); the flags given beside it override it",
    )
    p.add_argument(
        "--model", help="preset or path to a HF config.json (default llama-1b, or --config's)"
    )
    p.add_argument(
        "--gpu",
        default="h100-sxm",
        help="h100-sxm, h100-pcie, h200, a100-40gb, a100-80gb, l40s, ...",
    )
    p.add_argument("--gpus", type=int, default=1, help="data-parallel GPUs")
    p.add_argument(
        "--precision",
        choices=["fp32", "bf16", "fp16"],
        help="training precision (default bf16); with --serve, the weights' and KV cache's dtype",
    )
    p.add_argument("--micro-batch", type=int, help="sequences per forward (default 1)")
    p.add_argument(
        "--seq-len",
        type=int,
        help=f"tokens per sequence, at most the model's max_seq_len (default {TRAIN_SEQ_LEN} or "
        "that if shorter; with --serve, the model's max_seq_len)",
    )
    p.add_argument("--grad-accum", type=int, help="micro-batches per step (default 1)")
    p.add_argument(
        "--checkpointing",
        choices=["none", "full", "selective", "auto"],
        help="default none; auto: what `memfit train --checkpointing auto` chooses on --gpu",
    )
    p.add_argument(
        "--attention-pattern",
        metavar="SPEC",
        help="a sparse attention pattern (as memfit train's): its attention FLOPs in the time",
    )
    p.add_argument("--pattern-layers", metavar="WHICH", help="all (default), even, odd, 0,2,5")
    p.add_argument(
        "--checkpoint-blocks",
        type=int,
        metavar="N",
        help="with --checkpointing full or selective: only the first N blocks (default all)",
    )
    p.add_argument("--optimizer", choices=list(OPTIMIZERS), help="default adamw")
    p.add_argument(
        "--master-weights",
        choices=["fp32", "none"],
        help="none: bf16 parameters without fp32 masters (bf16, adamw8bit, one GPU); default fp32",
    )
    p.add_argument("--zero", type=int, choices=[0, 1, 2, 3], help="default 0")
    p.add_argument("--offload", choices=["none", "optimizer", "params"], help="default none")
    p.add_argument(
        "--offload-activations",
        action="store_true",
        default=None,
        help="activations in pinned CPU memory (with --checkpointing: the block inputs)",
    )
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        default=None,
        help="the step captured in a CUDA graph (the host's launches priced out of the step)",
    )
    p.add_argument(
        "--fp32-parts",
        metavar="PARTS",
        help="parts computing in fp32 under bf16/fp16: head, first:N, last:N (comma-separated)",
    )
    p.add_argument(
        "--fp32-matmul",
        choices=["fp32", "tf32"],
        help="how fp32 products run: fp32 (default) or tf32 on the tensor cores",
    )
    p.add_argument(
        "--host-cpus",
        type=int,
        default=16,
        help="CPU cores of each training node: the speed of offload's CPU step (default 16)",
    )
    p.add_argument(
        "--host-memory",
        type=float,
        help="GiB of CPU memory of each node: --recommend pins at most half of it (activation "
        "offload); default this machine's",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--recommend",
        action="store_true",
        help="list the fastest strategies that fit (micro-batch, accumulation, checkpointing) "
        "of each goal: full fine-tuning, LoRA and QLoRA, or the one --lora-rank / "
        "--quantize-base / --config ask for",
    )
    tuning = p.add_argument_group("LoRA, QLoRA and distillation (as `memfit train` takes them)")
    tuning.add_argument(
        "--lora-rank",
        type=int,
        help="LoRA adapters of this rank on a frozen base (0: every weight trains; --recommend "
        f"plans LoRA and QLoRA at {LORA_RANK} unless given)",
    )
    tuning.add_argument(
        "--lora-targets",
        help="comma-separated layers: q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj "
        "or all-linear (default)",
    )
    tuning.add_argument("--lora-dropout", type=float, help="dropout on the adapters' input")
    tuning.add_argument(
        "--quantize-base",
        choices=["none", "nf4", "int8"],
        help="QLoRA: the frozen base in 4-bit NF4 (or int8); needs --lora-rank",
    )
    tuning.add_argument(
        "--teacher",
        help="distill from this teacher: a preset, a HF config.json or checkpoint directory, or "
        "a memfit checkpoint (same vocabulary as --model)",
    )
    tuning.add_argument("--teacher-quantize", choices=["none", "nf4", "int8"])
    tuning.add_argument("--distill-kind", choices=["kl", "jsd"])
    tuning.add_argument("--distill-temperature", type=float, help="softmax temperature (default 1)")
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
        "--kv-cache-dtype",
        choices=["auto", "fp8", "int8"],
        default="auto",
        help="the KV cache's element type: auto (--precision), fp8 or int8 (one byte: twice the "
        "tokens)",
    )
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
