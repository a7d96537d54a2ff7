"""Tile sweeps of the paged attention kernels (memfit.ops.attention.paged) at the shapes a serving
engine runs, head dim 64 (llama-3.2-1b: 32 query heads, 8 KV heads) unless said: what chose
DECODE_CONFIGS and CHUNK_CONFIGS. Each time is a CUDA graph of one call for each of 16 layers'
KV pools (cold: the pools together exceed the L2), per layer, the median of 7 runs of 5 replays.

    python benchmarks/paged_tiles.py --out DIR

Parts:
- loaded: a loaded server's step (64 sequences of 100-640 cached keys): the decode kernel's
  (BLOCK_N, warps, stages) x split counts; then mixed steps (the 64 decodes beside prefill chunks
  of 64 tokens) for chunk configs (BLOCK_M, BLOCK_N, warps, stages).
- shapes: decode configs across batch and context (head dims 64 and 128, the default splits),
  and chunk configs from 128 to 2048 new tokens over prefixes of 0-4096 (beside 32 decodes).
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

import memfit.ops.attention.paged as paged  # noqa: E402

HEADS_Q, HEADS_KV, PAGE, LAYERS = 32, 8, 16, 16


def case(decode_lens, prefill, head_dim, rng) -> tuple[list, dict]:
    """16 layers' (q, key pool, value pool) and the step's metadata: a sequence of one new token
    per entry of decode_lens (its length after the step), then one per (prefix, new tokens) of
    prefill; the blocks of all of them shuffled through the pools."""
    seqs = [(n, 1) for n in decode_lens] + [(p + q, q) for p, q in prefill]
    counts = [-(-n // PAGE) for n, _ in seqs]
    blocks = sum(counts) + 8
    order = list(range(blocks))
    rng.shuffle(order)
    table = torch.zeros(len(seqs), max(counts), dtype=torch.int32)
    at = 0
    for s, count in enumerate(counts):
        table[s, :count] = torch.tensor(order[at : at + count])
        at += count
    starts = [0]
    for _, q in seqs:
        starts.append(starts[-1] + q)
    tokens, device = starts[-1], "cuda"
    layers = [
        (
            torch.randn(tokens, HEADS_Q, head_dim, device=device, dtype=torch.bfloat16),
            torch.randn(blocks, PAGE, HEADS_KV, head_dim, device=device, dtype=torch.bfloat16),
            torch.randn(blocks, PAGE, HEADS_KV, head_dim, device=device, dtype=torch.bfloat16),
        )
        for _ in range(LAYERS)
    ]
    meta = {
        "block_table": table.to(device),
        "seq_lens": torch.tensor([n for n, _ in seqs], dtype=torch.int32, device=device),
        "query_start": torch.tensor(starts, dtype=torch.int32, device=device),
        "max_query_len": tokens if prefill else 1,
        "max_seq_len": 4096,
    }
    return layers, meta


def timed(layers, meta, splits) -> tuple[float, torch.Tensor]:
    """Microseconds a layer, and the first layer's output."""

    def run():
        return [paged.paged_attention(q, k, v, num_splits=splits, **meta) for q, k, v in layers]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        outs = run()  # (compiles, warms)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(7):
        start.record()
        for _ in range(5):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / 5 / LAYERS)
    return sorted(times)[3], outs[0]


DECODE_SWEEP = [(64, 2, 3), (32, 2, 3), (64, 4, 3), (32, 4, 3), (64, 2, 2), (64, 2, 4), (128, 4, 3),
                (128, 4, 2), (32, 1, 3), (16, 1, 3)]  # fmt: skip
CHUNK_SWEEP = [(128, 32, 4, 3), (64, 32, 4, 3), (64, 64, 4, 3), (32, 64, 4, 3), (64, 64, 4, 2),
               (128, 64, 4, 3), (128, 64, 8, 3), (32, 32, 2, 3), (16, 64, 2, 3), (32, 64, 2, 3)]  # fmt: skip


def loaded_part(rng) -> dict:
    decode_lens = [rng.randint(100, 640) for _ in range(64)]
    result = {"decode_lens": [100, 640], "decode": [], "mixed": []}
    defaults = dict(paged.DECODE_CONFIGS), dict(paged.CHUNK_CONFIGS)
    try:
        layers, meta = case(decode_lens, [], 64, rng)
        reference = None
        for config in DECODE_SWEEP:
            paged.DECODE_CONFIGS[64] = config
            for splits in (1, 2, 3, 4, 6, 8):
                us, out = timed(layers, meta, splits)
                reference = out if reference is None else reference
                err = (out.float() - reference.float()).abs().max().item()
                result["decode"].append({"config": config, "splits": splits, "us": us, "err": err})
                print(f"64 decodes {config} x{splits}: {us:.1f} us", flush=True)
        paged.DECODE_CONFIGS[64] = defaults[0][64]
        for prefill in ([(300, 32), (480, 32)], [(0, 64)], [(448, 64)]):
            layers, meta = case(decode_lens, prefill, 64, rng)
            for chunk in CHUNK_SWEEP:
                paged.CHUNK_CONFIGS[64] = chunk
                for decode in DECODE_SWEEP[0], (128, 4, 2):
                    paged.DECODE_CONFIGS[64] = decode
                    us, _ = timed(layers, meta, None)
                    result["mixed"].append(
                        {"prefill": prefill, "chunk": chunk, "decode": decode, "us": us}
                    )
                    print(f"64 decodes + {prefill}: chunk {chunk} decode {decode}: {us:.1f} us")
            del layers
    finally:
        paged.DECODE_CONFIGS.update(defaults[0])
        paged.CHUNK_CONFIGS.update(defaults[1])
    return result


def shapes_part(rng) -> dict:
    result = {"decode": [], "chunk": []}
    defaults = dict(paged.DECODE_CONFIGS), dict(paged.CHUNK_CONFIGS)
    device = torch.device("cuda")
    try:
        for head_dim in (64, 128):
            for batch, low, high in ((1, 512, 512), (1, 4096, 4096), (8, 4096, 4096),
                                     (64, 100, 640), (128, 2048, 2048), (256, 200, 700),
                                     (32, 1000, 3000)):  # fmt: skip
                lens = [rng.randint(low, high) for _ in range(batch)]
                layers, meta = case(lens, [], head_dim, rng)
                splits = paged.decode_splits(batch, HEADS_KV, 4096, device)
                for config in ((64, 2, 3), (64, 4, 3), (128, 4, 3), (128, 4, 2), (128, 8, 3)):
                    paged.DECODE_CONFIGS[head_dim] = config
                    us, _ = timed(layers, meta, None)
                    result["decode"].append({"head_dim": head_dim, "batch": batch,
                                             "context": [low, high], "splits": splits,
                                             "config": config, "us": us})  # fmt: skip
                    print(f"D={head_dim} {batch} of {low}-{high}: {config} {us:.1f} us")
                paged.DECODE_CONFIGS.update(defaults[0])
                del layers
        for prefill in ([(0, 2048)], [(4096, 2048)], [(0, 512)], [(1024, 512)],
                        [(0, 256), (300, 256)], [(0, 128)], [(2000, 128)]):  # fmt: skip
            layers, meta = case([rng.randint(100, 640) for _ in range(32)], prefill, 64, rng)
            for chunk in CHUNK_SWEEP[:7]:
                paged.CHUNK_CONFIGS[64] = chunk
                us, _ = timed(layers, meta, None)
                result["chunk"].append({"prefill": prefill, "config": chunk, "us": us})
                print(f"{prefill} beside 32 decodes: chunk {chunk} {us:.1f} us", flush=True)
            del layers
    finally:
        paged.DECODE_CONFIGS.update(defaults[0])
        paged.CHUNK_CONFIGS.update(defaults[1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", nargs="+", default=["loaded", "shapes"])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    rng = random.Random(0)
    run = {"env": harness.environment(), "heads": [HEADS_Q, HEADS_KV], "page": PAGE,
           "layers": LAYERS, "defaults": {"decode": dict(paged.DECODE_CONFIGS),
                                          "chunk": dict(paged.CHUNK_CONFIGS)}}  # fmt: skip
    for part in args.parts:
        run[part] = globals()[f"{part}_part"](rng)
    if args.out is not None:
        harness.RESULTS = args.out
    print(f"results: {harness.append_results('paged_tiles', run)}")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
