"""Launch options (num_warps, num_stages) of the block-sparse attention kernels
(memfit.ops.attention.block_sparse.LAUNCH_OPTIONS), measured where they count: the patterns of
benchmarks/sparse_attention.py that run the block-sparse kernels, at 16k tokens (batch 1, 16
heads, head dim 128, bf16; the forward's 64 x 64 tiles, the backward's 128 x 64 (dq) and
64 x 128 (dk/dv) at BACKWARD_WIDEN 2, or 64 x 64 at --widen 1).

    python benchmarks/sparse_configs.py --configs 4x2 4x3 8x2 8x3 --kernels dkdv dq

For each kernel and config (on the patterns whose backward takes that kernel's tile), the others
kept at their defaults: the forward's time for the
forward's options, forward + backward for the backward kernels'; the median of CUDA-event
times after warm-up (compilation excluded). Prints the best config of each kernel by the sum
over patterns.
"""

from __future__ import annotations

import argparse

import harness
import torch
from sparse_attention import DIM, HEADS, measure, patterns

from memfit.ops.attention import block_sparse, sparse_attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=["4x2", "4x3", "8x2", "8x3"])
    parser.add_argument("--kernels", nargs="+", default=["forward", "dkdv", "dq"])
    parser.add_argument("--patterns", nargs="+", default=["strided", "longformer", "bigbird"])
    parser.add_argument("--seqlen", type=int, default=16384)
    parser.add_argument("--widen", type=int, default=block_sparse.BACKWARD_WIDEN)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    n = args.seqlen
    block_sparse.BACKWARD_WIDEN = args.widen
    tiles = {"forward": (64, 64), "dq": (64 * args.widen, 64), "dkdv": (64, 64 * args.widen)}
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (
        torch.randn(1, n, HEADS, DIM, device="cuda", dtype=torch.bfloat16, generator=g)
        for _ in range(4)
    )
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    defaults = dict(block_sparse.LAUNCH_OPTIONS)
    run = {
        "env": harness.environment(), "seqlen": n, "widen": args.widen,
        "defaults": {"/".join(map(str, key)): value for key, value in defaults.items()},
        "records": [],
    }  # fmt: skip
    totals: dict[tuple[str, str], float] = {}
    for kernel in args.kernels:
        for config in args.configs:
            warps, stages = (int(x) for x in config.split("x"))
            block_sparse.LAUNCH_OPTIONS = defaults | {(kernel, *tiles[kernel]): (warps, stages)}
            for name in args.patterns:
                pattern = patterns(n)[name]
                used = dict(zip(("dq", "dkdv"), block_sparse._backward_tiles(
                    pattern, n, 64, args.widen, block_sparse.WIDE_WORK
                ), strict=True)) | {"forward": (64, 64)}  # fmt: skip
                if used[kernel] != tiles[kernel]:
                    continue  # (this pattern's backward keeps square tiles there)
                row = {"kernel": kernel, "tile": tiles[kernel], "config": config, "pattern": name}
                try:
                    times = measure(lambda q, k, v, p=pattern: sparse_attention(q, k, v, p),
                                    (q, k, v, dout))  # fmt: skip
                    row["ms"] = times[
                        "forward_ms" if kernel == "forward" else "forward_backward_ms"
                    ]
                    totals[kernel, config] = totals.get((kernel, config), 0.0) + row["ms"]
                except Exception as error:  # (a config out of shared memory: a row)
                    row["error"] = f"{type(error).__name__}: {str(error)[:200]}"
                    totals[kernel, config] = float("inf")
                run["records"].append(row)
                print(row, flush=True)
    block_sparse.LAUNCH_OPTIONS = defaults
    best = {
        kernel: min(args.configs, key=lambda c, kernel=kernel: totals.get((kernel, c), 1e30))
        for kernel in args.kernels
    }
    run["best"] = best
    print("best:", best)
    print(f"results: {harness.append_results('sparse_configs', run, args.out)}")


if __name__ == "__main__":
    main()
