"""Does keeping parts of a model in fp32 steady a run that is unstable in fp16 or bf16 (issue 20,
item 4)? llama-1b shapes, random weights, the built-in synthetic corpus, 256 tokens x 16
sequences a step, learning rates of 3e-3 and 1e-2 (above the 3e-4 memfit picks for 1B
parameters, to provoke trouble), 20 warm-up steps, the same seed: each precision with no fp32
parts, the head and the end blocks, more blocks, and every block.

    python benchmarks/fp16_stability.py [--steps 300] [--out DIR]

Each run records its loss per step, the steps fp16's loss scaler skipped, and the error that
ended it (memfit stops an fp16 run after 50 consecutive overflowing steps).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from harness import append_results, environment

from memfit.config import build_config
from memfit.train.engine import Trainer, TrainingDiverged, use_expandable_segments

RUNS = [
    (precision, parts, lr)
    for lr in (3e-3, 1e-2)
    for precision in ("fp16", "bf16")
    for parts in ("", "first:1,last:1,head")
] + [("fp16", "first:4,last:4,head", 3e-3), ("fp16", "first:8,last:8,head", 3e-3)]


def run(precision: str, parts: str, lr: float, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        config = build_config(
            flags={
                "model": {"name": "llama-1b", "compile": "off"},
                "data": {"seq_len": 256},
                "train": {
                    "steps": steps, "micro_batch": 16, "precision": precision, "lr": lr,
                    "fp32_parts": parts, "warmup_steps": 20,
                },
                "checkpoint": {"out": out},
            }
        )  # fmt: skip
        trainer = Trainer(config)
        losses, skipped, error = [], 0, None
        start = time.perf_counter()
        try:
            for _ in range(steps):
                metrics = trainer.train_step()
                losses.append(metrics.loss)
                skipped += metrics.skipped
        except TrainingDiverged as diverged:
            error = str(diverged)
        seconds = time.perf_counter() - start
        del trainer
    torch.cuda.empty_cache()
    finite = [x for x in losses if x == x]
    return {
        "precision": precision, "fp32_parts": parts, "lr": lr, "steps": len(losses),
        "skipped_steps": skipped, "error": error, "losses": losses,
        "min_loss": min(finite) if finite else None, "seconds": seconds,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", help="a folder for the results (default benchmarks/results)")
    args = parser.parse_args()
    use_expandable_segments()
    records = []
    for precision, parts, lr in RUNS:
        record = run(precision, parts, lr, args.steps)
        records.append(record)
        ended = record["error"][:60] if record["error"] else "ran"
        print(
            f"{precision} lr {lr:g} fp32 parts {parts or '-'}: {record['steps']} steps, "
            f"{record['skipped_steps']} skipped, lowest loss {record['min_loss']}, {ended}",
            flush=True,
        )
    env = environment()
    print("wrote", append_results("fp16_stability", {"env": env, "records": records}, args.out))


if __name__ == "__main__":
    main()
