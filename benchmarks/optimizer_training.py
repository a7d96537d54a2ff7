"""Training with the memory-lean optimizers on the GPU: the loss each reaches against AdamW with
fp32 master weights, and its tokens/s and peak memory, in one process.

    python benchmarks/optimizer_training.py [--steps 300] [--out DIR]

The model is the llama-1b architecture scaled down (hidden 768, 12 layers, 12 query and 4
key/value heads, MLP 2048; about 76M parameters with the byte tokenizer), trained on memfit's
built-in synthetic corpus under bf16 autocast, 16 x 512 tokens a step, the same data order and
initialization for every run, no compile. The final loss is the mean of the last 20 steps.
Each run uses its optimizer's usual settings for this model: lr 3e-3 for AdamW, 8-bit AdamW
and Adafactor; SM3 as an Adagrad at a constant 0.03. `--master-weights none` runs keep bf16
parameters (8-bit AdamW with stochastic rounding).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import tempfile
import time
from pathlib import Path
from unittest import mock

import harness
import torch

import memfit.train.engine as engine
from memfit.config import build_config
from memfit.train.engine import Trainer

MODEL = {  # a Hugging Face config.json
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 258,
    "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
    "num_key_value_heads": 4, "intermediate_size": 2048, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
}  # fmt: skip
RUNS = [
    ("adamw", "fp32", {"lr": 3e-3}),
    ("adamw8bit", "fp32", {"lr": 3e-3}),
    ("adamw8bit", "fp32", {"lr": 3e-3, "8-bit embedding": True}),
    ("adamw8bit", "none", {"lr": 3e-3}),
    ("adafactor", "fp32", {"lr": 3e-3}),
    ("sm3", "fp32", {"lr": 0.03, "min_lr_ratio": 1.0, "weight_decay": 0.0}),
]


def train(
    config: Path, optimizer: str, master_weights: str, settings: dict, steps: int, out: str
) -> dict:
    flags = {
        "model": {"name": str(config), "compile": "off"},
        "data": {"seq_len": 512},
        "train": {"steps": steps, "micro_batch": 16, "warmup_steps": 30, "device": "cuda",
                  "precision": "bf16", "optimizer": optimizer, "master_weights": master_weights,
                  **settings},
        "checkpoint": {"out": out},
    }  # fmt: skip
    torch.cuda.reset_peak_memory_stats()
    with contextlib.ExitStack() as stack:
        if flags["train"].pop("8-bit embedding", False):  # the ablation: no 32-bit embedding
            plain = engine.parameter_groups
            groups = lambda *a: [{**g, "embedding": False} for g in plain(*a)]  # noqa: E731
            stack.enter_context(mock.patch.object(engine, "parameter_groups", groups))
        trainer = Trainer(build_config(flags=flags))
    metrics = [trainer.train_step() for _ in range(steps)]
    timed = metrics[10:]  # after the first steps' allocations and Triton compiles
    row = {
        "optimizer": optimizer, "master_weights": master_weights, "settings": dict(settings),
        "params": sum(p.numel() for p in trainer.model.parameters()),
        "param_dtype": str(next(trainer.model.parameters()).dtype),
        "final_loss": sum(m.loss for m in metrics[-20:]) / 20,
        "losses": [round(m.loss, 4) for m in metrics],
        "tokens_per_s": sum(m.tokens for m in timed) / sum(m.step_time_s for m in timed),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
    }  # fmt: skip
    del trainer
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", type=Path, default=None, help="directory of the results file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/optimizer_training.py needs a CUDA GPU")
    run = {"env": harness.environment(), "steps": args.steps, "model": MODEL, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "config.json"
        config.write_text(json.dumps(MODEL))
        for i, (optimizer, master_weights, settings) in enumerate(RUNS):
            start = time.perf_counter()
            out = f"{tmp}/run{i}"
            row = train(config, optimizer, master_weights, settings, args.steps, out)
            run["rows"].append(row)
            print(
                f"{optimizer} (master weights {master_weights}, {settings}): final loss "
                f"{row['final_loss']:.4f}, {row['tokens_per_s']:,.0f} tokens/s, peak "
                f"{row['peak_gib']:.2f} GiB ({time.perf_counter() - start:.0f} s)",
                flush=True,
            )
    reference = run["rows"][0]["final_loss"]
    for row in run["rows"]:
        row["loss_vs_adamw"] = row["final_loss"] / reference
    if args.out is not None:
        harness.RESULTS = args.out
    print(f"results: {harness.append_results('optimizer_training', run)}")


if __name__ == "__main__":
    main()
