"""Where a training step's GPU time goes: torch.profiler's kernel table for memfit's step, llama-1b
at sequence 2048 by default (the train_step.py settings), or another preset, LoRA or QLoRA.

    python benchmarks/profile_step.py --micro-batch 4 --checkpointing none
    python benchmarks/profile_step.py --model llama-3-8b --checkpointing full --lora-rank 16
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile
from train_step import SEQ_LEN, random_batches

from memfit.config import build_config
from memfit.train.engine import Trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--checkpointing", default="none")
    parser.add_argument("--rows", type=int, default=30)
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--lora-rank", type=int, default=0)
    parser.add_argument("--quantize-base", default="none")
    args = parser.parse_args()
    lora = {"rank": args.lora_rank, "alpha": 2.0 * args.lora_rank, "quantize": args.quantize_base}
    with tempfile.TemporaryDirectory() as out:
        config = build_config(
            flags={
                "model": {"name": args.model, "attention": "sdpa" if not lora["rank"] else "auto"},
                "data": {"seq_len": SEQ_LEN},
                "train": {
                    "micro_batch": args.micro_batch,
                    "checkpointing": args.checkpointing,
                    "precision": "bf16",
                },
                "checkpoint": {"out": out},
                **({"lora": lora} if args.lora_rank else {}),
            }
        )
        trainer = Trainer(config)
        trainer.batches = random_batches(trainer.model_config.vocab_size, args.micro_batch, seed=0)
        for _ in range(3):
            trainer.train_step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                trainer.train_step()
            torch.cuda.synchronize()
        print(
            prof.key_averages().table(
                sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=90
            )
        )


if __name__ == "__main__":
    main()
