"""LoRA training: memfit (`memfit train --lora-rank R`) against transformers + peft, the same
shapes, GPU and process.

Both: random weights, the base frozen in bf16, LoRA adapters of rank 16 (alpha 32) on every
linear layer of the blocks in fp32, bf16 autocast, AdamW over the adapters, global-norm clipping
at 1.0, activation checkpointing of every block (peft: transformers' gradient checkpointing),
random token batches. memfit runs as `memfit train` does (its fused linear cross-entropy, its
attention choice); transformers + peft as a user sets them up (SDPA attention, its loss).

    python benchmarks/lora.py                         # llama-3.2-3b and llama-3-8b shapes

"memfit within peft's peak" is memfit checkpointing only as many blocks (the first ones,
`--checkpoint-blocks`) as keep the planner's peak 3% below the peak peft measured just before:
the bar is speed at no more memory than peft, and memory peft leaves unused buys less recompute.

"memfit QLoRA nf4" is memfit with the base's linear layers in NF4 (`--quantize-base nf4`),
dequantized by memfit's Triton kernel for each product (memfit.nn.quant): its memory, and what
the dequantization costs; peft's QLoRA needs bitsandbytes, which this machine lacks.
    python benchmarks/lora.py --models llama-3-8b --micro-batch 1 --systems memfit qlora

Both use AdamW at lr 1e-4 (a LoRA learning rate; the speed does not depend on it).

tokens/s = tokens per step / median step time over --steps steps after --warmup; peak =
torch.cuda.max_memory_allocated from model construction to the last step. memfit's rows also
record what the planner predicted for them (planned_peak_gib, planned_tokens_per_s). A setting that
raises (out of memory) is recorded with its error and the run goes on.
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from functools import partial

import harness
import torch

from memfit.config import build_config
from memfit.models.config import PRESETS, to_hf_config
from memfit.train.engine import Trainer


def _fresh() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def memfit_run(
    model: str, args, quantize: str = "none", checkpoint_blocks: int | None = None
) -> dict:
    _fresh()
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(
            build_config(
                flags={
                    "model": {"name": model},
                    "data": {"seq_len": args.seq_len},
                    "train": {"steps": args.warmup + args.steps, "micro_batch": args.micro_batch,
                              "precision": "bf16", "checkpointing": "full", "device": "cuda",
                              "checkpoint_blocks": checkpoint_blocks, "lr": 1e-4},
                    "checkpoint": {"out": out},
                    "lora": {"rank": args.rank, "alpha": 2.0 * args.rank, "quantize": quantize},
                }
            )
        )  # fmt: skip
        planned = _planned(trainer)
        times = []
        for i in range(args.warmup + args.steps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            metrics = trainer.train_step()
            torch.cuda.synchronize()
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
        trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        del trainer
    return (
        _row(times, args, trainable, metrics.loss)
        | planned
        | {"checkpoint_blocks": checkpoint_blocks}
    )


def within_peak(model: str, args, peaks: list[float]) -> dict:
    """memfit checkpointing `blocks_within` the peak of the peft row run before it."""
    if not peaks:
        raise RuntimeError("needs the transformers+peft row's peak first")
    blocks = blocks_within(model, args, peaks[0])
    if blocks is None:
        raise RuntimeError(f"no checkpointed block count plans within peft's {peaks[0]:.2f} GiB")
    return memfit_run(model, args, checkpoint_blocks=blocks)


def blocks_within(model: str, args, peak_gib: float) -> int | None:
    """The fewest blocks to checkpoint whose planned peak is 3% or more below `peak_gib` (None:
    not even every block's)."""
    from memfit.planner import Strategy, plan

    config = PRESETS[model]
    for blocks in range(config.num_layers + 1):
        strategy = Strategy(micro_batch=args.micro_batch, seq_len=args.seq_len,
                            checkpointing="full", checkpoint_blocks=blocks,
                            lora_rank=args.rank)  # fmt: skip
        if plan(config, strategy).peak_bytes <= 0.97 * peak_gib * 2**30:
            return blocks
    return None


def _planned(trainer: Trainer) -> dict:
    """The planner's peak and speed for the run (memfit.planner, the GPU present)."""
    from memfit.planner import detect_gpu, plan, step_time

    gpu = detect_gpu()
    if gpu is None:
        return {}
    strategy = trainer.strategy()
    return {
        "planned_peak_gib": plan(trainer.model_config, strategy, gpu).peak_bytes / 2**30,
        "planned_tokens_per_s": step_time(trainer.model_config, strategy, gpu).tokens_per_s,
    }


def peft_run(model: str, args) -> dict:
    import peft
    import transformers

    _fresh()
    config = transformers.AutoConfig.for_model(**to_hf_config(PRESETS[model]))
    with torch.device("cuda"):
        base = transformers.AutoModelForCausalLM.from_config(
            config, dtype=torch.bfloat16, attn_implementation="sdpa"
        )
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = peft.LoraConfig(
        r=args.rank, lora_alpha=2 * args.rank, target_modules="all-linear", task_type="CAUSAL_LM"
    )
    net = peft.get_peft_model(base, lora)
    net.train()
    params = [p for p in net.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
    vocab = PRESETS[model].vocab_size
    generator = torch.Generator(device="cuda").manual_seed(0)
    times = []
    for i in range(args.warmup + args.steps):
        tokens = torch.randint(
            0, vocab, (args.micro_batch, args.seq_len + 1), device="cuda", generator=generator
        )
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = net(input_ids=tokens[:, :-1], labels=tokens[:, :-1]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    dtypes = sorted({str(p.dtype) for p in params})
    row = _row(times, args, sum(p.numel() for p in params), loss.item())
    del net, base, optimizer
    return row | {"adapter_dtypes": dtypes, "peft": peft.__version__,
                  "transformers": transformers.__version__}  # fmt: skip


def _row(times, args, trainable, loss) -> dict:
    seconds = harness.median(times)
    return {
        "tokens_per_s": args.micro_batch * args.seq_len / seconds,
        "step_s": seconds,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "trainable_params": trainable,
        "last_loss": loss,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["llama-3.2-3b", "llama-3-8b"])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quantize", nargs="*", default=["nf4"], help="memfit QLoRA rows too")
    parser.add_argument(
        "--systems",
        nargs="+",
        default=["memfit", "transformers+peft", "memfit within peft's peak", "qlora"],
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    run = {"env": harness.environment(), "seq_len": args.seq_len,
           "micro_batch": args.micro_batch, "rank": args.rank, "records": []}  # fmt: skip
    for model in args.models:
        peft_peak: list[float] = []  # (filled by the peft row, read by the next)
        systems = [("memfit", memfit_run), ("transformers+peft", peft_run),
                   ("memfit within peft's peak", partial(within_peak, peaks=peft_peak))]  # fmt: skip
        systems = [(name, fn) for name, fn in systems if name in args.systems]
        if "qlora" in args.systems:
            systems += [(f"memfit QLoRA {kind}", partial(memfit_run, quantize=kind))
                        for kind in args.quantize]  # fmt: skip
        for system, fn in systems:
            try:
                row = fn(model, args)
            except (torch.OutOfMemoryError, RuntimeError) as error:
                row = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
            if system == "transformers+peft" and "peak_gib" in row:
                peft_peak.append(row["peak_gib"])
            run["records"].append(
                {"model": model, "system": system, "micro_batch": args.micro_batch, **row}
            )
            print(model, system, {k: v for k, v in row.items() if k != "adapter_dtypes"},
                  flush=True)  # fmt: skip
    print(f"results: {harness.append_results('lora', run, args.out)}")


if __name__ == "__main__":
    main()
