"""Where a batch-1 decode step's GPU time goes: `LLM(preset, quantize=...)` with random weights
for bf16, int8 and int4, a few steps run eagerly (no CUDA graphs, so no programmatic dependent
launch: each kernel's time is its own) under torch.profiler; CUDA time a step per kernel name.

    python benchmarks/decode_profile.py                  # llama-3-8b
    python benchmarks/decode_profile.py --model llama-3.2-3b

The profiled generate includes its prompt's prefill (one step in `--steps`): its kernels (cuBLAS,
the dequantize of int4 layers) show with a count below one a step.

Results: benchmarks/results/decode_profile.json.
"""

from __future__ import annotations

import argparse
import gc

import harness
import torch
from torch.profiler import ProfilerActivity, profile

from memfit.inference import LLM, SamplingParams


def profile_decode(model: str, quantize: str | None, steps: int) -> list[dict]:
    llm = LLM(model, device="cuda", quantize=quantize, cuda_graphs=False)
    prompt = [list(range(1, 129))]
    llm.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True), progress=False)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompt, SamplingParams(max_tokens=steps, ignore_eos=True), progress=False)
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        total = getattr(event, "device_time_total", 0) or getattr(event, "cuda_time_total", 0)
        if total > 0:
            rows.append({"kernel": event.key[:120], "us_a_step": total / steps,
                         "calls_a_step": event.count / steps})  # fmt: skip
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return sorted(rows, key=lambda r: -r["us_a_step"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/decode_profile.py needs a CUDA GPU")
    run = {"env": harness.environment(), "model": args.model, "steps": args.steps, "weights": {}}
    for quantize in (None, "int8", "int4"):
        rows = profile_decode(args.model, quantize, args.steps)
        run["weights"][quantize or "bf16"] = rows
        print(f"== {quantize or 'bf16'}: {sum(r['us_a_step'] for r in rows) / 1e3:.3f} ms a step")
        for r in rows[:12]:
            print(f"  {r['us_a_step']:9.1f} us  x{r['calls_a_step']:5.1f}  {r['kernel'][:80]}")
    print(f"results: {harness.append_results('decode_profile', run, args.out)}")


if __name__ == "__main__":
    main()
