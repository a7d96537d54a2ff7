"""Training-step throughput and peak memory: memfit's engine against Hugging Face
LlamaForCausalLM, same shapes, same GPU, same process (the settings of ANCHORS.md).

Both systems: preset llama-1b shapes (953.2M parameters), sequence 2048, fp32 weights, bf16
autocast, torch SDPA attention, fused AdamW, global-norm clipping at 1.0, identical random token
batches. Settings: micro-batch 4 and 8 x activation checkpointing off and full.

    python benchmarks/train_step.py                          # all four settings, HF and memfit
    python benchmarks/train_step.py --variants eager compiled  # also memfit with compile off / on
    python benchmarks/train_step.py --attention flash sdpa --seq-lens 2048 8192 --micro-batches 4 --checkpointing none

`--attention` picks memfit's attention backends (`memfit train --attention`: flash is memfit's
Triton FlashAttention, sdpa torch's fused attention); HF always runs SDPA. `--micro-batches` are
the micro-batches at sequence 2048; at other `--seq-lens` they are scaled by 2048 / seq (at least
1) so that a step holds the same tokens (4 at 2048 is 1 at 8192). Every record names its
attention backend and sequence length (records written before these options: sdpa, 2048).

"memfit" is memfit as `memfit train` runs it (--compile auto: blocks compiled on CUDA unless
they are checkpointed); "memfit-eager" and "memfit-compiled" force compile off and on.

tokens/s = tokens per step / median step time over `--repeat` steps after `--warmup` steps.
MFU = tokens/s x (6 x params + 6 x layers x hidden x seq) / 989 TFLOP/s (causal attention FLOPs,
the convention of ANCHORS.md). Peak = torch.cuda.max_memory_allocated from model construction to
the last timed step. A setting that raises (out of memory, a kernel error) is recorded with an
"error" string and the run goes on.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import tempfile
from pathlib import Path

import harness
import torch
from harness import append_results, environment, percentiles, time_calls
from rich.console import Console
from rich.table import Table

from memfit.config import Config, build_config
from memfit.models import PRESETS
from memfit.train.engine import Trainer, compiles_blocks

H100_BF16_FLOPS = 989e12
SEQ_LEN = 2048


def random_batches(vocab: int, micro_batch: int, seed: int, seq_len: int = SEQ_LEN):
    generator = torch.Generator().manual_seed(seed)
    while True:
        tokens = torch.randint(0, vocab, (micro_batch, seq_len + 1), generator=generator)
        yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def free_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def bench_memfit(
    micro_batch: int,
    checkpointing: str,
    *,
    compile: str,
    warmup: int,
    repeat: int,
    attention: str = "sdpa",
    seq_len: int = SEQ_LEN,
) -> dict:
    free_memory()
    with tempfile.TemporaryDirectory() as out:
        config: Config = build_config(
            flags={
                "model": {"name": "llama-1b", "attention": attention, "compile": compile},
                "data": {"seq_len": seq_len},
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
        trainer.batches = random_batches(
            trainer.model_config.vocab_size, micro_batch, seed=0, seq_len=seq_len
        )
        losses = []
        times = time_calls(
            lambda: losses.append(trainer.train_step().loss),
            warmup=warmup,
            repeat=repeat,
            clock="wall",
        )
        peak = torch.cuda.max_memory_allocated()
    return {"times": times, "peak_bytes": peak, "final_loss": losses[-1], "compiled": compiled}


def bench_hf(
    micro_batch: int, checkpointing: str, *, warmup: int, repeat: int, seq_len: int = SEQ_LEN
) -> dict:
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
    batches = random_batches(shape.vocab_size, micro_batch, seed=0, seq_len=seq_len)
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

    times = time_calls(step, warmup=warmup, repeat=repeat, clock="wall")
    peak = torch.cuda.max_memory_allocated()
    return {"times": times, "peak_bytes": peak, "final_loss": losses[-1]}


def scaled_micro_batch(micro_batch: int, seq_len: int) -> int:
    """The micro-batch at `seq_len` holding the tokens of `micro_batch` sequences of 2048."""
    return max(1, micro_batch * SEQ_LEN // seq_len)


def resolved_attention(attention: str) -> str:
    from memfit.functional import resolve_attention

    try:
        return resolve_attention(attention, torch.device("cuda"))
    except ValueError:
        return attention


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument(
        "--micro-batches",
        type=int,
        nargs="+",
        default=[4, 8],
        help="micro-batches at sequence 2048, scaled to keep tokens per step at other --seq-lens",
    )
    parser.add_argument("--checkpointing", nargs="+", default=["none", "full"])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[SEQ_LEN])
    parser.add_argument(
        "--attention",
        nargs="+",
        default=["sdpa"],
        choices=["sdpa", "flash", "auto"],
        help="memfit's attention backends to measure (default sdpa); HF runs SDPA",
    )
    parser.add_argument(
        "--variants",
        nargs="*",
        default=[],
        choices=["eager", "compiled"],
        help="also measure memfit with torch.compile forced off (eager) or on (compiled)",
    )
    parser.add_argument("--no-hf", action="store_true", help="skip the HF baseline")
    parser.add_argument(
        "--out",
        type=Path,
        default=harness.RESULTS,
        help="directory of train_step.json (default benchmarks/results); if it has none yet, the "
        "repository's is copied there first, so that OUT/train_step.json can replace it as it is",
    )
    parser.add_argument("--no-save", action="store_true", help="do not append to train_step.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/train_step.py needs a CUDA GPU")

    shape = PRESETS["llama-1b"]
    records = []
    systems = [] if args.no_hf else [("hf", "")]
    systems += [("memfit", "auto")]
    systems += [(f"memfit-{v}", {"eager": "off", "compiled": "on"}[v]) for v in args.variants]
    for seq_len in args.seq_lens:
        flops_per_token = shape.flops_per_token(seq_len)
        for checkpointing in args.checkpointing:
            for micro_batch in dict.fromkeys(
                scaled_micro_batch(mb, seq_len) for mb in args.micro_batches
            ):
                for system, compile in systems:
                    auto = compiles_blocks("auto", torch.device("cuda"), checkpointing)
                    if system != "memfit" and compile == ("on" if auto else "off"):
                        continue  # the same configuration as the "memfit" row
                    for attention in ["sdpa"] if system == "hf" else args.attention:
                        record = {
                            "system": system,
                            "model": "llama-1b",
                            "attention": attention,
                            "seq_len": seq_len,
                            "micro_batch": micro_batch,
                            "tokens_per_step": micro_batch * seq_len,
                            "checkpointing": checkpointing,
                        }
                        if attention == "auto":
                            record["attention_resolved"] = resolved_attention(attention)
                        try:
                            if system == "hf":
                                result = bench_hf(
                                    micro_batch,
                                    checkpointing,
                                    warmup=args.warmup,
                                    repeat=args.repeat,
                                    seq_len=seq_len,
                                )
                            else:
                                result = bench_memfit(
                                    micro_batch,
                                    checkpointing,
                                    compile=compile,
                                    warmup=args.warmup,
                                    repeat=args.repeat,
                                    attention=attention,
                                    seq_len=seq_len,
                                )
                        except Exception as error:  # recorded, the run goes on
                            lines = str(error).strip().splitlines()
                            record["error"] = (
                                f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]
                            )
                            records.append(record)
                            print(
                                f"{system:>15} {attention:<5} seq={seq_len} ckpt={checkpointing:<5} "
                                f"mb={micro_batch}: ERROR {record['error']}",
                                flush=True,
                            )
                            free_memory()
                            continue
                        stats = percentiles(result["times"])
                        tokens = micro_batch * seq_len
                        record.update(
                            {
                                "step_ms": {k: v * 1e3 for k, v in stats.items()},
                                "tokens_per_s": tokens / stats["p50"],
                                "mfu": tokens / stats["p50"] * flops_per_token / H100_BF16_FLOPS,
                                "peak_allocated_bytes": result["peak_bytes"],
                                "final_loss": result["final_loss"],
                                "compiled": result.get("compiled", False),
                            }
                        )
                        records.append(record)
                        print(
                            f"{system:>15} {attention:<5} seq={seq_len} ckpt={checkpointing:<5} "
                            f"mb={micro_batch}: {record['tokens_per_s']:,.0f} tok/s "
                            f"MFU {record['mfu']:.3f} peak {record['peak_allocated_bytes'] / 2**30:.2f} GiB",
                            flush=True,
                        )
    run = {
        "benchmark": "train_step",
        "env": environment(),
        "warmup": args.warmup,
        "repeat": args.repeat,
        "attention": args.attention,
        "seq_lens": args.seq_lens,
        "records": records,
    }
    if not args.no_save:
        out_dir = args.out.resolve()
        if out_dir != harness.RESULTS.resolve():
            out_dir.mkdir(parents=True, exist_ok=True)
            seed = harness.RESULTS / "train_step.json"
            if seed.exists() and not (out_dir / "train_step.json").exists():
                shutil.copy(seed, out_dir / "train_step.json")
            harness.RESULTS = out_dir
        print("wrote", append_results("train_step", run))

    seqs = ", ".join(str(s) for s in args.seq_lens)
    table = Table(title=f"train step, llama-1b, seq {seqs}, {run['env'].get('gpu')}")
    columns = ["seq", "checkpointing", "micro-batch", "system", "attention", "tokens/s", "MFU"]
    columns += ["peak GiB", "vs HF tok/s", "vs HF mem"]
    if len(args.attention) > 1:
        columns += ["vs sdpa tok/s", "vs sdpa mem"]
    for column in columns:
        table.add_column(column)

    def ratios(r: dict, base: dict | None) -> list[str]:
        if base is None or "error" in base or "error" in r:
            return ["-", "-"]
        return [
            f"{r['tokens_per_s'] / base['tokens_per_s']:.3f}x",
            f"{r['peak_allocated_bytes'] / base['peak_allocated_bytes']:.3f}x",
        ]

    for r in records:
        same = [
            b
            for b in records
            if b["seq_len"] == r["seq_len"]
            and b["micro_batch"] == r["micro_batch"]
            and b["checkpointing"] == r["checkpointing"]
        ]
        hf = next((b for b in same if b["system"] == "hf"), None)
        sdpa = next(
            (b for b in same if b["system"] == r["system"] and b["attention"] == "sdpa"), None
        )
        cells = [str(r["seq_len"]), r["checkpointing"], str(r["micro_batch"]), r["system"]]
        cells.append(r["attention"])
        if "error" in r:
            cells += [r["error"][:60], "", ""]
        else:
            cells += [
                f"{r['tokens_per_s']:,.0f}",
                f"{r['mfu']:.3f}",
                f"{r['peak_allocated_bytes'] / 2**30:.2f}",
            ]
        cells += ratios(r, hf)
        if len(args.attention) > 1:
            cells += ratios(r, sdpa)
        table.add_row(*cells)
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
