"""One optimizer step over 953M fp32 parameters in 2048 x 2048 matrices (ANCHORS.md's setting):
state bytes per parameter and step time of memfit's optimizers against torch's fused AdamW and
Adafactor, and torchao's 8-bit AdamW where it is installed, in one process.

    python benchmarks/optimizers.py [--params 953e6] [--out DIR]

Each optimizer gets the same parameters (random) and gradients (random, fixed across steps);
its states are created by warm-up steps, then `repeat` steps are timed back to back with CUDA
events (the host's launch work counts where it is longer than the kernels'). State bytes: the
bytes of every tensor state after the steps (step counters aside) over the parameter count.
"""

from __future__ import annotations

import argparse
import gc
from pathlib import Path

import harness
import torch

from memfit.optim.adafactor import Adafactor
from memfit.optim.adamw8bit import AdamW8bit
from memfit.optim.sm3 import SM3

SIDE = 2048


def candidates() -> dict:
    found = {
        "torch AdamW (fused)": lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True),
        "memfit AdamW8bit": lambda ps: AdamW8bit(ps, lr=1e-4),
        "memfit Adafactor": lambda ps: Adafactor(ps, lr=1e-2, scale_parameter=False),
        "memfit SM3 (momentum 0.9)": lambda ps: SM3(ps, lr=1e-2, beta1=0.9),
        "memfit SM3 (no momentum)": lambda ps: SM3(ps, lr=1e-2, beta1=0.0),
    }
    if hasattr(torch.optim, "Adafactor"):
        found["torch Adafactor"] = lambda ps: torch.optim.Adafactor(ps, lr=1e-2)
    try:
        from torchao.optim import AdamW8bit as TorchaoAdamW8bit

        found["torchao AdamW8bit"] = lambda ps: TorchaoAdamW8bit(ps, lr=1e-4)
    except ImportError:
        print("torchao is not installed: no torchao row")
    return found


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    total = 0
    for state in optimizer.state.values():
        for key, value in state.items():
            if key == "step" or not isinstance(value, torch.Tensor):
                continue
            # torchao's subclass tensors: the bytes of what they hold
            inner = getattr(value, "__tensor_flatten__", None)
            if inner is not None:
                names, _ = value.__tensor_flatten__()
                total += sum(getattr(value, n).nbytes for n in names)
            else:
                total += value.nbytes
    return total


def measure(name: str, build, count: int, warmup: int, repeat: int) -> dict:
    generator = torch.Generator(device="cuda").manual_seed(0)
    params = []
    for _ in range(count):
        p = torch.nn.Parameter(torch.randn(SIDE, SIDE, device="cuda", generator=generator))
        p.grad = torch.randn(SIDE, SIDE, device="cuda", generator=generator) * 1e-3
        params.append(p)
    optimizer = build(params)
    times = harness.time_calls(optimizer.step, warmup=warmup, repeat=repeat)
    numel = count * SIDE * SIDE
    row = {
        "optimizer": name,
        "params": numel,
        "state_bytes_per_param": state_bytes(optimizer) / numel,
        "step_ms": harness.median(times) * 1e3,
        "step_ms_percentiles": {k: v * 1e3 for k, v in harness.percentiles(times).items()},
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
    }
    print(
        f"{name}: {row['step_ms']:.2f} ms/step, {row['state_bytes_per_param']:.3f} state "
        f"bytes/param",
        flush=True,
    )
    del optimizer, params
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return row


def sweep_adamw8bit(count: int, warmup: int, repeat: int) -> list[dict]:
    """8-bit AdamW's fused step at other tiles (blocks of 256 per program, warps): the table
    that chose memfit.ops.adamw8bit's CHUNK_BLOCKS and NUM_WARPS."""
    import memfit.ops.adamw8bit as ops

    chosen = ops.CHUNK_BLOCKS, ops.NUM_WARPS
    rows = []
    try:
        for chunk, warps in [(2, 2), (4, 2), (4, 4), (8, 4), (8, 8), (16, 8)]:
            ops.CHUNK_BLOCKS, ops.NUM_WARPS = chunk, warps
            name = f"memfit AdamW8bit ({chunk} blocks, {warps} warps)"
            row = measure(name, lambda ps: AdamW8bit(ps, lr=1e-4), count, warmup, repeat)
            rows.append({**row, "chunk_blocks": chunk, "num_warps": warps})
    finally:
        ops.CHUNK_BLOCKS, ops.NUM_WARPS = chosen
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=953e6)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--only", nargs="*", help="names (substrings) of the optimizers to run")
    parser.add_argument("--sweep", action="store_true", help="8-bit AdamW's tiles too")
    parser.add_argument("--out", type=Path, default=None, help="directory of the results file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/optimizers.py needs a CUDA GPU")
    count = round(args.params / SIDE**2)
    run = {"env": harness.environment(), "rows": []}
    for name, build in candidates().items():
        if args.only and not any(s.lower() in name.lower() for s in args.only):
            continue
        run["rows"].append(measure(name, build, count, args.warmup, args.repeat))
    if args.sweep:
        run["sweep"] = sweep_adamw8bit(count, args.warmup, args.repeat)
    if args.out is not None:
        harness.RESULTS = args.out
    print(f"results: {harness.append_results('optimizers', run)}")


if __name__ == "__main__":
    main()
