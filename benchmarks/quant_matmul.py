"""The dequantizing matrix products (memfit.ops.quant.matmul) against dequantize-then-cuBLAS and
against cuBLAS on the bf16 weight, at the linear layers of llama-3-8b and llama-3.2-3b, for the
forward (x W^T) and the input's gradient (g W), NF4, int8 and int4, over the number of rows M.

    python benchmarks/quant_matmul.py                  # M = 1, 16, 256, 2048, 8192

"dequant + cuBLAS" is memfit.ops.quant.matmul.dequantize into a fresh bf16 weight, then
torch.matmul (the path memfit.nn.quant takes above FUSED_MAX_ROWS rows). Times are the median of
CUDA-event times after warm-up (autotuning included in the warm-up), weights cold (a fresh
weight each call rotates through more than the L2 holds for M <= 256).
"""

from __future__ import annotations

import argparse

import harness
import torch

import memfit.ops.quant.matmul as kernels
from memfit.models.config import PRESETS
from memfit.ops.quant import quantize_int4, quantize_int8, quantize_nf4

QUANTIZE = {"nf4": quantize_nf4, "int8": quantize_int8, "int4": quantize_int4}
KIND_ID = {"nf4": kernels._NF4, "int8": kernels._INT8, "int4": kernels._INT4}


def layer_shapes(model: str) -> dict[str, tuple[int, int]]:
    c = PRESETS[model]
    head = c.hidden_size // c.num_heads
    qkv = (c.num_heads + 2 * c.num_kv_heads) * head
    return {
        "qkv": (qkv, c.hidden_size),
        "out": (c.hidden_size, c.num_heads * head),
        "gate_up": (2 * c.intermediate_size, c.hidden_size),
        "down": (c.hidden_size, c.intermediate_size),
    }


def timed(fn, repeat=20) -> float:
    return harness.median(harness.time_calls(fn, warmup=3, repeat=repeat)) * 1e6


def measure(shape, m, kind) -> dict:
    n, k = shape
    copies = 4 if m <= 256 else 1  # cold weights: rotate through several
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    states = [QUANTIZE[kind](w) for w in weights]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    turn = iter(range(10**9))

    def pick(items):
        return items[next(turn) % len(items)]

    row = {
        "fused_fwd_us": timed(lambda: kernels.quant_matmul(x, pick(states), kind, shape)),
        "fused_dx_us": timed(lambda: kernels.quant_matmul_dx(g, pick(states), kind, shape)),
        "dequant_cublas_fwd_us": timed(
            lambda: x @ kernels.dequantize(pick(states), kind, shape, torch.bfloat16).T
        ),
        "dequant_cublas_dx_us": timed(
            lambda: g @ kernels.dequantize(pick(states), kind, shape, torch.bfloat16)
        ),
        "dequant_us": timed(lambda: kernels.dequantize(pick(states), kind, shape, torch.bfloat16)),
        "bf16_cublas_fwd_us": timed(lambda: x @ pick(weights).T),
        "bf16_cublas_dx_us": timed(lambda: g @ pick(weights)),
    }
    bucket = kernels._bucket(m)
    kind_id = KIND_ID[kind]
    for name, kernel in (("fwd", kernels._forward_kernel), ("dx", kernels._dx_kernel)):
        tuned = kernels._TUNED[kernel, kind_id]
        best = tuned.cache.get((bucket, n, k)) or next(
            (v for key, v in tuned.cache.items() if tuple(key[:3]) == (bucket, n, k)), None
        )
        row[f"{name}_config"] = str(best) if best is not None else None
    # the fused result against dequantize-then-matmul (same bf16 weight values)
    state, weight = states[0], kernels.dequantize(states[0], kind, shape, torch.bfloat16)
    ref = x.float() @ weight.float().T
    row["fwd_max_rel_diff"] = ((kernels.quant_matmul(x, state, kind, shape).float() - ref).abs().max()
                               / ref.abs().max()).item()  # fmt: skip
    flops = 2 * m * n * k
    row["fused_fwd_tflops"] = flops / row["fused_fwd_us"] / 1e6
    row["bf16_cublas_fwd_tflops"] = flops / row["bf16_cublas_fwd_us"] / 1e6
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["llama-3-8b", "llama-3.2-3b"])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 16, 256, 2048, 8192])
    parser.add_argument("--kinds", nargs="+", default=["nf4", "int8"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    run = {"env": harness.environment(), "records": []}
    for model in args.models:
        for layer, shape in layer_shapes(model).items():
            for kind in args.kinds:
                for m in args.rows:
                    row = {"model": model, "layer": layer, "shape": list(shape), "kind": kind,
                           "rows": m, **measure(shape, m, kind)}  # fmt: skip
                    run["records"].append(row)
                    print({k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()},
                          flush=True)  # fmt: skip
    print(f"results: {harness.append_results('quant_matmul', run, args.out)}")


if __name__ == "__main__":
    main()
