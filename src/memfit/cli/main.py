"""`memfit` command line: parse, call the library, print. Subcommands: train, plan, profile,
generate."""

from __future__ import annotations

import argparse
import logging
import sys

from rich.console import Console
from rich.logging import RichHandler
from rich.text import Text

from memfit import __version__

console = Console(stderr=False, emoji=False)  # ":x:" in a path stays ":x:"


def _train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train a model (default: preset tiny on the built-in synthetic corpus)",
        description="Train a Llama-family model on the present device (data-parallel with --zero under "
        "torchrun, --offload to CPU memory). Every flag is also settable as "
        "--set section.key=value and from --config file.toml (flags override the file, --set overrides both).",
    )
    _add_run_flags(p)
    p.add_argument(
        "--auto",
        action="store_true",
        help="let the planner pick micro-batch, accumulation and checkpointing for the present GPU",
    )
    p.set_defaults(handler=_cmd_train)


def _profile_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile",
        help="measure the memory of real training steps, beside the plan",
        description="Run a few training steps of the configuration (same flags as train) on the present "
        "device, measure memory by category and phase, print it beside memfit's plan, and on CUDA write a "
        "memory-over-time plot of one step.",
    )
    _add_run_flags(p)
    p.add_argument(
        "--profile-steps", type=int, default=3, help="measured steps (after one warm-up step)"
    )
    p.add_argument(
        "--png", help="where to write the timeline plot (default RUN_DIR/memory_timeline.png)"
    )
    p.set_defaults(handler=_cmd_profile)


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        metavar="FILE.toml",
        help="TOML file with [model], [data], [train], ... sections",
    )
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override any config key, e.g. --set train.weight_decay=0.0 (repeatable)",
    )
    p.add_argument(
        "--model",
        help="preset (tiny, llama-1b, llama-2-7b, ...), a HF config.json (random weights) or a "
        "HF checkpoint directory (its weights)",
    )
    p.add_argument("--data", help="synthetic (built in), a .txt/.jsonl file, or a folder of them")
    p.add_argument("--tokenizer", help="byte (default) or path to a tokenizer.json")
    p.add_argument("--steps", type=int, help="optimizer steps")
    p.add_argument("--seq-len", type=int, help="tokens per sequence")
    p.add_argument("--micro-batch", type=int, help="sequences per forward/backward")
    p.add_argument("--grad-accum", type=int, help="micro-batches per optimizer step")
    p.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp16"])
    p.add_argument(
        "--checkpointing",
        choices=["none", "full", "selective", "auto"],
        help="activation checkpointing (auto: the planner's fastest that fits the GPU's memory, "
        "on as few blocks as it takes)",
    )
    p.add_argument(
        "--checkpoint-blocks",
        type=int,
        metavar="N",
        help="with --checkpointing full or selective: checkpoint only the first N blocks; the "
        "others keep their activations (faster, more memory; default all)",
    )
    p.add_argument(
        "--zero", type=int, choices=[0, 1, 2, 3], help="ZeRO stage (0: plain data parallel)"
    )
    p.add_argument("--offload", choices=["none", "optimizer", "params"])
    p.add_argument(
        "--offload-activations",
        action="store_true",
        default=None,
        help="each block's input (with --checkpointing full or selective), or else what each "
        "block saves, goes to pinned CPU memory in the forward and comes back one block ahead "
        "in the backward",
    )
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        default=None,
        help="capture the step in a CUDA graph and replay it: the host's kernel launches leave "
        "the step (small models; one process, bf16 or fp32, --optimizer adamw)",
    )
    p.add_argument(
        "--fp32-parts",
        metavar="PARTS",
        help="parts that compute in fp32 under bf16/fp16: head, first:N, last:N, "
        "comma-separated (e.g. head,first:1,last:1); fp32 products run far slower, so "
        "`memfit plan --fp32-parts` prices it first",
    )
    p.add_argument(
        "--fp32-matmul",
        choices=["fp32", "tf32"],
        help="how fp32 products run (the fp32 parts', an fp32 run's): fp32 (default) or tf32 on "
        "the tensor cores, about 4x faster on an H100 with 10-bit mantissa inputs",
    )
    p.add_argument(
        "--reduce-dtype", choices=["fp32", "bf16"], help="dtype of the gradient collectives"
    )
    p.add_argument("--attention", choices=["auto", "flash", "sdpa", "eager"])
    p.add_argument(
        "--attention-pattern",
        metavar="SPEC",
        help="sparse attention: local:W, strided:S, dilated:K[:window=W], longformer:W:globals=0, "
        "bigbird:W:globals=0:random=R (on the layers of --pattern-layers)",
    )
    p.add_argument(
        "--pattern-layers", metavar="WHICH", help="all (default), even, odd or indices 0,2,5"
    )
    p.add_argument(
        "--optimizer",
        help="a registered optimizer: adamw (default), adamw8bit, adafactor, sm3, sgd",
    )
    p.add_argument(
        "--master-weights",
        choices=["fp32", "none"],
        help="fp32 (default): fp32 parameters, bf16 compute; none: bf16 parameters updated with "
        "stochastic rounding (--precision bf16 --optimizer adamw8bit)",
    )
    p.add_argument(
        "--lr",
        type=float,
        help="peak learning rate (default: by the model's size, 3e-3 for tiny to 1.5e-4 at 8B)",
    )
    p.add_argument("--seed", type=int)
    p.add_argument("--device", help="auto (default), cpu, cuda, cuda:1, ...")
    p.add_argument(
        "--compile",
        choices=["auto", "on", "off"],
        help="torch.compile each block (auto: on for CUDA without --checkpointing)",
    )
    p.add_argument(
        "--lora-rank", type=int, help="train LoRA adapters of this rank on a frozen base (0: off)"
    )
    p.add_argument("--lora-alpha", type=float, help="LoRA scale numerator (default 16)")
    p.add_argument("--lora-dropout", type=float, help="dropout on the adapters' input")
    p.add_argument(
        "--lora-targets",
        help="comma-separated layers: q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj "
        "or all-linear (default)",
    )
    p.add_argument(
        "--rslora", action="store_true", default=None, help="scale by alpha / sqrt(rank)"
    )
    p.add_argument(
        "--quantize-base",
        choices=["none", "nf4", "int8"],
        help="QLoRA: keep the frozen base in 4-bit NF4 (or int8); needs --lora-rank",
    )
    p.add_argument(
        "--teacher", help="distill from this checkpoint directory (same vocabulary as --model)"
    )
    p.add_argument("--distill-alpha", type=float, help="distillation weight (default 0.5)")
    p.add_argument("--distill-temperature", type=float, help="softmax temperature (default 1)")
    p.add_argument("--distill-kind", choices=["kl", "jsd"])
    p.add_argument("--teacher-quantize", choices=["none", "nf4", "int8"])
    p.add_argument("--out", help="run directory (default runs/<model>-<date>-<time>)")
    p.add_argument("--save-every", type=int, help="checkpoint every N steps (default: at the end)")
    p.add_argument("--resume", action="store_true", default=None, help="continue the run in --out")
    p.add_argument(
        "--resume-from",
        metavar="CHECKPOINT",
        help="continue the run in --out from this checkpoint: step_N, N, a path, or latest-valid "
        "(the newest that passes verification)",
    )


def _generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text with the paged inference engine",
        description="Continue --prompt, or every prompt of --prompts, with continuous batching "
        "over a paged KV cache.",
    )
    p.add_argument(
        "model",
        help="a memfit run or checkpoint directory, a Hugging Face checkpoint directory, or a "
        "preset name (random weights)",
    )
    p.add_argument("--prompt", default="", help="text to continue")
    p.add_argument(
        "--prompts",
        help='a file of prompts, one per line or JSONL ({"prompt": ...}): all run through the '
        "engine together, with a progress bar and a summary",
    )
    p.add_argument("--output", help="with --prompts: write one JSON line per prompt here")
    p.add_argument("--block-size", type=int, default=16, help="KV cache block size in tokens")
    p.add_argument(
        "--gpu-memory-fraction",
        type=float,
        default=0.9,
        help="on CUDA: the share of GPU memory for the weights, activations and the KV pool",
    )
    p.add_argument("--max-model-len", type=int, help="longest prompt + output (default: model's)")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 for greedy decoding")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top one")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="1: off")
    p.add_argument("--tokenizer", help="override the tokenizer recorded in the checkpoint")
    _quantization_flags(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.set_defaults(handler=_cmd_generate)


def _quantization_flags(p: argparse.ArgumentParser) -> None:
    """--quantize and --kv-cache-dtype, as generate and serve take them."""
    p.add_argument(
        "--quantize",
        choices=["int8", "int4"],
        help="weight-only quantization of the blocks' linear layers at load: int8 per output "
        "channel, int4 in groups of 128 (the embedding and output head stay in bf16)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "fp8", "int8"],
        default="auto",
        help="the KV cache's element type: auto (the model's dtype), fp8 (e4m3) or int8, with "
        "per-head scales: twice the tokens in the same memory (int8 loses less quality)",
    )


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="/v1/completions and /v1/chat/completions (streaming or not), /v1/models, "
        "/health and /metrics, over the paged engine with continuous batching.",
    )
    p.add_argument(
        "model",
        help="a memfit run or checkpoint directory, a Hugging Face checkpoint directory, or a "
        "preset name (random weights)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", help="the model id clients ask for (default: MODEL)")
    p.add_argument("--max-model-len", type=int, help="longest prompt + output (default: model's)")
    p.add_argument(
        "--gpu-memory-fraction",
        type=float,
        default=0.9,
        help="on CUDA: the share of GPU memory for the weights, activations and the KV pool",
    )
    p.add_argument("--block-size", type=int, default=16, help="KV cache block size in tokens")
    _quantization_flags(p)
    p.add_argument("--max-running", type=int, default=256, help="sequences decoded together")
    p.add_argument(
        "--max-waiting", type=int, default=256, help="queued requests before new ones get 429"
    )
    p.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="stream a request's tokens once this many have come (fewer events under load)",
    )
    p.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="compute every prompt in full (default: reuse the KV blocks of cached prefixes)",
    )
    p.add_argument(
        "--max-step-tokens",
        "--max-num-batched-tokens",
        dest="max_step_tokens",
        type=int,
        default=2048,
        help="tokens a step may hold (decodes plus prefill chunks): a longer prompt is computed in "
        "chunks between the running decodes",
    )
    p.add_argument(
        "--api-servers",
        type=int,
        default=1,
        help="HTTP processes that share the engine (vLLM's --api-server-count): under heavy "
        "load one process's Python is the limit",
    )
    p.add_argument(
        "--engine-in-thread",
        action="store_true",
        help="step the engine in a thread of the server's process (default: a process of its "
        "own, so that the HTTP side and the engine never wait for each other's Python)",
    )
    p.add_argument("--device", default="auto")
    p.set_defaults(handler=_cmd_serve)


def _export_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="a run or checkpoint as a Hugging Face checkpoint (LoRA adapters merged), or any "
        "checkpoint quantized (--quantize)",
        description="Write a memfit run (its newest complete checkpoint) or checkpoint as a "
        "Hugging Face checkpoint directory that transformers and vLLM load. A LoRA run's "
        "adapters are merged into the weights; RUN/adapter holds them alone, in peft's format. "
        "With --quantize, a run or a Hugging Face checkpoint is written with its blocks' linear "
        "weights in int8 or int4, which memfit generate / serve / LLM load as stored.",
    )
    p.add_argument(
        "path", metavar="RUN", help="a memfit run directory or checkpoint (or, with --quantize, "
        "a Hugging Face checkpoint directory)",
    )  # fmt: skip
    p.add_argument("--out", required=True, help="the directory to write (new or empty)")
    p.add_argument(
        "--merge",
        action="store_true",
        help="merge LoRA adapters into the weights (what export always does for a LoRA run)",
    )
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument(
        "--quantize",
        choices=["int8", "int4"],
        help="write the blocks' linear weights quantized (int8 per channel, int4 in groups of "
        "128), quantized once here instead of at each load",
    )
    p.add_argument(
        "--calibrate",
        choices=["awq", "gptq", "awq+gptq"],
        help="with --quantize: pick the levels from the model's inputs on calibration text "
        "instead of rounding each weight to nearest: awq scales the weights of loud input "
        "channels up before quantizing, gptq moves each weight's rounding error onto the weights "
        "not yet quantized; int4 gains most",
    )
    p.add_argument(
        "--calibration-text",
        help="a text file for --calibrate (default: the license text Python ships, LICENSE.txt)",
    )
    p.add_argument(
        "--calibration-tokens",
        type=int,
        default=8192,
        help="tokens of --calibration-text to calibrate on, in rows of 512 (default 8192)",
    )
    p.add_argument(
        "--device", default="cpu", help="where to quantize with --quantize (cuda is faster)"
    )
    p.set_defaults(handler=_cmd_export)


def _cmd_export(args: argparse.Namespace) -> int:
    from memfit.cli.export import Calibration, run_export

    calibration = None
    if args.calibrate is not None:
        if args.quantize is None:
            raise ValueError("--calibrate chooses how --quantize quantizes: give --quantize too")
        calibration = Calibration(args.calibrate, args.calibration_text, args.calibration_tokens)
    return run_export(
        args.path, args.out, args.dtype, console, args.quantize, args.device, calibration
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="memfit",
        description="Train and serve transformer language models in the GPU memory you have.",
    )
    parser.add_argument("--version", action="version", version=f"memfit {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _train_parser(sub)
    _profile_parser(sub)
    _generate_parser(sub)
    _serve_parser(sub)
    _export_parser(sub)
    from memfit.cli.plan import add_plan_parser

    add_plan_parser(sub, _cmd_plan)
    return parser


_TRAIN_FLAGS = {
    "model": ("model", "name"),
    "attention": ("model", "attention"),
    "attention_pattern": ("model", "attention_pattern"),
    "pattern_layers": ("model", "pattern_layers"),
    "compile": ("model", "compile"),
    "data": ("data", "source"),
    "tokenizer": ("data", "tokenizer"),
    "seq_len": ("data", "seq_len"),
    "steps": ("train", "steps"),
    "micro_batch": ("train", "micro_batch"),
    "grad_accum": ("train", "grad_accum"),
    "precision": ("train", "precision"),
    "checkpointing": ("train", "checkpointing"),
    "checkpoint_blocks": ("train", "checkpoint_blocks"),
    "offload_activations": ("train", "offload_activations"),
    "cuda_graphs": ("train", "cuda_graphs"),
    "fp32_parts": ("train", "fp32_parts"),
    "fp32_matmul": ("train", "fp32_matmul"),
    "optimizer": ("train", "optimizer"),
    "master_weights": ("train", "master_weights"),
    "lr": ("train", "lr"),
    "seed": ("train", "seed"),
    "device": ("train", "device"),
    "zero": ("distributed", "zero"),
    "offload": ("distributed", "offload"),
    "reduce_dtype": ("distributed", "reduce_dtype"),
    "lora_rank": ("lora", "rank"),
    "lora_alpha": ("lora", "alpha"),
    "lora_dropout": ("lora", "dropout"),
    "lora_targets": ("lora", "targets"),
    "rslora": ("lora", "rslora"),
    "quantize_base": ("lora", "quantize"),
    "teacher": ("distill", "teacher"),
    "distill_alpha": ("distill", "alpha"),
    "distill_temperature": ("distill", "temperature"),
    "distill_kind": ("distill", "kind"),
    "teacher_quantize": ("distill", "teacher_quantize"),
    "out": ("checkpoint", "out"),
    "save_every": ("checkpoint", "save_every"),
    "resume": ("checkpoint", "resume"),
    "resume_from": ("checkpoint", "resume_from"),
}


def _run_config(args: argparse.Namespace):
    from memfit.config import build_config

    flags: dict[str, dict] = {}
    for attr, (section, key) in _TRAIN_FLAGS.items():
        value = getattr(args, attr)
        if value is not None:
            flags.setdefault(section, {})[key] = value
    return build_config(args.config, flags, args.sets)


def _cmd_train(args: argparse.Namespace) -> int:
    from memfit.cli.train import run_train

    return run_train(_run_config(args), console, auto=args.auto)


def _cmd_profile(args: argparse.Namespace) -> int:
    from memfit.cli.profile import run_profile
    from memfit.planner import detect_gpu, plan

    def plan_fn(trainer):
        return plan(trainer.model_config, trainer.strategy(), detect_gpu())

    return run_profile(
        _run_config(args), console, steps=args.profile_steps, plan_fn=plan_fn, png=args.png
    )


def _cmd_plan(args: argparse.Namespace) -> int:
    from memfit.cli.plan import run_plan

    return run_plan(args, console)


def _cmd_generate(args: argparse.Namespace) -> int:
    from memfit.cli.generate import run_generate

    return run_generate(args, console)


def _cmd_serve(args: argparse.Namespace) -> int:
    from memfit.cli.serve import run_serve

    return run_serve(args, console)


# What a user's input can cause, reported as one line; any other exception is a bug and keeps its
# traceback. (json.JSONDecodeError and UnicodeDecodeError are ValueErrors.)
_INPUT_ERRORS = (
    ValueError,
    FileNotFoundError,
    FileExistsError,
    IsADirectoryError,
    NotADirectoryError,
    PermissionError,
)


def _print_error(label: str, message: str) -> None:
    """`label: message` on stderr, the message literally: it holds paths, keys and text that came
    from the user, which rich would otherwise read as markup ("[train]", "[/]")."""
    Console(stderr=True, soft_wrap=True, emoji=False).print(
        Text.assemble((label, "bold red"), " ", message), highlight=False
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(message)s",
        handlers=[
            RichHandler(console=Console(stderr=True, emoji=False), show_path=False, show_time=False)
        ],
    )
    import torch

    from memfit.train.checkpoint import CheckpointError
    from memfit.train.engine import OutOfMemory, TrainingDiverged

    try:
        return args.handler(args)
    except torch.OutOfMemoryError as error:
        message = str(error).strip()
        if not isinstance(error, OutOfMemory):  # not from a training step: the generic advice
            message = (
                (message.splitlines()[0] if message else "CUDA out of memory")
                + "\nTry a smaller --micro-batch (with a larger --grad-accum), --checkpointing "
                "full, or a shorter --seq-len."
            )
        _print_error("out of memory:", message)
        return 3
    except (*_INPUT_ERRORS, CheckpointError, TrainingDiverged) as error:
        if args.verbose:
            raise
        _print_error("error:", _one_line(error))
        return 2
    except KeyboardInterrupt:
        Console(stderr=True).print("[yellow]interrupted[/]")
        return 130


def _one_line(error: BaseException) -> str:
    """The message of `error`; an OSError's as "what: 'path'" without its "[Errno N]" prefix."""
    if isinstance(error, OSError) and error.strerror and error.filename is not None:
        return f"{error.strerror}: {str(error.filename)!r}"
    return str(error)


if __name__ == "__main__":
    sys.exit(main())
