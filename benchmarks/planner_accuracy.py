"""Planner accuracy: predicted peak memory against torch.cuda.max_memory_allocated() of real
training steps, over configurations from preset tiny to llama-3-8b.

For each configuration: plan it, then build memfit's Trainer and run steps; the measured peak is
the maximum allocated over steps 2..N (step 1 creates the optimizer states lazily, so steady
state starts at step 2). A configuration that runs out of memory is recorded as such, and the
planner must have predicted that it does not fit.

    python benchmarks/planner_accuracy.py
"""

from __future__ import annotations

import argparse
import gc
import tempfile

import torch
from harness import append_results, environment
from rich.console import Console
from rich.table import Table

from memfit.config import build_config
from memfit.models import load_model_config
from memfit.planner.hardware import detect_gpu
from memfit.planner.memory import Strategy, plan
from memfit.train.engine import Trainer
from memfit.train.precision import autocast

# (model, seq_len, micro_batch, checkpointing, precision, optimizer[, master weights])
CONFIGS = [
    ("tiny", 512, 16, "none", "fp32", "adamw"),
    ("tiny", 512, 32, "full", "bf16", "sgd"),
    ("tiny", 256, 8, "selective", "fp16", "sgd"),
    ("llama-1b", 512, 16, "none", "fp32", "sgd"),
    ("llama-1b", 2048, 2, "full", "fp32", "adamw"),
    ("llama-1b", 1024, 8, "selective", "fp16", "sgd"),
    ("llama-1b", 2048, 4, "none", "bf16", "adamw"),
    ("llama-1b", 2048, 8, "full", "bf16", "adamw"),
    ("llama-1b", 2048, 16, "none", "bf16", "adamw"),
    ("llama-1b", 4096, 2, "selective", "bf16", "adamw"),
    ("llama-1b", 8192, 1, "full", "fp16", "adamw"),
    ("llama-1b", 8192, 2, "none", "bf16", "adamw"),
    ("llama-1b", 4096, 16, "none", "bf16", "adamw"),
    ("llama-2-7b", 2048, 1, "full", "bf16", "sgd"),
    ("llama-2-7b", 512, 1, "full", "bf16", "adamw"),
    ("llama-3-8b", 1024, 1, "full", "bf16", "adamw"),
    ("llama-1b", 2048, 8, "full", "bf16", "adamw8bit"),
    ("llama-1b", 2048, 8, "full", "bf16", "adamw8bit", "none"),
    ("llama-1b", 2048, 4, "none", "bf16", "adafactor"),
    ("llama-3-8b", 2048, 1, "full", "bf16", "adamw8bit", "none"),
    ("llama-3-8b", 2048, 4, "full", "bf16", "adamw8bit", "none"),
]


def measure(
    model: str,
    seq_len: int,
    micro_batch: int,
    checkpointing: str,
    precision: str,
    optimizer: str,
    master_weights: str,
    steps: int,
) -> dict:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory() as out:
        try:
            config = build_config(
                flags={
                    "model": {"name": model, "compile": "off"},
                    "data": {"seq_len": seq_len},
                    "train": {
                        "micro_batch": micro_batch,
                        "checkpointing": checkpointing,
                        "precision": precision,
                        "optimizer": optimizer,
                        "master_weights": master_weights,
                        "lr": 1e-5,
                        "steps": steps,
                    },
                    "checkpoint": {"out": out},
                }
            )
            trainer = Trainer(config)
            vocab = trainer.model_config.vocab_size
            generator = torch.Generator().manual_seed(0)

            def batches():
                while True:
                    tokens = torch.randint(
                        0, vocab, (micro_batch, seq_len + 1), generator=generator
                    )
                    yield tokens[:, :-1], tokens[:, 1:]

            trainer.batches = batches()
            trainer.train_step()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            for _ in range(steps - 1):
                trainer.train_step()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
            # what one forward leaves alive for backward (activations, loss buffers, weight copies)
            inputs, targets = (t.cuda() for t in next(trainer.batches))
            before = torch.cuda.memory_allocated()
            with autocast(trainer.precision, trainer.device):
                loss = trainer.model(inputs, targets)
            forward_kept = torch.cuda.memory_allocated() - before
            loss.backward()
            trainer.optimizer.zero_grad(set_to_none=True)
            return {"peak_bytes": peak, "oom": False, "forward_kept_bytes": forward_kept}
        except torch.OutOfMemoryError:
            return {"peak_bytes": None, "oom": True}
        finally:
            trainer = None  # noqa: F841 - free the model before the next configuration
            gc.collect()
            torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--no-save", action="store_true")
    parser.add_argument(
        "--match", nargs="*", help="only the configurations whose description holds one of these"
    )
    args = parser.parse_args()
    gpu = detect_gpu()
    if gpu is None:
        raise SystemExit("benchmarks/planner_accuracy.py needs a CUDA GPU of the planner's catalog")
    records = []
    for model, seq_len, micro_batch, checkpointing, precision, optimizer, *rest in CONFIGS:
        master_weights = rest[0] if rest else "fp32"
        strategy = Strategy(
            precision=precision,
            micro_batch=micro_batch,
            seq_len=seq_len,
            checkpointing=checkpointing,
            optimizer=optimizer,
            master_weights=master_weights,
        )
        described = f"{model} {strategy.describe()}"
        if args.match and not any(m in described for m in args.match):
            continue
        predicted = plan(load_model_config(model), strategy, gpu)
        measured = measure(
            model, seq_len, micro_batch, checkpointing, precision, optimizer, master_weights,
            args.steps,
        )  # fmt: skip
        error = None
        if measured["peak_bytes"]:
            error = predicted.peak_bytes / measured["peak_bytes"] - 1
        record = {
            "model": model,
            "strategy": strategy.describe() + ("" if optimizer != "adamw" else ", adamw"),
            "predicted_peak_bytes": predicted.peak_bytes,
            "predicted_phases": predicted.phases,
            "predicted_fits": predicted.fits,
            "measured_peak_bytes": measured["peak_bytes"],
            "measured_oom": measured["oom"],
            "predicted_forward_kept_bytes": predicted.forward_kept_bytes,
            "measured_forward_kept_bytes": measured.get("forward_kept_bytes"),
            "error": error,
        }
        records.append(record)
        print(
            f"{model:>11} {strategy.describe():<45} predicted {predicted.peak_bytes / 2**30:7.2f} GiB "
            f"(fits={predicted.fits}) measured "
            + (
                "OOM"
                if measured["oom"]
                else f"{measured['peak_bytes'] / 2**30:7.2f} GiB  error {error:+.1%}"
                f"  forward kept: predicted {predicted.forward_kept_bytes / 2**30:.3f}"
                f" measured {measured['forward_kept_bytes'] / 2**30:.3f} GiB"
            ),
            flush=True,
        )
    run = {
        "benchmark": "planner_accuracy",
        "env": environment(),
        "gpu_capacity_bytes": gpu.memory_bytes,
        "steps": args.steps,
        "records": records,
    }
    if not args.no_save:
        print("wrote", append_results("planner_accuracy", run))
    table = Table(title=f"planner accuracy on {run['env'].get('gpu')}")
    for column in (
        "model",
        "strategy",
        "predicted",
        "measured",
        "error",
        "fit predicted / OOM measured",
    ):
        table.add_column(column)
    for r in records:
        table.add_row(
            r["model"],
            r["strategy"],
            f"{r['predicted_peak_bytes'] / 2**30:.2f} GiB",
            "OOM" if r["measured_oom"] else f"{r['measured_peak_bytes'] / 2**30:.2f} GiB",
            "-" if r["error"] is None else f"{r['error']:+.1%}",
            f"{r['predicted_fits']} / {r['measured_oom']}",
        )
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
