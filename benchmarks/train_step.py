"""Training-step throughput and peak memory: memfit's engine against Hugging Face
LlamaForCausalLM, same shapes, same GPU, same process (the settings of ANCHORS.md).

Both systems: preset llama-1b shapes (953.2M parameters), sequence 2048, fp32 weights, bf16
autocast, torch SDPA attention, fused AdamW, global-norm clipping at 1.0, identical random token
batches. Settings: micro-batch 4 and 8 x activation checkpointing off and full.

    python benchmarks/train_step.py                          # all four settings, HF and memfit
    python benchmarks/train_step.py --variants eager compiled  # also memfit with compile off / on

"memfit" is memfit as `memfit train` runs it (--compile auto: blocks compiled on CUDA unless
they are checkpointed); "memfit-eager" and "memfit-compiled" force compile off and on.

tokens/s = tokens per step / median step time over `--repeat` steps after `--warmup` steps.
MFU = tokens/s x (6 x params + 6 x layers x hidden x seq) / 989 TFLOP/s (causal attention FLOPs,
the convention of ANCHORS.md). Peak = torch.cuda.max_memory_allocated from model construction to
the last timed step.
"""

from __future__ import annotations

import argparse
import gc
import tempfile

import torch
from harness import append_results, environment, percentiles, time_steps
from rich.console import Console
from rich.table import Table

from memfit.config import Config, build_config
from memfit.models import PRESETS
from memfit.train.engine import Trainer, compiles_blocks

H100_BF16_FLOPS = 989e12
SEQ_LEN = 2048


def random_batches(vocab: int, micro_batch: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    while True:
        tokens = torch.randint(0, vocab, (micro_batch, SEQ_LEN + 1), generator=generator)
        yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def free_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def bench_memfit(
    micro_batch: int, checkpointing: str, *, compile: str, warmup: int, repeat: int
) -> dict:
    free_memory()
    with tempfile.TemporaryDirectory() as out:
        config: Config = build_config(
            flags={
                "model": {"name": "llama-1b", "attention": "sdpa", "compile": compile},
                "data": {"seq_len": SEQ_LEN},
                "train": {
                    "micro_batch": micro_batch,
                    "checkpointing": checkpointing,
                    "precision": "bf16",
                    "lr": 1e-4,
                    "steps": warmup + repeat,
                    "grad_clip": 1.0,
                },
                "checkpoint": {"out": out},
            }
        )
        trainer = Trainer(config)
        compiled = trainer.compiled
        trainer.batches = random_batches(trainer.model_config.vocab_size, micro_batch, seed=0)
        losses = []
        times = time_steps(
            lambda: losses.append(trainer.train_step().loss), warmup=warmup, repeat=repeat
        )
        peak = torch.cuda.max_memory_allocated()
    return {"times": times, "peak_bytes": peak, "final_loss": losses[-1], "compiled": compiled}


def bench_hf(micro_batch: int, checkpointing: str, *, warmup: int, repeat: int) -> dict:
    import transformers

    free_memory()
    shape = PRESETS["llama-1b"]
    hf_config = transformers.LlamaConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        max_position_embeddings=shape.max_seq_len,
        rms_norm_eps=shape.rms_norm_eps,
        rope_theta=shape.rope_theta,
        tie_word_embeddings=False,
        use_cache=False,
    )
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa")
    model.train()
    if checkpointing == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    params = list(model.parameters())
    assert sum(p.numel() for p in params) == shape.num_params
    optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    batches = random_batches(shape.vocab_size, micro_batch, seed=0)
    losses = []

    def step() -> None:
        inputs, _ = next(batches)
        inputs = inputs.cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=inputs, labels=inputs).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())

    times = time_steps(step, warmup=warmup, repeat=repeat)
    peak = torch.cuda.max_memory_allocated()
    return {"times": times, "peak_bytes": peak, "final_loss": losses[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--checkpointing", nargs="+", default=["none", "full"])
    parser.add_argument(
        "--variants",
        nargs="*",
        default=[],
        choices=["eager", "compiled"],
        help="also measure memfit with torch.compile forced off (eager) or on (compiled)",
    )
    parser.add_argument(
        "--no-save", action="store_true", help="do not append to benchmarks/results/train_step.json"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/train_step.py needs a CUDA GPU")

    shape = PRESETS["llama-1b"]
    flops_per_token = shape.flops_per_token(SEQ_LEN)
    records = []
    systems = [("hf", ""), ("memfit", "auto")]
    systems += [(f"memfit-{v}", {"eager": "off", "compiled": "on"}[v]) for v in args.variants]
    for checkpointing in args.checkpointing:
        for micro_batch in args.micro_batches:
            for system, compile in systems:
                auto = compiles_blocks("auto", torch.device("cuda"), checkpointing)
                if system != "memfit" and compile == ("on" if auto else "off"):
                    continue  # the same configuration as the "memfit" row
                if system == "hf":
                    result = bench_hf(
                        micro_batch, checkpointing, warmup=args.warmup, repeat=args.repeat
                    )
                else:
                    result = bench_memfit(
                        micro_batch,
                        checkpointing,
                        compile=compile,
                        warmup=args.warmup,
                        repeat=args.repeat,
                    )
                stats = percentiles(result["times"])
                tokens = micro_batch * SEQ_LEN
                record = {
                    "system": system,
                    "model": "llama-1b",
                    "seq_len": SEQ_LEN,
                    "micro_batch": micro_batch,
                    "checkpointing": checkpointing,
                    "step_ms": {k: v * 1e3 for k, v in stats.items()},
                    "tokens_per_s": tokens / stats["p50"],
                    "mfu": tokens / stats["p50"] * flops_per_token / H100_BF16_FLOPS,
                    "peak_allocated_bytes": result["peak_bytes"],
                    "final_loss": result["final_loss"],
                    "compiled": result.get("compiled", False),
                }
                records.append(record)
                print(
                    f"{system:>15} ckpt={checkpointing:<5} mb={micro_batch}: {record['tokens_per_s']:,.0f} tok/s "
                    f"MFU {record['mfu']:.3f} peak {record['peak_allocated_bytes'] / 2**30:.2f} GiB",
                    flush=True,
                )
    run = {
        "benchmark": "train_step",
        "env": environment(),
        "warmup": args.warmup,
        "repeat": args.repeat,
        "records": records,
    }
    if not args.no_save:
        print("wrote", append_results("train_step", run))

    table = Table(title=f"train step, llama-1b, seq {SEQ_LEN}, {run['env'].get('gpu')}")
    for column in (
        "checkpointing",
        "micro-batch",
        "system",
        "tokens/s",
        "MFU",
        "peak GiB",
        "vs HF tok/s",
        "vs HF mem",
    ):
        table.add_column(column)
    for r in records:
        base = next(
            b
            for b in records
            if b["system"] == "hf"
            and b["micro_batch"] == r["micro_batch"]
            and b["checkpointing"] == r["checkpointing"]
        )
        table.add_row(
            r["checkpointing"],
            str(r["micro_batch"]),
            r["system"],
            f"{r['tokens_per_s']:,.0f}",
            f"{r['mfu']:.3f}",
            f"{r['peak_allocated_bytes'] / 2**30:.2f}",
            f"{r['tokens_per_s'] / base['tokens_per_s']:.3f}x",
            f"{r['peak_allocated_bytes'] / base['peak_allocated_bytes']:.3f}x",
        )
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
