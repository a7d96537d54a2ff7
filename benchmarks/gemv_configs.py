"""Tile configurations of the batch-1 matrix-vector kernel (memfit.ops.gemv), measured where
they count: llama-3.2-1b's decode step, in the engine's CUDA graph and through the engine.

    python benchmarks/gemv_configs.py --configs pdl:1x1024x4x3 pdl:2x1024x4x3 plain:4x128x8x3

A config is `pdl:` (launched with programmatic dependent launch, the engine's default on Hopper:
sets PDL_CONFIG) or `plain:` (MEMFIT_PDL=0's path: sets BLOCK_N, BLOCK_K, NUM_WARPS,
NUM_STAGES), then BLOCK_N x BLOCK_K x num_warps x num_stages. Each config builds the engine
anew (its graphs are captured with the config), decodes 128 tokens of one sequence and times
the captured step alone. Needs a GPU of compute capability 9.0 for `pdl:`.
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import harness
import torch

import memfit.ops._triton as triton_ops
import memfit.ops.gemv as gemv_module
from memfit.inference import LLM, SamplingParams


def parse(config: str) -> tuple[bool, tuple[int, int, int, int]]:
    kind, _, sizes = config.partition(":")
    if kind not in ("pdl", "plain"):
        raise SystemExit(f"a config is pdl:NxKxWxS or plain:NxKxWxS, got {config!r}")
    block_n, block_k, warps, stages = (int(v) for v in sizes.split("x"))
    return kind == "pdl", (block_n, block_k, warps, stages)


def measure(model: str, pdl: bool, config: tuple[int, int, int, int]) -> dict:
    supported = triton_ops._pdl_supported
    plain = (
        gemv_module.BLOCK_N,
        gemv_module.BLOCK_K,
        gemv_module.NUM_WARPS,
        gemv_module.NUM_STAGES,
    )
    pdl_config = gemv_module.PDL_CONFIG
    try:
        if pdl:
            gemv_module.PDL_CONFIG = config
        else:
            triton_ops._pdl_supported = lambda index: False
            (gemv_module.BLOCK_N, gemv_module.BLOCK_K, gemv_module.NUM_WARPS,
             gemv_module.NUM_STAGES) = config  # fmt: skip
        llm = LLM(model, device="cuda", max_running=1)
        prompt = [list(range(100, 228))]
        llm.generate(prompt, SamplingParams(max_tokens=16, ignore_eos=True), progress=False)
        llm.generate(prompt, SamplingParams(max_tokens=128, ignore_eos=True), progress=False)
        stats = llm.last_stats
        engine_s = stats["decode_seconds"] / max(stats["decode_steps"], 1)
        graph = llm.engine.graphs.graphs[1]
        graph_s = harness.median(harness.time_calls(graph.replay, warmup=3, repeat=50))
        del llm, graph
        return {"graph_ms": graph_s * 1e3, "engine_ms": engine_s * 1e3}
    finally:
        triton_ops._pdl_supported = supported
        gemv_module.PDL_CONFIG = pdl_config
        (gemv_module.BLOCK_N, gemv_module.BLOCK_K, gemv_module.NUM_WARPS,
         gemv_module.NUM_STAGES) = plain  # fmt: skip
        gc.collect()
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3.2-1b")
    parser.add_argument("--configs", nargs="+", required=True)
    parser.add_argument("--out", type=Path, default=None, help="directory of the results file")
    args = parser.parse_args()
    run = {"env": harness.environment(), "model": args.model, "configs": {}}
    for config in args.configs:
        run["configs"][config] = measure(args.model, *parse(config))
        print(config, json.dumps(run["configs"][config]), flush=True)
    if args.out is not None:
        harness.RESULTS = args.out
    print(f"results: {harness.append_results('gemv_configs', run)}")


if __name__ == "__main__":
    main()
